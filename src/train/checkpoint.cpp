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

#include <cmath>

#include "core/error.h"
#include "data/shard.h"
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
    if (!f) throw Error(fmt::format("{}: cannot create: {}", tmp, std::strerror(errno)));
    f << text;
    f.flush();
    if (!f) {
      const int err = errno;
      f.close();
      std::error_code ec;
      fs::remove(tmp, ec);
      throw Error(fmt::format("{}: write failed: {}", tmp, err ? std::strerror(err) : "unknown reason"));
    }
  }
  fsync_path(tmp, false);
  if (std::rename(tmp.c_str(), path.c_str()) != 0)
    throw Error(fmt::format("{}: rename from {} failed: {}", path, tmp, std::strerror(errno)));
}

std::string ckpt_name(int64_t step) { return fmt::format("ckpt_{:08d}", step); }

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  LOOM_CHECK(f.good(), "{}: cannot open", path);
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

// The step a directory name ckpt_<digits> stands for (-1 for another name).
int64_t step_of_name(const std::string& name) {
  if (name.rfind("ckpt_", 0) != 0 || name.size() == 5 || name.size() > 5 + 18) return -1;
  for (size_t i = 5; i < name.size(); ++i)
    if (name[i] < '0' || name[i] > '9') return -1;
  return std::stoll(name.substr(5));
}

// Checks the bytes of one tensor of checkpoint file `file` against the manifest's checksum, and a
// parameter's values for finiteness.
void check_tensor(const std::string& file, const std::string& name, const void* data, size_t bytes, DType dtype,
                  const CheckpointMeta& meta) {
  if (!meta.checksums.empty()) {
    auto it = meta.checksums.find(name);
    LOOM_CHECK(it != meta.checksums.end(), "{}: tensor '{}' has no checksum in the manifest", file, name);
    const uint32_t crc = data::crc32(data, bytes);
    LOOM_CHECK(crc == it->second, "{}: tensor '{}' is corrupt: its bytes have checksum {} but the manifest says {}",
               file, name, crc, it->second);
  }
  if (name.rfind("param/", 0) == 0 && dtype == DType::f32) {
    const float* v = static_cast<const float*>(data);
    for (size_t i = 0; i < bytes / sizeof(float); ++i)
      LOOM_CHECK(std::isfinite(v[i]), "{}: parameter '{}' holds {} at index {} (weights must be finite)", file,
                 name.substr(6), v[i], i);
  }
}

}  // namespace

std::string save_checkpoint(const std::string& dir, const CheckpointMeta& meta,
                            const std::vector<NamedTensor>& tensors, int64_t keep) {
  // Weights that are not finite are not worth keeping, and must not push a good checkpoint out.
  for (const auto& t : tensors)
    if (t.name.rfind("param/", 0) == 0 && t.tensor.dtype() == DType::f32)
      for (int64_t i = 0; i < t.tensor.numel(); ++i)
        if (!std::isfinite(t.tensor.f32()[i]))
          throw Error(fmt::format("{}: not writing the checkpoint of step {}: parameter '{}' holds {} at index {} "
                                  "(the earlier checkpoints are kept)",
                                  dir, meta.step, t.name.substr(6), t.tensor.f32()[i], i));
  fs::create_directories(dir);
  std::string final_dir = (fs::path(dir) / ckpt_name(meta.step)).string();
  std::string tmp_dir = (fs::path(dir) / (".tmp_" + ckpt_name(meta.step))).string();
  fs::remove_all(tmp_dir);
  fs::create_directories(tmp_dir);
  // A failed write (a full disk, a file-size limit) leaves nothing behind: the partial checkpoint is
  // removed, `latest` and the earlier checkpoints stay as they were.
  try {

    SafetensorsWriter w;
    nlohmann::json checksums = nlohmann::json::object();
    for (const auto& t : tensors) {
      w.add(t.name, t.tensor);
      checksums[t.name] = data::crc32(t.tensor.raw(), t.tensor.nbytes());
    }
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
    m["checksums"] = checksums;
    const std::string manifest = m.dump(2) + "\n";
    write_text_durably((fs::path(tmp_dir) / "manifest.json").string(), manifest);
    write_text_durably((fs::path(tmp_dir) / "manifest.crc32").string(),
                       std::to_string(data::crc32(manifest.data(), manifest.size())) + "\n");
    fsync_path(tmp_dir, true);
    // Read back before it replaces anything, anything points at it, or an older checkpoint goes.
    verify_checkpoint(tmp_dir);
  } catch (const std::exception& e) {
    std::error_code ec;
    fs::remove_all(tmp_dir, ec);
    throw Error(fmt::format("the checkpoint of step {} could not be written (removed; {}): {}", meta.step,
                            fs::exists(fs::path(dir) / "latest", ec) ? "the earlier checkpoints are kept"
                                                                     : "there is no earlier checkpoint",
                            e.what()));
  }

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
  LOOM_CHECK(fs::exists(path), "{}: cannot open checkpoint manifest", path);
  const std::string text = read_file(path);
  // The manifest's own checksum (version 2 writes one; version 1 checkpoints have none).
  const std::string crc_path = (fs::path(ckpt) / "manifest.crc32").string();
  const bool has_crc = fs::exists(crc_path);
  if (has_crc) {
    const std::string want = read_file(crc_path);
    const std::string have = std::to_string(data::crc32(text.data(), text.size())) + "\n";
    LOOM_CHECK(want == have, "{}: corrupt: its checksum is {} but {} says {}", path, have.substr(0, have.size() - 1),
               crc_path, want.substr(0, want.find('\n')));
  }
  nlohmann::json m;
  try {
    m = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw Error(fmt::format("{}: malformed JSON: {}", path, e.what()));
  }
  if (!m.is_object()) throw Error(fmt::format("{}: not a JSON object", path));
  if (m.contains("version") && m["version"].is_number_integer() && m["version"].get<int64_t>() >= 2 && !has_crc)
    throw Error(fmt::format("{}: missing (a version 2 checkpoint has one)", crc_path));
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
  const int64_t version = integer("version");
  if (version != 1 && version != kCheckpointVersion)
    throw Error(fmt::format("{}: field 'version' is {}, this loom reads 1 and {}", path, version, kCheckpointVersion));
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
  if (version >= 2) {
    const auto& sums = field("checksums");
    if (!sums.is_object()) throw Error(fmt::format("{}: field 'checksums' must be an object", path));
    for (auto it = sums.begin(); it != sums.end(); ++it) {
      if (!it.value().is_number_unsigned() || it.value().get<uint64_t>() > 0xffffffffull)
        throw Error(fmt::format("{}: checksum of '{}' must be a 32-bit unsigned integer", path, it.key()));
      meta.checksums[it.key()] = uint32_t(it.value().get<uint64_t>());
    }
  }
  // The directory's name is the step it was written for: a manifest that says otherwise is not
  // believed (it would resume at the wrong step with these weights).
  fs::path dir_path = fs::path(ckpt).lexically_normal();
  if (dir_path.filename().empty()) dir_path = dir_path.parent_path();
  const int64_t named = step_of_name(dir_path.filename().string());
  if (named >= 0 && named != meta.step)
    throw Error(fmt::format("{}: field 'step' is {} but the checkpoint directory is named for step {}", path,
                            meta.step, named));
  return meta;
}

struct CheckpointReader::Impl {
  CheckpointMeta meta;
  std::string file;
  SafetensorsReader reader;
  explicit Impl(const std::string& ckpt)
      : meta(read_checkpoint_meta(ckpt)), file((fs::path(ckpt) / "state.safetensors").string()), reader(file) {}
};

CheckpointReader::CheckpointReader(const std::string& ckpt) : impl_(std::make_unique<Impl>(ckpt)) {}
CheckpointReader::~CheckpointReader() = default;

void CheckpointReader::read_into(const std::string& name, const Tensor& t) {
  impl_->reader.read_into(name, t.raw(), t.nbytes(), t.dtype(), t.shape());
  check_tensor(impl_->file, name, t.raw(), t.nbytes(), t.dtype(), impl_->meta);
}

const std::vector<float>& CheckpointReader::read(const std::string& name, const Shape& shape) {
  buf_.resize(size_t(shape_numel(shape)));
  const size_t bytes = buf_.size() * sizeof(float);
  impl_->reader.read_into(name, buf_.data(), bytes, DType::f32, shape);
  check_tensor(impl_->file, name, buf_.data(), bytes, DType::f32, impl_->meta);
  return buf_;
}

void load_checkpoint_tensors(const std::string& ckpt, const std::vector<NamedTensor>& into) {
  CheckpointReader r(ckpt);
  for (const auto& t : into) r.read_into(t.name, t.tensor);
}

std::string run_marker(const std::string& dir) {
  std::error_code ec;
  for (const char* f : {"latest", "metrics.jsonl"})
    if (fs::exists(fs::path(dir) / f, ec)) return f;
  if (fs::is_directory(dir, ec))
    for (const auto& e : fs::directory_iterator(dir, ec))
      if (e.path().filename().string().rfind("ckpt_", 0) == 0) return e.path().filename().string();
  return "";
}

void verify_checkpoint(const std::string& ckpt) {
  const CheckpointMeta meta = read_checkpoint_meta(ckpt);
  const std::string file = (fs::path(ckpt) / "state.safetensors").string();
  SafetensorsReader r(file);
  std::vector<char> buf;
  for (const SafetensorsEntry& e : r.entries()) {
    const size_t bytes = size_t(shape_numel(e.shape)) * dtype_size(e.dtype);
    buf.resize(std::max<size_t>(bytes, 1));
    r.read_into(e.name, buf.data(), bytes, e.dtype, e.shape);
    check_tensor(file, e.name, buf.data(), bytes, e.dtype, meta);
  }
  for (const auto& [name, crc] : meta.checksums)
    LOOM_CHECK(r.contains(name), "{}: tensor '{}' of the manifest is missing", file, name);
}

std::string resume_checkpoint(const std::string& dir, std::vector<std::string>* notes) {
  auto complete = [](const fs::path& c) {
    return fs::exists(c / "manifest.json") && fs::exists(c / "state.safetensors");
  };
  std::vector<std::string> candidates, reasons;
  try {
    const std::string latest = latest_checkpoint(dir);
    if (!latest.empty()) candidates.push_back(latest);
  } catch (const Error& e) {
    reasons.push_back(e.what());
  }
  std::vector<std::string> all;
  std::error_code ec;
  if (fs::is_directory(dir, ec))
    for (const auto& e : fs::directory_iterator(dir)) {
      const std::string n = e.path().filename().string();
      if (e.is_directory() && step_of_name(n) >= 0 && complete(e.path())) all.push_back((fs::path(dir) / n).string());
    }
  std::sort(all.begin(), all.end(), [](const std::string& a, const std::string& b) {  // newest first, by step
    return step_of_name(fs::path(a).filename().string()) > step_of_name(fs::path(b).filename().string());
  });
  for (const std::string& c : all)
    if (candidates.empty() || fs::path(c) != fs::path(candidates[0])) candidates.push_back(c);
  for (const std::string& c : candidates) {
    try {
      verify_checkpoint(c);
      if (notes)
        for (const std::string& r : reasons) notes->push_back("passed over: " + r);
      return c;
    } catch (const Error& e) {
      reasons.push_back(e.what());
    }
  }
  if (candidates.empty() && reasons.empty()) return "";
  std::string all_reasons;
  for (const std::string& r : reasons) all_reasons += "\n  " + r;
  throw Error(fmt::format("{}: no checkpoint to resume from passes verification (nothing was changed):{}", dir,
                          all_reasons));
}

}  // namespace loom::train
