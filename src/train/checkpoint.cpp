#include "train/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <thread>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "core/error.h"
#include "train/safetensors.h"

namespace fs = std::filesystem;

namespace loom::train {

namespace {

void fsync_path(const std::string& path, bool directory) {
  int fd = ::open(path.c_str(), directory ? (O_RDONLY | O_DIRECTORY) : O_RDONLY);
  if (fd < 0) throw Error(fmt::format("{}: cannot open to fsync: {}", path, std::strerror(errno)));
  int rc = ::fsync(fd);
  ::close(fd);
  if (rc != 0) throw Error(fmt::format("{}: fsync failed: {}", path, std::strerror(errno)));
}

void write_text_durably(const std::string& path, const std::string& text) {
  std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    if (!f) throw Error(fmt::format("{}: cannot create", tmp));
    f << text;
    f.flush();
    if (!f) throw Error(fmt::format("{}: write failed", tmp));
  }
  fsync_path(tmp, false);
  if (std::rename(tmp.c_str(), path.c_str()) != 0)
    throw Error(fmt::format("{}: rename from {} failed: {}", path, tmp, std::strerror(errno)));
}

std::string ckpt_name(int64_t step) { return fmt::format("ckpt_{:08d}", step); }

}  // namespace

std::string save_checkpoint(const std::string& dir, const CheckpointMeta& meta,
                            const std::vector<NamedTensor>& tensors, int64_t keep) {
  fs::create_directories(dir);
  std::string final_dir = (fs::path(dir) / ckpt_name(meta.step)).string();
  std::string tmp_dir = (fs::path(dir) / (".tmp_" + ckpt_name(meta.step))).string();
  fs::remove_all(tmp_dir);
  fs::create_directories(tmp_dir);

  SafetensorsWriter w;
  for (const auto& t : tensors) w.add(t.name, t.tensor);
  w.set_metadata("format", "loom-checkpoint");
  w.set_metadata("version", std::to_string(kCheckpointVersion));
  std::string st_path = (fs::path(tmp_dir) / "state.safetensors").string();
  w.write(st_path);
  fsync_path(st_path, false);
  // LOOM_CHECKPOINT_PAUSE_MS widens the window between the two files of a checkpoint, so tests
  // that kill the process at random moments land inside checkpoint writes often.
  if (const char* pause = std::getenv("LOOM_CHECKPOINT_PAUSE_MS"))
    std::this_thread::sleep_for(std::chrono::milliseconds(std::atoi(pause)));

  nlohmann::json m;
  m["format"] = "loom-checkpoint";
  m["version"] = kCheckpointVersion;
  m["step"] = meta.step;
  m["optimizer_steps"] = meta.optimizer_steps;
  m["data_position"] = meta.data_position;
  m["rng"] = {{"seed", meta.seed}, {"kind", "philox4x32-10 counters keyed by (seed, stream, index)"}};
  m["model"] = meta.model;
  m["config_toml"] = meta.config_toml;
  if (!meta.vocabulary.empty()) m["vocabulary"] = meta.vocabulary;
  m["tensors"] = tensors.size();
  write_text_durably((fs::path(tmp_dir) / "manifest.json").string(), m.dump(2) + "\n");
  fsync_path(tmp_dir, true);

  fs::remove_all(final_dir);  // a previous run's checkpoint of the same step
  fs::rename(tmp_dir, final_dir);
  fsync_path(dir, true);
  write_text_durably((fs::path(dir) / "latest").string(), ckpt_name(meta.step) + "\n");
  fsync_path(dir, true);

  // Retention: keep the newest `keep` complete checkpoints (never the one `latest` names).
  std::vector<std::string> all;
  for (auto& e : fs::directory_iterator(dir)) {
    std::string n = e.path().filename().string();
    if (e.is_directory() && n.rfind("ckpt_", 0) == 0) all.push_back(n);
    else if (e.is_directory() && n.rfind(".tmp_ckpt_", 0) == 0) fs::remove_all(e.path());  // interrupted writes
  }
  std::sort(all.begin(), all.end());
  for (size_t i = 0; i + size_t(std::max<int64_t>(keep, 1)) < all.size(); ++i)
    if (all[i] != ckpt_name(meta.step)) fs::remove_all(fs::path(dir) / all[i]);
  return final_dir;
}

std::string latest_checkpoint(const std::string& dir) {
  auto complete = [](const fs::path& c) {
    return fs::exists(c / "manifest.json") && fs::exists(c / "state.safetensors");
  };
  fs::path p = fs::path(dir) / "latest";
  if (!fs::exists(p)) {
    // No pointer (deleted, or lost): the newest complete checkpoint, which is what `latest` names
    // after every save (a checkpoint directory appears whole, by rename, before `latest` moves).
    std::string newest;
    std::error_code ec;
    if (fs::is_directory(dir, ec))
      for (const auto& e : fs::directory_iterator(dir)) {
        const std::string n = e.path().filename().string();
        if (e.is_directory() && n.rfind("ckpt_", 0) == 0 && complete(e.path()) && n > newest)
          newest = n;
      }
    return newest.empty() ? "" : (fs::path(dir) / newest).string();
  }
  std::ifstream f(p);
  std::string name;
  std::getline(f, name);
  LOOM_CHECK(name.rfind("ckpt_", 0) == 0 && name.find('/') == std::string::npos,
             "{}: does not name a checkpoint ('{}')", p.string(), name);
  fs::path c = fs::path(dir) / name;
  LOOM_CHECK(complete(c), "{}: names {}, which is missing or incomplete", p.string(), c.string());
  return c.string();
}

CheckpointMeta read_checkpoint_meta(const std::string& ckpt) {
  std::string path = (fs::path(ckpt) / "manifest.json").string();
  std::ifstream f(path);
  LOOM_CHECK(f.good(), "{}: cannot open checkpoint manifest", path);
  nlohmann::json m;
  try {
    m = nlohmann::json::parse(f);
  } catch (const nlohmann::json::exception& e) {
    throw Error(fmt::format("{}: malformed JSON: {}", path, e.what()));
  }
  auto field = [&](const char* key) -> const nlohmann::json& {
    if (!m.contains(key)) throw Error(fmt::format("{}: missing field '{}'", path, key));
    return m[key];
  };
  auto integer = [&](const char* key) -> int64_t {
    const auto& v = field(key);
    if (!v.is_number_integer()) throw Error(fmt::format("{}: field '{}' must be an integer", path, key));
    return v.get<int64_t>();
  };
  if (field("format") != "loom-checkpoint") throw Error(fmt::format("{}: field 'format' is not loom-checkpoint", path));
  if (integer("version") != kCheckpointVersion)
    throw Error(fmt::format("{}: field 'version' is {}, this loom reads {}", path, integer("version"),
                            kCheckpointVersion));
  CheckpointMeta meta;
  meta.step = integer("step");
  meta.optimizer_steps = integer("optimizer_steps");
  meta.data_position = integer("data_position");
  const auto& rng = field("rng");
  if (!rng.is_object() || !rng.contains("seed") || !rng["seed"].is_number_unsigned())
    throw Error(fmt::format("{}: field 'rng.seed' must be a non-negative integer", path));
  meta.seed = rng["seed"].get<uint64_t>();
  meta.model = field("model");
  if (!field("config_toml").is_string()) throw Error(fmt::format("{}: field 'config_toml' must be a string", path));
  meta.config_toml = m["config_toml"].get<std::string>();
  if (m.contains("vocabulary")) {
    if (!m["vocabulary"].is_string()) throw Error(fmt::format("{}: field 'vocabulary' must be a string", path));
    meta.vocabulary = m["vocabulary"].get<std::string>();
  }
  if (meta.step < 0 || meta.optimizer_steps < 0 || meta.data_position < 0)
    throw Error(fmt::format("{}: negative step counters", path));
  return meta;
}

void load_checkpoint_tensors(const std::string& ckpt, const std::vector<NamedTensor>& into) {
  SafetensorsReader r((fs::path(ckpt) / "state.safetensors").string());
  for (const auto& t : into) r.read_into(t.name, t.tensor.raw(), t.tensor.nbytes(), t.tensor.dtype(), t.tensor.shape());
}

}  // namespace loom::train
