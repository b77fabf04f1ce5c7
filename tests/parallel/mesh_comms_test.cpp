// Sub-communicators of a mesh on the threads backend: every dimension set's communicator has the
// group's ranks in group_rank order, and collectives on them stay inside the group.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "comm/threads.h"
#include "core/error.h"
#include "parallel/mesh.h"

namespace loom::parallel {
namespace {

using ::testing::HasSubstr;

void check_mesh_comms(const Mesh& mesh) {
  comm::RunOptions o;
  o.comm.timeout = std::chrono::seconds(60);
  comm::run_ranks(mesh.world_size(), [&](comm::Comm& world) {
    MeshComms mc(mesh, world);
    const int r = world.rank();
    for (uint32_t mask = 1; mask < (1u << mesh.ndims()); ++mask) {
      std::vector<std::string> names;
      for (int i = 0; i < mesh.ndims(); ++i) if (mask & (1u << i)) names.push_back(mesh.dims()[size_t(i)].name);
      comm::Comm& g = mc.get(names);
      auto members = mesh.group_ranks(r, names);
      LOOM_CHECK(g.size() == int(members.size()) && g.rank() == mesh.group_rank(r, names),
                 "{}: rank {} is {} of {} in its group, expected {} of {}", mesh.str(), r, g.rank(), g.size(),
                 mesh.group_rank(r, names), members.size());
      // Gathering world ranks over the group gives exactly the group's members, in order.
      int32_t me = r;
      std::vector<int32_t> got(members.size());
      g.all_gather(&me, got.data(), int64_t(members.size()), DType::i32);
      for (size_t i = 0; i < members.size(); ++i) {
        LOOM_CHECK(got[i] == members[i], "{}: group of rank {} over mask {}: member {} is {}, expected {}", mesh.str(),
                   r, mask, i, got[i], members[i]);
      }
      float x = float(r);
      g.all_reduce(&x, 1, DType::f32);
      float want = 0;
      for (int q : members) want += float(q);
      LOOM_CHECK(x == want, "{}: sum over the group of rank {} is {}, expected {}", mesh.str(), r, x, want);
    }
    EXPECT_EQ(mc.coord("tp"), mesh.coord(r, "tp"));
    EXPECT_EQ(&mc["tp"], &mc.get({"tp"}));
  }, o);
}

TEST(MeshComms, EveryDimensionSet) {
  check_mesh_comms(Mesh::standard(2, 2, 1, 2));
  check_mesh_comms(Mesh::standard(1, 3, 2, 1));
  check_mesh_comms(Mesh::standard(1, 1, 1, 1));
}

TEST(MeshComms, SplitCommAndSizeMismatch) {
  Mesh mesh = Mesh::standard(1, 2, 1, 2);
  comm::run_ranks(4, [&](comm::Comm& world) {
    auto dp = split_comm(mesh, world, {"dp"});
    LOOM_CHECK(dp->size() == 2 && dp->rank() == mesh.coord(world.rank(), "dp"), "split_comm dp");
  });
  comm::ThreadWorld w(3);
  auto c = w.comm(0);
  EXPECT_THAT([&] { MeshComms(mesh, *c); },
              ::testing::ThrowsMessage<Error>(HasSubstr("communicator of 3 ranks for mesh pp=1 x dp=2 x cp=1 x tp=2")));
}

}  // namespace
}  // namespace loom::parallel
