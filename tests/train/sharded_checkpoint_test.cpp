// Sharded checkpoints (train/checkpoint.h, version 3): ranks write their slices of the full tensors
// at once and read back any elements under any split; the commit refuses a cover with a gap or an
// overlap and a rank that fails, leaving `latest` and the earlier checkpoints as they were; the
// ranks of a resume share the verification and agree on the checkpoint.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "comm/threads.h"
#include "core/error.h"
#include "train/checkpoint.h"

namespace fs = std::filesystem;
using namespace loom;

namespace {

// Three tensors of a model: a matrix, a vector, and the matrix's moment.
struct Model {
  std::vector<train::TensorInfo> infos{{"param/w", {12, 10}}, {"param/b", {7}}, {"adam_m/w", {12, 10}}};
  std::vector<std::vector<float>> values;
  Model() {
    std::mt19937 g(11);
    std::normal_distribution<float> d(0.f, 1.f);
    for (const auto& t : infos) {
      values.emplace_back(size_t(shape_numel(t.shape)));
      for (float& x : values.back()) x = d(g);
    }
  }
};

// Rank r's slices when the ranks split every tensor as a tensor-parallel column split would: each
// row of w cut into n column blocks (one slice per row and rank), b into contiguous ranges.
std::vector<train::Slice> column_split(const Model& m, int r, int n) {
  std::vector<train::Slice> out;
  for (size_t t = 0; t < m.infos.size(); ++t) {
    const Shape& s = m.infos[t].shape;
    const float* v = m.values[t].data();
    if (s.size() == 2) {
      const int64_t cols = s[1], per = (cols + n - 1) / n, c0 = std::min<int64_t>(r * per, cols),
                    c1 = std::min<int64_t>(c0 + per, cols);
      if (c0 < c1)
        for (int64_t row = 0; row < s[0]; ++row)
          out.push_back({m.infos[t].name, row * cols + c0, c1 - c0, v + row * cols + c0});
    } else {
      const int64_t len = s[0], per = (len + n - 1) / n, a = std::min<int64_t>(r * per, len),
                    b = std::min<int64_t>(a + per, len);
      if (a < b) out.push_back({m.infos[t].name, a, b - a, v + a});
    }
  }
  return out;
}

train::CheckpointMeta meta(int64_t step) {
  train::CheckpointMeta m;
  m.step = m.optimizer_steps = m.data_position = step;
  m.seed = 3;
  m.model = {{"n_layer", 1}};
  return m;
}

struct Dir {
  fs::path p;
  explicit Dir(const std::string& name)
      : p(fs::temp_directory_path() / fmt::format("loom_sharded_{}_{}", name, ::getpid())) {
    fs::remove_all(p);
  }
  ~Dir() { fs::remove_all(p); }
};

// Runs body(comm) on n rank threads, keeping each rank's error message ("" when it succeeded).
std::vector<std::string> on_ranks(int n, const std::function<void(comm::Comm&)>& body) {
  std::vector<std::string> errors(static_cast<size_t>(n));
  comm::run_ranks(n, [&](comm::Comm& c) {
    try {
      body(c);
    } catch (const Error& e) {
      errors[size_t(c.rank())] = e.what();
    }
  });
  return errors;
}

}  // namespace

// Three ranks write a column split; the checkpoint reads back whole, and in any ranges (the
// elements another layout's rank would take), bit for bit; each rank wrote only its own slices.
TEST(ShardedCheckpoint, RanksWriteTheirSlicesAndAnyRangeReadsBack) {
  Model m;
  Dir d("write");
  std::vector<std::string> paths(3);
  const auto errors = on_ranks(3, [&](comm::Comm& c) {
    paths[size_t(c.rank())] =
        train::save_checkpoint(c, d.p.string(), meta(5), m.infos, column_split(m, c.rank(), c.size()));
  });
  for (const auto& e : errors) ASSERT_EQ(e, "");
  const std::string ckpt = (d.p / "ckpt_00000005").string();
  for (const auto& p : paths) EXPECT_EQ(p, ckpt);
  EXPECT_EQ(train::latest_checkpoint(d.p.string()), ckpt);
  for (int r = 0; r < 3; ++r) {
    EXPECT_TRUE(fs::exists(fs::path(ckpt) / fmt::format("rank_{:05d}.safetensors", r)));
    // A rank's file holds its share (4 of 12 columns of each row of w and of adam_m/w, 3 of 7 of b;
    // the last rank 2 and 1), never the full tensors.
    const int64_t cols = r < 2 ? 4 : 2, bn = r < 2 ? 3 : 1;
    const int64_t data = (2 * 12 * cols + bn) * 4;
    EXPECT_LT(fs::file_size(fs::path(ckpt) / fmt::format("rank_{:05d}.safetensors", r)), uintmax_t(data + 1000));
  }
  train::verify_checkpoint(ckpt);
  train::CheckpointReader reader(ckpt);
  EXPECT_EQ(reader.shape("param/w"), (Shape{12, 10}));
  std::mt19937 g(5);
  for (size_t t = 0; t < m.infos.size(); ++t) {
    const int64_t n = int64_t(m.values[t].size());
    std::vector<float> all(static_cast<size_t>(n));
    reader.read(m.infos[t].name, 0, n, all.data());
    EXPECT_EQ(all, m.values[t]) << m.infos[t].name;
    for (int k = 0; k < 50; ++k) {  // random ranges, crossing the ranks' pieces
      const int64_t a = int64_t(g() % uint64_t(n)), len = 1 + int64_t(g() % uint64_t(n - a));
      std::vector<float> part(static_cast<size_t>(len));
      reader.read(m.infos[t].name, a, len, part.data());
      EXPECT_TRUE(std::equal(part.begin(), part.end(), m.values[t].begin() + a)) << m.infos[t].name << " [" << a
                                                                                 << ", " << a + len << ")";
    }
  }
  EXPECT_THROW(reader.read("param/w", 100, 21, std::vector<float>(21).data()), Error);
  EXPECT_THROW(reader.shape("param/x"), Error);
}

// Slices that leave elements out, or give one twice, are refused at the commit by every rank; the
// earlier checkpoint stays `latest` and nothing of the refused one is left.
TEST(ShardedCheckpoint, AGapOrAnOverlapIsRefusedAndTheEarlierCheckpointKept) {
  Model m;
  Dir d("cover");
  ASSERT_EQ(on_ranks(2, [&](comm::Comm& c) {
              train::save_checkpoint(c, d.p.string(), meta(1), m.infos, column_split(m, c.rank(), 2));
            }),
            std::vector<std::string>(2, ""));
  for (bool gap : {true, false}) {
    const auto errors = on_ranks(2, [&](comm::Comm& c) {
      auto mine = column_split(m, c.rank(), 2);
      if (c.rank() == 1) {
        if (gap) std::erase_if(mine, [](const train::Slice& x) { return x.name == "param/b"; });  // b's second half
        else mine.push_back(mine.front());  // a row of w twice
      }
      train::save_checkpoint(c, d.p.string(), meta(2), m.infos, mine);
    });
    for (const auto& e : errors) {
      ASSERT_NE(e, "") << "a bad cover was committed";
      EXPECT_NE(e.find("the checkpoint of step 2 could not be written"), std::string::npos) << e;
      EXPECT_NE(e.find("the earlier checkpoints are kept"), std::string::npos) << e;
    }
    EXPECT_NE(errors[0].find(gap ? "'param/b': the slices end at element 4 of 7" : "in two ranks' slices"),
              std::string::npos)
        << errors[0];
    EXPECT_EQ(train::latest_checkpoint(d.p.string()), (d.p / "ckpt_00000001").string());
    EXPECT_FALSE(fs::exists(d.p / "ckpt_00000002"));
    EXPECT_FALSE(fs::exists(d.p / ".tmp_ckpt_00000002"));
  }
}

// A rank whose parameters are not finite fails the write: every rank says which rank failed and
// what it found (the parameter and the index), as a RankError naming that rank (a job reports its
// failure as that rank's, whichever rank reports first), and nothing is committed.
TEST(ShardedCheckpoint, AFailingRankFailsTheCheckpointOnEveryRank) {
  Model m;
  m.values[0][3 * 10 + 8] = std::nanf("");  // param/w row 3, column 8: rank 2's of 3
  Dir d("fail");
  std::vector<int> origin(3, -1);  // the rank each rank's error names as the job's failure
  const auto errors = on_ranks(3, [&](comm::Comm& c) {
    try {
      train::save_checkpoint(c, d.p.string(), meta(4), m.infos, column_split(m, c.rank(), 3));
    } catch (const RankError& e) {
      origin[size_t(c.rank())] = e.rank();
      throw;
    }
  });
  EXPECT_EQ(origin, std::vector<int>(3, 2));
  for (const std::string& e : errors)
    EXPECT_NE(e.find("rank 2: not writing the checkpoint of step 4: parameter 'w' holds nan at index 38"),
              std::string::npos)
        << e;
  EXPECT_EQ(train::latest_checkpoint(d.p.string()), "");
  EXPECT_FALSE(fs::exists(d.p / "ckpt_00000004"));
  EXPECT_FALSE(fs::exists(d.p / ".tmp_ckpt_00000004"));
}

// One flipped byte in rank 1's file of the newest checkpoint: a read that touches it names the
// file; the ranks of a resume (each verifying its share of the files) all pass over it to the
// checkpoint before, and say why.
TEST(ShardedCheckpoint, ACorruptRankFileIsFoundAndEveryRankResumesTheEarlierCheckpoint) {
  Model m;
  Dir d("resume");
  for (int64_t step : {1, 2})
    ASSERT_EQ(on_ranks(3, [&](comm::Comm& c) {
                train::save_checkpoint(c, d.p.string(), meta(step), m.infos, column_split(m, c.rank(), 3));
              }),
              std::vector<std::string>(3, ""));
  const fs::path bad = d.p / "ckpt_00000002" / "rank_00001.safetensors";
  {
    std::fstream f(bad, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(-9, std::ios::end);
    char c = 0;
    f.read(&c, 1);
    c = char(c ^ 0x20);
    f.seekp(-9, std::ios::end);
    f.write(&c, 1);
  }
  {
    train::CheckpointReader reader((d.p / "ckpt_00000002").string());
    std::vector<float> w(120);
    try {
      reader.read("adam_m/w", 0, 120, w.data());
      ADD_FAILURE() << "a corrupt piece was read";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("rank_00001.safetensors: tensor 'adam_m/w' is corrupt"), std::string::npos)
          << e.what();
    }
  }
  std::vector<std::string> chosen(3);
  std::vector<std::vector<std::string>> notes(3);
  const auto errors = on_ranks(3, [&](comm::Comm& c) {
    chosen[size_t(c.rank())] = train::resume_checkpoint(d.p.string(), &notes[size_t(c.rank())], &c);
  });
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(errors[size_t(r)], "");
    EXPECT_EQ(chosen[size_t(r)], (d.p / "ckpt_00000001").string()) << "rank " << r;
    ASSERT_EQ(notes[size_t(r)].size(), 1u) << "rank " << r;
    EXPECT_NE(notes[size_t(r)][0].find("rank_00001.safetensors"), std::string::npos) << notes[size_t(r)][0];
  }
}
