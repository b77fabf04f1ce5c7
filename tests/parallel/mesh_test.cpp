// Mesh arithmetic: coordinates, ranks and groups of dimensions and their products, checked against
// brute-force enumeration. No communicator involved.
#include "parallel/mesh.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <set>

#include "core/error.h"

namespace loom::parallel {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(Mesh, StandardLayoutHasTpInnermost) {
  Mesh m({{"pp", 2}, {"dp", 2}, {"cp", 1}, {"tp", 2}});
  EXPECT_EQ(m.world_size(), 8);
  EXPECT_EQ(m, Mesh::standard(2, 2, 1, 2));
  EXPECT_EQ(m.str(), "pp=2 x dp=2 x cp=1 x tp=2");
  EXPECT_EQ(m.stride("tp"), 1);
  EXPECT_EQ(m.stride("cp"), 2);
  EXPECT_EQ(m.stride("dp"), 2);
  EXPECT_EQ(m.stride("pp"), 4);
  // rank = ((pp * 2 + dp) * 1 + cp) * 2 + tp
  EXPECT_THAT(m.coords(5), ElementsAre(1, 0, 0, 1));
  EXPECT_THAT(m.coords(6), ElementsAre(1, 1, 0, 0));
  EXPECT_EQ(m.coord(6, "dp"), 1);
  std::vector<int> c{1, 1, 0, 1};
  EXPECT_EQ(m.rank_of(c), 7);
  EXPECT_THAT(m.group_ranks(5, {"tp"}), ElementsAre(4, 5));
  EXPECT_THAT(m.group_ranks(5, {"dp"}), ElementsAre(5, 7));
  EXPECT_THAT(m.group_ranks(5, {"pp"}), ElementsAre(1, 5));
  EXPECT_THAT(m.group_ranks(5, {"cp"}), ElementsAre(5));
  EXPECT_THAT(m.group_ranks(5, {"dp", "cp"}), ElementsAre(5, 7));
  EXPECT_THAT(m.group_ranks(5, {"tp", "dp"}), ElementsAre(4, 5, 6, 7));
  EXPECT_THAT(m.group_ranks(2, {"pp", "tp"}), ElementsAre(2, 3, 6, 7));
  EXPECT_THAT(m.group_ranks(2, {}), ElementsAre(2));
  EXPECT_EQ(m.group_rank(5, {"tp", "dp"}), 1);  // row-major in mesh order: dp major, tp minor
  EXPECT_EQ(m.group_rank(6, {"tp", "dp"}), 2);
  EXPECT_EQ(m.group_index(6, {"tp", "dp"}), 1);  // the pp = 1 group
  EXPECT_EQ(m.num_groups({"tp"}), 4);
  EXPECT_EQ(m.group_size({"pp", "dp", "cp", "tp"}), 8);
  EXPECT_EQ(m.shift(5, "pp", 1), 1);
  EXPECT_EQ(m.shift(5, "tp", -1), 4);
  EXPECT_EQ(m.shift(4, "dp", 3), 6);
}

// Brute force: the group of r over dims D is every rank whose coordinates outside D equal r's.
void check_against_enumeration(const Mesh& m) {
  const int nd = m.ndims();
  for (uint32_t mask = 0; mask < (1u << nd); ++mask) {
    std::vector<std::string> names;
    for (int i = 0; i < nd; ++i) if (mask & (1u << i)) names.push_back(m.dims()[size_t(i)].name);
    EXPECT_EQ(m.mask(names), mask);
    std::set<int> indices;
    int members_total = 0;
    for (auto& g : m.groups(names)) members_total += int(g.size());
    EXPECT_EQ(members_total, m.world_size());
    for (int r = 0; r < m.world_size(); ++r) {
      auto cr = m.coords(r);
      EXPECT_EQ(m.rank_of(cr), r);
      std::vector<int> expect;
      for (int q = 0; q < m.world_size(); ++q) {
        auto cq = m.coords(q);
        bool same = true;
        for (int i = 0; i < nd; ++i) if (!(mask & (1u << i)) && cq[size_t(i)] != cr[size_t(i)]) same = false;
        if (same) expect.push_back(q);  // ascending rank = row-major over the group's dims
      }
      auto got = m.group_ranks(r, names);
      ASSERT_EQ(got, expect) << m.str() << " rank " << r << " mask " << mask;
      EXPECT_EQ(got[size_t(m.group_rank(r, names))], r);
      EXPECT_EQ(m.group_size(names), int(expect.size()));
      EXPECT_EQ(m.groups(names)[size_t(m.group_index(r, names))], expect);
      // Group index: row-major over the other dimensions.
      int gi = 0;
      for (int i = 0; i < nd; ++i) if (!(mask & (1u << i))) gi = gi * m.dims()[size_t(i)].size + cr[size_t(i)];
      EXPECT_EQ(m.group_index(r, names), gi);
      indices.insert(gi);
    }
    EXPECT_EQ(int(indices.size()), m.num_groups(names));
  }
}

TEST(Mesh, GroupsMatchEnumeration) {
  check_against_enumeration(Mesh::standard(2, 2, 1, 2));
  check_against_enumeration(Mesh::standard(3, 2, 2, 2));
  check_against_enumeration(Mesh::standard(1, 5, 1, 1));
  check_against_enumeration(Mesh::standard(2, 1, 3, 4));
  check_against_enumeration(Mesh({{"ep", 3}, {"tp", 2}}));
  check_against_enumeration(Mesh({{"only", 7}}));
}

TEST(Mesh, NamedOrderDoesNotChangeGroups) {
  Mesh m = Mesh::standard(2, 3, 2, 2);
  for (int r = 0; r < m.world_size(); ++r) {
    EXPECT_EQ(m.group_ranks(r, {"cp", "dp"}), m.group_ranks(r, {"dp", "cp"}));
    EXPECT_EQ(m.group_rank(r, {"tp", "pp"}), m.group_rank(r, {"pp", "tp"}));
  }
}

TEST(Mesh, BadInputGetsClearErrors) {
  EXPECT_THAT([] { Mesh({}); }, ::testing::ThrowsMessage<Error>(HasSubstr("at least one dimension")));
  EXPECT_THAT([] { Mesh({{"dp", 0}}); }, ::testing::ThrowsMessage<Error>(HasSubstr("'dp' has size 0")));
  EXPECT_THAT([] { Mesh({{"dp", 2}, {"dp", 2}}); }, ::testing::ThrowsMessage<Error>(HasSubstr("'dp' appears twice")));
  EXPECT_THAT([] { Mesh({{"", 2}}); }, ::testing::ThrowsMessage<Error>(HasSubstr("empty name")));
  Mesh m = Mesh::standard(2, 2, 1, 2);
  EXPECT_THAT([&] { m.group_ranks(0, {"ep"}); },
              ::testing::ThrowsMessage<Error>(HasSubstr("no dimension 'ep' in mesh pp=2 x dp=2 x cp=1 x tp=2")));
  EXPECT_THAT([&] { m.group_ranks(0, {"tp", "tp"}); }, ::testing::ThrowsMessage<Error>(HasSubstr("named twice")));
  EXPECT_THAT([&] { m.coords(8); }, ::testing::ThrowsMessage<Error>(HasSubstr("rank 8 outside")));
  std::vector<int> c{0, 2, 0, 0};
  EXPECT_THAT([&] { m.rank_of(c); }, ::testing::ThrowsMessage<Error>(HasSubstr("coordinate 2 of 'dp'")));
  std::vector<int> short_c{0, 1};
  EXPECT_THAT([&] { m.rank_of(short_c); }, ::testing::ThrowsMessage<Error>(HasSubstr("2 coordinates")));
  EXPECT_THAT([] { Mesh({{"a", 1 << 16}, {"b", 1 << 16}}); }, ::testing::ThrowsMessage<Error>(HasSubstr("too many")));
}

}  // namespace
}  // namespace loom::parallel
