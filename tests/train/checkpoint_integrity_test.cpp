// Checkpoint integrity: every stored tensor's bytes, every rank's index and the manifest itself
// carry a CRC-32 that loading checks; a manifest's step must be its directory's; parameters and the
// optimizer's state must be finite; resuming passes
// over a checkpoint that fails verification to the newest one that passes, saying so; and 100
// random single-byte changes to a checkpoint (tensor data and header, manifest, its checksum,
// `latest`) each either load bit-identically (the byte was padding) or are refused naming a file
// of the checkpoint, never loaded with changed values.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/file.h"
#include "data/shard.h"
#include "train/checkpoint.h"
#include "train/safetensors.h"

namespace fs = std::filesystem;
using namespace loom;

namespace {

struct Fixture {
  fs::path dir;
  MemoryPool pool{"ckpt-test"};
  std::vector<train::NamedTensor> tensors;
  explicit Fixture(const std::string& name) : dir(fs::temp_directory_path() / ("loom_ckpt_" + name + "_" + std::to_string(::getpid()))) {
    fs::remove_all(dir);
    std::mt19937 g(7);
    std::normal_distribution<float> d(0.f, 1.f);
    for (const char* n : {"param/a", "param/b", "adam_m/a", "adam_m/b", "adam_v/a", "adam_v/b"}) {
      Tensor t = Tensor::empty({37, 5}, DType::f32, MemTag::workspace, pool);
      const bool second_moment = std::string(n).rfind("adam_v/", 0) == 0;  // >= 0, as AdamW's are
      for (int64_t i = 0; i < t.numel(); ++i) t.f32()[i] = second_moment ? std::fabs(d(g)) : d(g);
      tensors.push_back({n, t});
    }
  }
  ~Fixture() { fs::remove_all(dir); }
  train::CheckpointMeta meta(int64_t step) const {
    train::CheckpointMeta m;
    m.step = m.data_position = m.optimizer_steps = step;
    m.seed = 5;
    m.model = {{"n_layer", 1}};
    m.config_toml = "x = 1\n";
    return m;
  }
  std::vector<train::NamedTensor> empty_like() {
    std::vector<train::NamedTensor> v;
    for (const auto& t : tensors) v.push_back({t.name, Tensor::empty(t.tensor.shape(), DType::f32, MemTag::workspace, pool)});
    return v;
  }
};

void flip_byte(const fs::path& file, size_t offset, uint8_t mask) {
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(std::streamoff(offset));
  char c = 0;
  f.read(&c, 1);
  c = char(uint8_t(c) ^ mask);
  f.seekp(std::streamoff(offset));
  f.write(&c, 1);
}

// Rewrites checkpoint c's manifest through `change`, with its checksum file to match (a writer
// that is consistent, but not loom), or without one when `checksum` is false.
template <class Change>
void rewrite_manifest(const std::string& c, Change&& change, bool checksum = true) {
  const fs::path mp = fs::path(c) / "manifest.json";
  nlohmann::json m = nlohmann::json::parse(std::ifstream(mp));
  change(m);
  const std::string text = m.dump(2) + "\n";
  std::ofstream(mp, std::ios::trunc) << text;
  if (checksum)
    std::ofstream(fs::path(c) / "manifest.crc32", std::ios::trunc) << data::crc32(text.data(), text.size()) << "\n";
  else
    fs::remove(fs::path(c) / "manifest.crc32");
}

// Sets element i of the fixture's tensor k to v in checkpoint c's file (six tensors of 37 x 5
// floats, in order), with the tensor's checksum in the index, and the index's in the manifest,
// rewritten to match (a consistent writer that is not loom).
void set_stored(const Fixture& f, const std::string& c, size_t k, int64_t i, float v) {
  const fs::path st = fs::path(c) / "rank_00000.safetensors";
  {
    std::fstream io(st, std::ios::in | std::ios::out | std::ios::binary);
    io.seekp(std::streamoff(fs::file_size(st) - (6 - k) * 740 + size_t(i) * 4));
    io.write(reinterpret_cast<const char*>(&v), 4);
  }
  std::vector<float> values(f.tensors[k].tensor.f32(), f.tensors[k].tensor.f32() + 185);
  values[size_t(i)] = v;
  const fs::path ip = fs::path(c) / "rank_00000.json";
  nlohmann::json index = nlohmann::json::parse(std::ifstream(ip));
  index["tensors"][f.tensors[k].name]["crc32"] = data::crc32(values.data(), values.size() * 4);
  const std::string itext = index.dump(1) + "\n";
  std::ofstream(ip, std::ios::trunc) << itext;
  rewrite_manifest(c, [&](nlohmann::json& m) { m["shards"][0]["crc32"] = data::crc32(itext.data(), itext.size()); });
}

// What f() throws (a loom::Error's message), or "no error".
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

bool same(const std::vector<train::NamedTensor>& a, const std::vector<train::NamedTensor>& b) {
  for (size_t i = 0; i < a.size(); ++i)
    if (std::memcmp(a[i].tensor.raw(), b[i].tensor.raw(), a[i].tensor.nbytes()) != 0) return false;
  return true;
}

}  // namespace

TEST(CheckpointIntegrity, ChecksumsAreWrittenAndLoadingChecksThem) {
  Fixture f("sums");
  const std::string c = train::save_checkpoint(f.dir.string(), f.meta(3), f.tensors);
  const train::CheckpointMeta m = train::read_checkpoint_meta(c);
  ASSERT_EQ(m.tensors.size(), f.tensors.size());
  ASSERT_EQ(m.index_crcs.size(), 1u);
  const nlohmann::json index = nlohmann::json::parse(std::ifstream(fs::path(c) / "rank_00000.json"));
  EXPECT_EQ(index["tensors"]["param/a"]["crc32"].get<uint32_t>(),
            data::crc32(f.tensors[0].tensor.raw(), f.tensors[0].tensor.nbytes()));
  EXPECT_EQ(index["tensors"]["param/a"]["slices"], nlohmann::json::parse("[[0, 185]]"));
  EXPECT_TRUE(fs::exists(fs::path(c) / "manifest.crc32"));
  auto got = f.empty_like();
  train::load_checkpoint_tensors(c, got);
  EXPECT_TRUE(same(got, f.tensors));
  train::verify_checkpoint(c);

  // One bit of param/b's data: the load names the file and the tensor.
  const fs::path st = fs::path(c) / "rank_00000.safetensors";
  flip_byte(st, fs::file_size(st) - 5 * 37 * 4 * 4 - 3, 0x10);  // inside param/b (the 2nd of 6 tensors of 740 bytes)
  try {
    train::load_checkpoint_tensors(c, got);
    ADD_FAILURE() << "a corrupted tensor was loaded";
  } catch (const Error& e) {
    const std::string w = e.what();
    EXPECT_NE(w.find("rank_00000.safetensors"), std::string::npos) << w;
    EXPECT_NE(w.find("'param/b' is corrupt"), std::string::npos) << w;
  }
  EXPECT_THROW(train::verify_checkpoint(c), Error);
}

// The newest checkpoint is corrupt: resuming takes the one before, with a note naming what was
// passed over; with no good checkpoint at all, resuming is refused (not started over).
TEST(CheckpointIntegrity, ResumeFallsBackToThePreviousGoodCheckpoint) {
  Fixture f("fallback");
  const std::string c1 = train::save_checkpoint(f.dir.string(), f.meta(1), f.tensors, 2);
  f.tensors[0].tensor.f32()[0] += 1.f;
  const std::string c2 = train::save_checkpoint(f.dir.string(), f.meta(2), f.tensors, 2);
  std::vector<std::string> notes;
  EXPECT_EQ(train::resume_checkpoint(f.dir.string(), &notes), c2);
  EXPECT_TRUE(notes.empty());
  flip_byte(fs::path(c2) / "rank_00000.safetensors", fs::file_size(fs::path(c2) / "rank_00000.safetensors") - 1, 0x01);
  EXPECT_EQ(train::resume_checkpoint(f.dir.string(), &notes), c1);
  ASSERT_EQ(notes.size(), 1u);
  EXPECT_NE(notes[0].find(c2), std::string::npos) << notes[0];
  flip_byte(fs::path(c1) / "manifest.json", 10, 0x01);
  try {
    train::resume_checkpoint(f.dir.string(), &notes);
    ADD_FAILURE() << "resumed with no good checkpoint";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no checkpoint to resume from passes verification"), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(train::resume_checkpoint((f.dir / "nothing_here").string(), &notes), "");
}

// A manifest whose step is not its directory's (consistently rewritten, checksum included) is not
// believed.
TEST(CheckpointIntegrity, ManifestStepMustMatchItsDirectory) {
  Fixture f("step");
  const std::string c = train::save_checkpoint(f.dir.string(), f.meta(20), f.tensors);
  rewrite_manifest(c, [](nlohmann::json& m) { m["step"] = 3; });
  try {
    train::read_checkpoint_meta(c);
    ADD_FAILURE() << "a manifest of step 3 in the directory of step 20 was read";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("field 'step' is 3 but the checkpoint directory is named for step 20"),
              std::string::npos)
        << e.what();
  }
}

// Weights that are not finite: not written (the earlier checkpoints stay), and not loaded from a
// checkpoint whose checksums agree with them (another writer's).
TEST(CheckpointIntegrity, NonFiniteParametersAreRefused) {
  Fixture f("nan");
  const std::string good = train::save_checkpoint(f.dir.string(), f.meta(1), f.tensors);
  f.tensors[1].tensor.f32()[17] = std::nanf("");
  try {
    train::save_checkpoint(f.dir.string(), f.meta(2), f.tensors);
    ADD_FAILURE() << "NaN weights were written";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("parameter 'b' holds nan at index 17"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(fs::exists(f.dir / "ckpt_00000002"));
  std::vector<std::string> notes;
  EXPECT_EQ(train::resume_checkpoint(f.dir.string(), &notes), good);
  // The good checkpoint's param/b made NaN at 17, the checksums rewritten to match.
  set_stored(f, good, 1, 17, std::nanf(""));
  auto got = f.empty_like();
  try {
    train::load_checkpoint_tensors(good, got);
    ADD_FAILURE() << "NaN weights were loaded";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("parameter 'b' holds nan at index 17"), std::string::npos) << e.what();
  }
}

// The optimizer's state is checked as the weights are: a NaN moment is not written, and one found
// on reading (checksums rewritten to match) is refused naming the file and the tensor, as is a
// negative second moment; resuming passes over that checkpoint to the earlier one.
TEST(CheckpointIntegrity, NonFiniteOrNegativeOptimizerStateIsRefused) {
  Fixture f("moments");
  const std::string first = train::save_checkpoint(f.dir.string(), f.meta(1), f.tensors);
  const std::string good = train::save_checkpoint(f.dir.string(), f.meta(2), f.tensors, /*keep=*/2);
  const float saved = f.tensors[3].tensor.f32()[9];
  f.tensors[3].tensor.f32()[9] = std::nanf("");  // adam_m/b
  std::string e = error_of([&] { train::save_checkpoint(f.dir.string(), f.meta(3), f.tensors); });
  EXPECT_NE(e.find("tensor 'adam_m/b' holds nan at index 9"), std::string::npos) << e;
  f.tensors[3].tensor.f32()[9] = saved;
  EXPECT_FALSE(fs::exists(f.dir / "ckpt_00000003"));
  set_stored(f, good, 3, 9, std::nanf(""));
  auto got = f.empty_like();
  e = error_of([&] { train::load_checkpoint_tensors(good, got); });
  EXPECT_NE(e.find("ckpt_00000002: tensor 'adam_m/b' holds nan at index 9"), std::string::npos) << e;
  std::vector<std::string> notes;
  EXPECT_EQ(train::resume_checkpoint(f.dir.string(), &notes), first);
  set_stored(f, first, 5, 9, -1.f);  // adam_v/b
  e = error_of([&] { train::verify_checkpoint(first); });
  EXPECT_NE(e.find("tensor 'adam_v/b' holds -1 at index 9"), std::string::npos) << e;
}

// A rank's index that lacks a tensor the manifest lists (checksums rewritten to match) is refused
// when the checkpoint is opened, naming the tensor; so is a manifest shape of more than 2^50
// elements, before anything is allocated for it.
TEST(CheckpointIntegrity, AnIndexWithoutATensorOrAHugeShapeIsRefusedOnOpening) {
  Fixture f("cover");
  const std::string c = train::save_checkpoint(f.dir.string(), f.meta(1), f.tensors);
  const fs::path ip = fs::path(c) / "rank_00000.json";
  const std::string original_index = read_file(ip.string());
  nlohmann::json index = nlohmann::json::parse(original_index);
  index["tensors"].erase("param/b");
  const std::string itext = index.dump(1) + "\n";
  std::ofstream(ip, std::ios::trunc) << itext;
  rewrite_manifest(c, [&](nlohmann::json& m) { m["shards"][0]["crc32"] = data::crc32(itext.data(), itext.size()); });
  std::string e = error_of([&] { train::CheckpointReader r(c); });
  EXPECT_NE(e.find("tensor 'param/b': the slices end at element 0 of 185"), std::string::npos) << e;
  rewrite_manifest(c, [&](nlohmann::json& m) { m["tensors"][0]["shape"] = {int64_t(1) << 40, int64_t(1) << 40}; });
  e = error_of([&] { train::read_checkpoint_meta(c); });
  EXPECT_NE(e.find("manifest.json: tensor 'param/a': shape [1099511627776, 1099511627776] has more than 2^50 elements"),
            std::string::npos)
      << e;
}

// A folder where a checkpoint's file belongs is an error naming it, and resuming passes over that
// checkpoint; a `latest` that is a folder stops a resume before anything changes (the run could not
// write its checkpoints), and a save that cannot replace `latest` leaves no trace of itself.
TEST(CheckpointIntegrity, FoldersWhereFilesBelongAreNamed) {
  Fixture f("folders");
  const std::string first = train::save_checkpoint(f.dir.string(), f.meta(1), f.tensors);
  const std::string second = train::save_checkpoint(f.dir.string(), f.meta(2), f.tensors, /*keep=*/2);
  const fs::path crc = fs::path(second) / "manifest.crc32";
  fs::remove(crc);
  fs::create_directory(crc);
  std::vector<std::string> notes;
  EXPECT_EQ(train::resume_checkpoint(f.dir.string(), &notes), first);
  ASSERT_FALSE(notes.empty());
  EXPECT_NE(notes[0].find(crc.string() + ": is a directory, not a file"), std::string::npos) << notes[0];
  fs::remove_all(second);
  fs::remove(f.dir / "latest");
  fs::create_directory(f.dir / "latest");
  std::string e = error_of([&] { train::resume_checkpoint(f.dir.string(), &notes); });
  EXPECT_NE(e.find((f.dir / "latest").string() + ": is not a file"), std::string::npos) << e;
  e = error_of([&] { train::save_checkpoint(f.dir.string(), f.meta(3), f.tensors, /*keep=*/3); });
  EXPECT_NE(e.find("the checkpoint of step 3 could not be written (removed;"), std::string::npos) << e;
  EXPECT_FALSE(fs::exists(f.dir / "ckpt_00000003"));
  EXPECT_FALSE(fs::exists(f.dir / "latest.tmp"));
  EXPECT_TRUE(fs::exists(first));
}

// Checkpoints of one state.safetensors written by rank 0 (version 2, with checksums, and version
// 1, before them) still load, and a version 2 checksum still catches a changed byte.
TEST(CheckpointIntegrity, VersionOneAndTwoCheckpointsStillLoad) {
  Fixture f("v1");
  for (int version : {1, 2}) {
    const fs::path c = f.dir / fmt::format("v{}", version) / "ckpt_00000004";
    fs::create_directories(c);
    train::SafetensorsWriter w;
    nlohmann::json sums = nlohmann::json::object();
    for (const auto& t : f.tensors) {
      w.add(t.name, t.tensor);
      sums[t.name] = data::crc32(t.tensor.raw(), t.tensor.nbytes());
    }
    w.write((c / "state.safetensors").string());
    nlohmann::json m = {{"format", "loom-checkpoint"}, {"version", version}, {"step", 4}, {"optimizer_steps", 4},
                        {"data_position", 4}, {"rng", {{"seed", 5}}}, {"model", {{"n_layer", 1}}},
                        {"config_toml", ""}, {"tensors", 6}};
    if (version == 2) m["checksums"] = sums;
    const std::string text = m.dump(2) + "\n";
    std::ofstream(c / "manifest.json") << text;
    if (version == 2) std::ofstream(c / "manifest.crc32") << data::crc32(text.data(), text.size()) << "\n";
    auto got = f.empty_like();
    train::load_checkpoint_tensors(c.string(), got);
    EXPECT_TRUE(same(got, f.tensors)) << "version " << version;
    EXPECT_EQ(train::read_checkpoint_meta(c.string()).checksums.empty(), version == 1);
    EXPECT_EQ(train::resume_checkpoint(c.parent_path().string(), nullptr), c.string());
    train::CheckpointReader r(c.string());
    float x[3];
    r.read("param/b", 7, 3, x);
    EXPECT_EQ(std::memcmp(x, f.tensors[1].tensor.f32() + 7, sizeof(x)), 0);
  }
  const fs::path st = f.dir / "v2" / "ckpt_00000004" / "state.safetensors";
  flip_byte(st, fs::file_size(st) - 1, 0x04);
  EXPECT_THROW(train::verify_checkpoint((f.dir / "v2" / "ckpt_00000004").string()), Error);
}

// 100 single-byte changes at random places of a checkpoint's files: each either resumes with the
// same step and tensors, bit for bit, or is refused with loom's error naming a file of the run.
TEST(CheckpointIntegrity, RandomByteChangesLoadIdenticallyOrAreRefused) {
  Fixture f("corrupt");
  const std::string pristine = (f.dir / "pristine").string();
  train::save_checkpoint(pristine, f.meta(6), f.tensors);
  std::mt19937 g(2026);
  int refused = 0, identical = 0;
  const std::vector<std::string> files{"ckpt_00000006/rank_00000.safetensors", "ckpt_00000006/manifest.json",
                                       "ckpt_00000006/manifest.crc32", "ckpt_00000006/rank_00000.json", "latest"};
  for (int trial = 0; trial < 100; ++trial) {
    const fs::path run = f.dir / ("run" + std::to_string(trial));
    fs::copy(pristine, run, fs::copy_options::recursive);
    // State data half the time (most of the bytes), the small files the rest.
    const std::string rel = files[trial % 2 == 0 ? 0 : 1 + size_t(g() % 4)];
    const fs::path target = run / rel;
    const size_t at = size_t(g() % fs::file_size(target));
    const uint8_t mask = uint8_t(1 + g() % 255);
    flip_byte(target, at, mask);
    try {
      std::vector<std::string> notes;
      const std::string c = train::resume_checkpoint(run.string(), &notes);
      ASSERT_FALSE(c.empty()) << rel << " byte " << at;
      const train::CheckpointMeta m = train::read_checkpoint_meta(c);
      auto got = f.empty_like();
      train::load_checkpoint_tensors(c, got);
      EXPECT_EQ(m.step, 6) << rel << " byte " << at;
      EXPECT_EQ(m.data_position, 6) << rel << " byte " << at;
      EXPECT_TRUE(same(got, f.tensors)) << "changed values loaded: " << rel << " byte " << at;
      ++identical;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(run.string()), std::string::npos)
          << rel << " byte " << at << ": the error names no file of the run: " << e.what();
      ++refused;
    }
    fs::remove_all(run);
  }
  EXPECT_EQ(refused + identical, 100);
  EXPECT_GT(refused, 50);
  std::printf("[corruption] 100 single-byte changes: %d refused naming the file, %d loaded bit-identically\n", refused,
              identical);
}

// fp16's loss scaler state travels in the manifest (absent for other runs), and a malformed one is
// refused naming the field.
TEST(CheckpointIntegrity, LossScaleIsKeptInTheManifest) {
  Fixture f("loss_scale");
  const std::string plain = train::save_checkpoint(f.dir.string(), f.meta(1), f.tensors, 10);
  EXPECT_EQ(train::read_checkpoint_meta(plain).loss_scale, 0.0);
  train::CheckpointMeta m = f.meta(2);
  m.loss_scale = 2048;
  m.loss_scale_clean = 7;
  const std::string c = train::save_checkpoint(f.dir.string(), m, f.tensors, 10);
  const train::CheckpointMeta back = train::read_checkpoint_meta(c);
  EXPECT_EQ(back.loss_scale, 2048.0);
  EXPECT_EQ(back.loss_scale_clean, 7);
  for (double bad : {-1.0, 0.0, 1e300}) {
    rewrite_manifest(c, [bad](nlohmann::json& j) { j["loss_scale"]["scale"] = bad; });
    try {
      train::read_checkpoint_meta(c);
      ADD_FAILURE() << "a loss scale of " << bad << " was read";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("field 'loss_scale'"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("manifest.json"), std::string::npos) << e.what();
    }
  }
}
