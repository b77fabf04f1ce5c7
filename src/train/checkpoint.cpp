#include "train/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <set>
#include <thread>
#include <tuple>

#include "core/error.h"
#include "core/file.h"
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
  write_file_atomically(path, text, {.durable = true});
}

std::string ckpt_name(int64_t step) { return fmt::format("ckpt_{:08d}", step); }

// The step a directory name ckpt_<digits> stands for (-1 for another name).
int64_t step_of_name(const std::string& name) {
  if (name.rfind("ckpt_", 0) != 0 || name.size() == 5 || name.size() > 5 + 18) return -1;
  for (size_t i = 5; i < name.size(); ++i)
    if (name[i] < '0' || name[i] > '9') return -1;
  return std::stoll(name.substr(5));
}

// A checkpoint tensor, for messages: "parameter 'wte.weight'", or "tensor 'adam_m/wte.weight'" for
// the optimizer's state.
std::string tensor_what(const std::string& name) {
  return name.rfind("param/", 0) == 0 ? fmt::format("parameter '{}'", name.substr(6)) : fmt::format("tensor '{}'", name);
}

// The first of v[0, n) a checkpoint cannot hold in tensor `name`, or -1: a value that is not finite
// (the weights, the optimizer's moments and projections, the kept rows' ids: a NaN in a moment
// reaches the weights at the next step), or a negative second moment (its square root is taken).
int64_t first_bad(const std::string& name, const float* v, int64_t n) {
  int64_t i = first_nonfinite(v, n);
  if (name.rfind("adam_v/", 0) == 0 || name.rfind("galore_v/", 0) == 0)
    for (int64_t k = 0; k < (i < 0 ? n : i); ++k)
      if (v[k] < 0.f) return k;
  return i;
}

// Throws naming the file, the tensor and the first bad index of v[0, n), elements [first, first +
// n) of its full tensor (first_bad).
void check_finite(const std::string& file, const std::string& name, const float* v, int64_t n, int64_t first) {
  const int64_t i = first_bad(name, v, n);
  LOOM_CHECK(i < 0, "{}: {} holds {} at index {} (a checkpoint's values must be finite{})", file, tensor_what(name),
             v[i], first + i, name.rfind("param/", 0) == 0 ? "" : ", its second moments >= 0");
}

// Checks the bytes of one tensor of checkpoint file `file` against the manifest's checksum, and its
// values for finiteness.
void check_tensor(const std::string& file, const std::string& name, const void* data, size_t bytes, DType dtype,
                  const CheckpointMeta& meta) {
  if (!meta.checksums.empty()) {
    auto it = meta.checksums.find(name);
    LOOM_CHECK(it != meta.checksums.end(), "{}: tensor '{}' has no checksum in the manifest", file, name);
    const uint32_t crc = data::crc32(data, bytes);
    LOOM_CHECK(crc == it->second, "{}: tensor '{}' is corrupt: its bytes have checksum {} but the manifest says {}",
               file, name, crc, it->second);
  }
  if (dtype == DType::f32) check_finite(file, name, static_cast<const float*>(data), int64_t(bytes / sizeof(float)), 0);
}

std::string rank_file(int r) { return fmt::format("rank_{:05d}.safetensors", r); }
std::string rank_index(int r) { return fmt::format("rank_{:05d}.json", r); }

bool complete_checkpoint(const fs::path& c) {
  std::error_code ec;
  return fs::exists(c / "manifest.json", ec) &&
         (fs::exists(c / "state.safetensors", ec) || fs::exists(c / rank_file(0), ec));
}

// The slices of one tensor in a rank's file, in file order.
struct IndexedTensor {
  uint32_t crc = 0;
  std::vector<std::pair<int64_t, int64_t>> slices;  // [first element, elements] of the full tensor
};
using RankIndex = std::map<std::string, IndexedTensor>;

RankIndex parse_index(const std::string& path, const std::string& text) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw Error(fmt::format("{}: malformed JSON: {}", path, e.what()));
  }
  LOOM_CHECK(j.is_object() && j.contains("tensors") && j["tensors"].is_object(), "{}: no object 'tensors'", path);
  RankIndex idx;
  for (auto it = j["tensors"].begin(); it != j["tensors"].end(); ++it) {
    const auto& t = it.value();
    LOOM_CHECK(t.is_object() && t.contains("crc32") && t["crc32"].is_number_unsigned() &&
                   t["crc32"].get<uint64_t>() <= 0xffffffffull && t.contains("slices") && t["slices"].is_array(),
               "{}: tensor '{}' needs 'crc32' (an integer below 2^32) and 'slices'", path, it.key());
    IndexedTensor x;
    x.crc = uint32_t(t["crc32"].get<uint64_t>());
    for (const auto& s : t["slices"]) {
      LOOM_CHECK(s.is_array() && s.size() == 2 && s[0].is_number_integer() && s[1].is_number_integer() &&
                     s[0].get<int64_t>() >= 0 && s[1].get<int64_t>() > 0,
                 "{}: tensor '{}': a slice must be [first element, elements > 0]", path, it.key());
      x.slices.emplace_back(s[0].get<int64_t>(), s[1].get<int64_t>());
    }
    idx[it.key()] = std::move(x);
  }
  return idx;
}

// The CRC-32 of tensor `name` of data file f, read in pieces of at most 4 MiB (no copy of the
// tensor is held); `each` (when given) sees every piece's values and the element they start at.
uint32_t scan_stored(const SafetensorsReader& f, const std::string& name,
                     const std::function<void(const float* v, int64_t n, int64_t at)>& each = {}) {
  const SafetensorsEntry& e = f.entry(name);
  std::vector<float> buf(std::min<uint64_t>(e.nbytes() / sizeof(float), uint64_t(1) << 20));
  uint32_t crc = 0;
  for (uint64_t at = 0; at < e.nbytes(); at += buf.size() * sizeof(float)) {
    const size_t n = size_t(std::min<uint64_t>(buf.size() * sizeof(float), e.nbytes() - at));
    f.read_range(name, at, buf.data(), n);
    crc = data::crc32(buf.data(), n, crc);
    if (each) each(buf.data(), int64_t(n / sizeof(float)), int64_t(at / sizeof(float)));
  }
  return crc;
}

// Writes rank r's part into directory tmp: its data file (fsynced), then its index (durably),
// then reads the data back against the index. Returns the index's CRC-32.
uint32_t write_part(const std::string& tmp, int r, int64_t step, const std::vector<TensorInfo>& tensors,
                    const std::vector<Slice>& mine) {
  std::map<std::string, const TensorInfo*> known;
  for (const TensorInfo& t : tensors) known[t.name] = &t;
  // Slices grouped by tensor (in the order of `tensors`), each group in the order given.
  std::map<std::string, std::vector<const Slice*>> by_name;
  for (const Slice& s : mine) {
    auto it = known.find(s.name);
    LOOM_CHECK(it != known.end(), "checkpoint of step {}: rank {} has a slice of '{}', which is not a tensor of it",
               step, r, s.name);
    LOOM_CHECK(s.n > 0 && s.global >= 0 && s.global + s.n <= shape_numel(it->second->shape) && s.data,
               "checkpoint of step {}: rank {}'s slice [{}, {}) of '{}' is not inside its {} elements", step, r,
               s.global, s.global + s.n, s.name, shape_numel(it->second->shape));
    if (const int64_t i = first_bad(s.name, s.data, s.n); i >= 0)
      throw Error(fmt::format("not writing the checkpoint of step {}: {} holds {} at index {}", step,
                              tensor_what(s.name), s.data[i], s.global + i));
    by_name[s.name].push_back(&s);
  }
  SafetensorsWriter w;
  nlohmann::json index = nlohmann::json::object();
  for (const TensorInfo& t : tensors) {
    auto it = by_name.find(t.name);
    if (it == by_name.end()) continue;
    std::vector<std::pair<const void*, size_t>> pieces;
    nlohmann::json slices = nlohmann::json::array();
    uint32_t crc = 0;
    int64_t total = 0, last_end = -1;
    for (const Slice* s : it->second) {
      pieces.emplace_back(s->data, size_t(s->n) * sizeof(float));
      crc = data::crc32(s->data, size_t(s->n) * sizeof(float), crc);
      if (s->global == last_end) {  // continues the previous slice in the full tensor too
        slices.back()[1] = slices.back()[1].get<int64_t>() + s->n;
      } else {
        slices.push_back({s->global, s->n});
      }
      last_end = s->global + s->n;
      total += s->n;
    }
    w.add_pieces(t.name, DType::f32, {total}, std::move(pieces));
    index[t.name] = {{"crc32", crc}, {"slices", slices}};
  }
  w.set_metadata("format", "loom-checkpoint");
  w.set_metadata("version", std::to_string(kCheckpointVersion));
  w.set_metadata("rank", std::to_string(r));
  const std::string data_path = (fs::path(tmp) / rank_file(r)).string();
  w.write(data_path);
  fsync_path(data_path, false);
  // LOOM_CHECKPOINT_PAUSE_MS widens the window between the files of a checkpoint, so tests that
  // kill a process at random moments land inside checkpoint writes often.
  if (const char* pause = std::getenv("LOOM_CHECKPOINT_PAUSE_MS"))
    std::this_thread::sleep_for(std::chrono::milliseconds(std::atoi(pause)));
  const std::string text = nlohmann::json{{"format", "loom-checkpoint-index"},
                                          {"rank", r},
                                          {"file", rank_file(r)},
                                          {"tensors", index}}
                               .dump(1) + "\n";
  write_text_durably((fs::path(tmp) / rank_index(r)).string(), text);
  // Read back what was written before anything depends on it.
  SafetensorsReader back(data_path);
  for (const auto& [name, x] : parse_index(rank_index(r), text))
    LOOM_CHECK(scan_stored(back, name) == x.crc, "{}: tensor '{}' does not read back as written", data_path, name);
  return data::crc32(text.data(), text.size());
}

// Every element of every tensor in exactly one slice of the ranks' indices; throws naming the first
// tensor that has a gap, an overlap, or is unknown.
void check_cover(const std::string& ckpt, const std::vector<TensorInfo>& tensors,
                 const std::vector<RankIndex>& indices) {
  std::map<std::string, std::vector<std::pair<int64_t, int64_t>>> all;
  for (const TensorInfo& t : tensors) all[t.name];
  for (size_t r = 0; r < indices.size(); ++r)
    for (const auto& [name, x] : indices[r]) {
      auto it = all.find(name);
      LOOM_CHECK(it != all.end(), "{}: {} holds '{}', which the manifest does not list", ckpt, rank_index(int(r)),
                 name);
      it->second.insert(it->second.end(), x.slices.begin(), x.slices.end());
    }
  for (const TensorInfo& t : tensors) {
    auto& v = all[t.name];
    std::sort(v.begin(), v.end());
    int64_t next = 0;
    for (const auto& [g, n] : v) {
      LOOM_CHECK(g == next, "{}: tensor '{}': elements [{}, {}) are {}", ckpt, t.name, std::min(g, next),
                 std::max(g, next), g > next ? "in no rank's slices" : "in two ranks' slices");
      next = g + n;
    }
    LOOM_CHECK(next == shape_numel(t.shape), "{}: tensor '{}': the slices end at element {} of {}", ckpt, t.name,
               next, shape_numel(t.shape));
  }
}

std::string manifest_text(const CheckpointMeta& meta) {
  nlohmann::json m;
  m["format"] = "loom-checkpoint";
  m["version"] = kCheckpointVersion;
  m["step"] = meta.step;
  m["optimizer_steps"] = meta.optimizer_steps;
  if (meta.loss_scale > 0) m["loss_scale"] = {{"scale", meta.loss_scale}, {"clean_steps", meta.loss_scale_clean}};
  m["data_position"] = meta.data_position;
  if (meta.consumed_samples >= 0) m["consumed_samples"] = meta.consumed_samples;
  m["rng"] = {{"seed", meta.seed}, {"kind", "philox4x32-10 counters keyed by (seed, stream, index)"}};
  m["model"] = meta.model;
  m["config_toml"] = meta.config_toml;
  if (!meta.vocabulary.empty()) m["vocabulary"] = meta.vocabulary;
  nlohmann::json tensors = nlohmann::json::array();
  for (const TensorInfo& t : meta.tensors) tensors.push_back({{"name", t.name}, {"shape", t.shape}});
  m["tensors"] = tensors;
  nlohmann::json shards = nlohmann::json::array();
  for (size_t r = 0; r < meta.index_crcs.size(); ++r)
    shards.push_back({{"index", rank_index(int(r))}, {"crc32", meta.index_crcs[r]}});
  m["shards"] = shards;
  return m.dump(2) + "\n";
}

// Rank 0, after every rank's part is durable in tmp: checks the cover, writes the manifest, renames
// tmp to DIR/ckpt_<step>, replaces `latest` and deletes all but the newest `keep` checkpoints.
std::string commit(const std::string& dir, const std::string& tmp, CheckpointMeta meta,
                   const std::vector<TensorInfo>& tensors, const std::vector<uint32_t>& index_crcs, int64_t keep) {
  std::vector<RankIndex> indices;
  for (size_t r = 0; r < index_crcs.size(); ++r) {
    const std::string path = (fs::path(tmp) / rank_index(int(r))).string();
    const std::string text = read_file(path);
    LOOM_CHECK(data::crc32(text.data(), text.size()) == index_crcs[r], "{}: changed after rank {} wrote it", path, r);
    indices.push_back(parse_index(path, text));
  }
  check_cover(tmp, tensors, indices);
  meta.index_crcs = index_crcs;
  meta.tensors = tensors;
  const std::string manifest = manifest_text(meta);
  write_text_durably((fs::path(tmp) / "manifest.json").string(), manifest);
  // (A durable write syncs its folder too: tmp's entries, every rank's files among them, are durable.)
  write_text_durably((fs::path(tmp) / "manifest.crc32").string(),
                     std::to_string(data::crc32(manifest.data(), manifest.size())) + "\n");

  const std::string final_dir = (fs::path(dir) / ckpt_name(meta.step)).string();
  fs::remove_all(final_dir);  // a previous run's checkpoint of the same step
  fs::rename(tmp, final_dir);
  fsync_path(dir, true);
  try {
    write_text_durably((fs::path(dir) / "latest").string(), ckpt_name(meta.step) + "\n");
  } catch (...) {
    // `latest` still names the previous checkpoint: this one goes, as the failure says (unless
    // `latest` already names this step's, which a run re-saving the step replaced).
    std::error_code ec;
    const fs::path latest = fs::path(dir) / "latest";
    std::string named;
    if (fs::is_regular_file(latest, ec)) std::getline(std::ifstream(latest), named);
    if (named != ckpt_name(meta.step)) fs::remove_all(final_dir, ec);
    throw;
  }

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

std::string failure(const std::string& dir, int64_t step, const std::string& why) {
  std::error_code ec;
  return fmt::format("the checkpoint of step {} could not be written (removed; {}): {}", step,
                     fs::exists(fs::path(dir) / "latest", ec) ? "the earlier checkpoints are kept"
                                                              : "there is no earlier checkpoint",
                     why);
}

// Collective over c: the lowest rank whose `why` is not empty and its `why` (at most 4000
// characters), on every rank; {-1, ""} when every rank's is empty.
std::pair<int, std::string> first_failure(comm::Comm& c, const std::string& why) {
  const int n = c.size();
  std::vector<int32_t> lengths(static_cast<size_t>(n));
  const int32_t mine = int32_t(std::min<size_t>(why.size(), 4000));
  c.all_gather(&mine, lengths.data(), n, DType::i32);
  int who = 0;
  while (who < n && lengths[size_t(who)] == 0) ++who;
  if (who == n) return {-1, ""};
  std::vector<int32_t> chars(static_cast<size_t>(lengths[size_t(who)]));
  if (c.rank() == who)
    for (size_t i = 0; i < chars.size(); ++i) chars[i] = int32_t(static_cast<unsigned char>(why[i]));
  c.broadcast(chars.data(), int64_t(chars.size()), DType::i32, who);
  return {who, std::string(chars.begin(), chars.end())};
}

// DIR/.tmp_ckpt_<step>, made empty.
std::string prepare_tmp(const std::string& dir, int64_t step) {
  const std::string tmp = (fs::path(dir) / (".tmp_" + ckpt_name(step))).string();
  fs::create_directories(dir);
  fs::remove_all(tmp);
  fs::create_directories(tmp);
  return tmp;
}

}  // namespace

std::string save_checkpoint(comm::Comm& world, const std::string& dir, const CheckpointMeta& meta,
                            const std::vector<TensorInfo>& tensors, const std::vector<Slice>& mine, int64_t keep) {
  const int r = world.rank();
  const std::string tmp = (fs::path(dir) / (".tmp_" + ckpt_name(meta.step))).string();
  // Rank 0 prepares the temporary directory; every rank writes its part; at each point every rank
  // learns whether a rank failed and what it found, and every rank throws naming it.
  std::string why;
  auto attempt = [&](auto&& fn) {
    try {
      fn();
    } catch (const std::exception& e) {
      why = e.what();
    }
  };
  auto check = [&] {
    const auto [who, reason] = first_failure(world, why);
    if (who < 0) return;
    std::error_code ec;
    if (r == 0) fs::remove_all(tmp, ec);
    throw RankError(who, failure(dir, meta.step, fmt::format("rank {}: {}", who, reason)));
  };
  if (r == 0) attempt([&] { prepare_tmp(dir, meta.step); });
  check();
  uint32_t crc = 0;
  attempt([&] { crc = write_part(tmp, r, meta.step, tensors, mine); });
  check();
  std::vector<uint32_t> crcs(static_cast<size_t>(world.size()));
  world.all_gather(&crc, crcs.data(), world.size(), DType::u32);
  if (r == 0) attempt([&] { commit(dir, tmp, meta, tensors, crcs, keep); });
  check();
  return (fs::path(dir) / ckpt_name(meta.step)).string();
}

std::string save_checkpoint(const std::string& dir, const CheckpointMeta& meta,
                            const std::vector<NamedTensor>& tensors, int64_t keep) {
  std::vector<TensorInfo> infos;
  std::vector<Slice> slices;
  for (const NamedTensor& t : tensors) {
    LOOM_CHECK(t.tensor.dtype() == DType::f32 && t.tensor.device() == Device::cpu,
               "checkpoint: tensor '{}' must be f32 in host memory", t.name);
    infos.push_back({t.name, t.tensor.shape()});
    if (t.tensor.numel() > 0) slices.push_back({t.name, 0, t.tensor.numel(), t.tensor.f32()});
  }
  std::string tmp;
  try {
    tmp = prepare_tmp(dir, meta.step);
    return commit(dir, tmp, meta, infos, {write_part(tmp, 0, meta.step, infos, slices)}, keep);
  } catch (const std::exception& e) {
    std::error_code ec;
    if (!tmp.empty()) fs::remove_all(tmp, ec);
    throw Error(failure(dir, meta.step, e.what()));
  }
}

namespace {

// "" when DIR/latest is absent or a file; else the error naming it.
std::string latest_not_a_file(const std::string& dir) {
  std::error_code ec;
  const fs::path p = fs::path(dir) / "latest";
  if (!fs::exists(p, ec) || fs::is_regular_file(p, ec)) return "";
  return fmt::format("{}: is not a file (it should hold the name of the newest checkpoint)", p.string());
}

}  // namespace

std::string latest_checkpoint(const std::string& dir) {
  fs::path p = fs::path(dir) / "latest";
  if (const std::string why = latest_not_a_file(dir); !why.empty()) throw Error(why);
  std::error_code ec;
  if (!fs::exists(p)) {
    // No pointer (deleted, or lost): the newest complete checkpoint, which is what `latest` names
    // after every save (a checkpoint directory appears whole, by rename, before `latest` moves).
    std::string newest;
    if (fs::is_directory(dir, ec))
      for (const auto& e : fs::directory_iterator(dir)) {
        const std::string n = e.path().filename().string();
        if (e.is_directory() && n.rfind("ckpt_", 0) == 0 && complete_checkpoint(e.path()) && n > newest)
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
  LOOM_CHECK(complete_checkpoint(c), "{}: names {}, which is missing or incomplete", p.string(), c.string());
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
    // The number on the file's line (a missing newline, or a CR before it, is no corruption).
    std::string want = read_file(crc_path);
    while (!want.empty() && (want.back() == '\n' || want.back() == '\r' || want.back() == ' ')) want.pop_back();
    const std::string have = std::to_string(data::crc32(text.data(), text.size()));
    LOOM_CHECK(want == have, "{}: corrupt: its checksum is {} but {} says '{}'", path, have, crc_path,
               want.substr(0, 40));
  }
  nlohmann::json m;
  try {
    m = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw Error(fmt::format("{}: malformed JSON: {}", path, e.what()));
  }
  if (!m.is_object()) throw Error(fmt::format("{}: not a JSON object", path));
  if (m.contains("version") && m["version"].is_number_integer() && m["version"].get<int64_t>() >= 2 && !has_crc)
    throw Error(fmt::format("{}: missing (checkpoints of version 2 and later have one)", crc_path));
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
  if (version < 1 || version > kCheckpointVersion)
    throw Error(fmt::format("{}: field 'version' is {}, this loom reads 1 to {}", path, version, kCheckpointVersion));
  CheckpointMeta meta;
  meta.step = integer("step");
  meta.optimizer_steps = integer("optimizer_steps");
  meta.data_position = integer("data_position");
  if (m.contains("consumed_samples")) {
    meta.consumed_samples = integer("consumed_samples");
    if (meta.consumed_samples < 0)
      throw Error(fmt::format("{}: field 'consumed_samples' must be a non-negative integer", path));
  }
  if (m.contains("loss_scale")) {
    const auto& ls = m["loss_scale"];
    if (!ls.is_object() || !ls.contains("scale") || !ls["scale"].is_number() || !ls.contains("clean_steps") ||
        !ls["clean_steps"].is_number_integer() || !(ls["scale"].get<double>() > 0) ||
        !(ls["scale"].get<double>() <= 0x1p64) || ls["clean_steps"].get<int64_t>() < 0)
      throw Error(fmt::format("{}: field 'loss_scale' must be {{\"scale\": a positive number at most 2^64, "
                              "\"clean_steps\": a non-negative integer}}",
                              path));
    meta.loss_scale = ls["scale"].get<double>();
    meta.loss_scale_clean = ls["clean_steps"].get<int64_t>();
  }
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
  if (version >= 3) {
    const auto& tensors = field("tensors");
    if (!tensors.is_array()) throw Error(fmt::format("{}: field 'tensors' must be an array", path));
    for (const auto& t : tensors) {
      if (!t.is_object() || !t.contains("name") || !t["name"].is_string() || !t.contains("shape") ||
          !t["shape"].is_array())
        throw Error(fmt::format("{}: each of 'tensors' needs a string 'name' and an array 'shape'", path));
      TensorInfo info{t["name"].get<std::string>(), {}};
      double elements = 1;
      for (const auto& d : t["shape"]) {
        if (!d.is_number_integer() || d.get<int64_t>() < 0 || d.get<int64_t>() > (int64_t(1) << 40))
          throw Error(fmt::format("{}: tensor '{}': a dimension must be an integer in [0, 2^40]", path, info.name));
        info.shape.push_back(d.get<int64_t>());
        elements *= double(info.shape.back());
      }
      if (elements > 0x1p50)
        throw Error(fmt::format("{}: tensor '{}': shape {} has more than 2^50 elements", path, info.name,
                                shape_str(info.shape)));
      meta.tensors.push_back(std::move(info));
    }
    const auto& shards = field("shards");
    if (!shards.is_array() || shards.empty()) throw Error(fmt::format("{}: field 'shards' must be a non-empty array", path));
    for (size_t r = 0; r < shards.size(); ++r) {
      const auto& x = shards[r];
      if (!x.is_object() || !x.contains("index") || x["index"] != rank_index(int(r)) || !x.contains("crc32") ||
          !x["crc32"].is_number_unsigned() || x["crc32"].get<uint64_t>() > 0xffffffffull)
        throw Error(fmt::format("{}: shards[{}] must be {{\"index\": \"{}\", \"crc32\": <32-bit unsigned>}}", path, r,
                                rank_index(int(r))));
      meta.index_crcs.push_back(uint32_t(x["crc32"].get<uint64_t>()));
    }
  } else if (version >= 2) {
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

// A stored piece of a full tensor: `n` elements from element `global`, at element `offset` of
// tensor `name` in data file `file`.
struct StoredPiece {
  size_t file = 0;
  int64_t global = 0, n = 0, offset = 0;
};

struct CheckpointReader::Impl {
  std::string ckpt;
  bool verify;
  CheckpointMeta meta;
  std::map<std::string, Shape> shapes;
  // Version 3: the data files, each tensor's pieces sorted by `global`, the CRC-32 of each
  // (file, tensor) and which of them have been checked.
  std::vector<std::unique_ptr<SafetensorsReader>> files;
  std::vector<RankIndex> indices;
  std::map<std::string, std::vector<StoredPiece>> pieces;
  std::set<std::pair<size_t, std::string>> checked;
  // Versions 1 and 2: state.safetensors, and the last tensor read whole.
  std::unique_ptr<SafetensorsReader> state;
  std::string cached;
  std::vector<float> cache;

  Impl(const std::string& c, bool v) : ckpt(c), verify(v), meta(read_checkpoint_meta(c)) {
    if (meta.index_crcs.empty()) {
      state = std::make_unique<SafetensorsReader>((fs::path(ckpt) / "state.safetensors").string());
      for (const SafetensorsEntry& e : state->entries()) shapes[e.name] = e.shape;
      return;
    }
    for (const TensorInfo& t : meta.tensors) shapes[t.name] = t.shape;
    for (size_t r = 0; r < meta.index_crcs.size(); ++r) {
      const std::string path = (fs::path(ckpt) / rank_index(int(r))).string();
      const std::string text = read_file(path);
      const uint32_t crc = data::crc32(text.data(), text.size());
      LOOM_CHECK(crc == meta.index_crcs[r], "{}: corrupt: its checksum is {} but the manifest says {}", path, crc,
                 meta.index_crcs[r]);
      indices.push_back(parse_index(path, text));
      files.push_back(std::make_unique<SafetensorsReader>((fs::path(ckpt) / rank_file(int(r))).string()));
      for (const auto& [name, x] : indices.back()) {
        LOOM_CHECK(shapes.count(name), "{}: holds '{}', which the manifest does not list", path, name);
        const SafetensorsEntry& e = files.back()->entry(name);
        int64_t off = 0;
        for (const auto& [g, n] : x.slices) {
          pieces[name].push_back({r, g, n, off});
          off += n;
        }
        LOOM_CHECK(e.dtype == DType::f32 && e.numel() == off, "{}: tensor '{}' is not f32 of the {} elements {} lists",
                   files.back()->path(), name, off, path);
      }
    }
    // Every element of every tensor the manifest lists in exactly one rank's file (metadata only).
    check_cover(ckpt, meta.tensors, indices);
    for (auto& [name, v] : pieces)
      std::sort(v.begin(), v.end(), [](const StoredPiece& a, const StoredPiece& b) { return a.global < b.global; });
  }

  const Shape& shape(const std::string& name) const {
    auto it = shapes.find(name);
    LOOM_CHECK(it != shapes.end(), "{}: the checkpoint has no tensor '{}'", ckpt, name);
    return it->second;
  }

  // Checks data file f's tensor `name` against its checksum (and, with `finite`, its values), once
  // when reading.
  void check_stored(size_t f, const std::string& name, bool finite = false) {
    const IndexedTensor& x = indices[f].at(name);
    // A value's element in the full tensor: the file holds the slices one after another.
    auto global_of = [&](int64_t k) {
      for (const auto& [g, n] : x.slices) {
        if (k < n) return g + k;
        k -= n;
      }
      return int64_t(-1);
    };
    const uint32_t crc = scan_stored(*files[f], name, [&](const float* v, int64_t n, int64_t at) {
      if (!finite) return;
      if (const int64_t i = first_bad(name, v, n); i >= 0)
        check_finite(files[f]->path(), name, v + i, 1, global_of(at + i));
    });
    LOOM_CHECK(crc == x.crc, "{}: tensor '{}' is corrupt: its bytes have checksum {} but {} says {}", files[f]->path(),
               name, crc, rank_index(int(f)), x.crc);
  }

  // The verification of verify_checkpoint: version 3's data files i with i % parts == part whole
  // (the cover was checked on opening); versions 1 and 2, their one file.
  void verify_all(int part, int parts) {
    if (state) {  // versions 1 and 2: one file of full tensors, checked whole by part 0
      for (const auto& [name, crc] : meta.checksums)
        LOOM_CHECK(state->contains(name), "{}: tensor '{}' of the manifest is missing", state->path(), name);
      if (part != 0) return;
      std::vector<char> buf;
      for (const SafetensorsEntry& e : state->entries()) {
        buf.resize(std::max<size_t>(e.nbytes(), 1));
        state->read_into(e.name, buf.data(), e.nbytes(), e.dtype, e.shape);
        check_tensor(state->path(), e.name, buf.data(), e.nbytes(), e.dtype, meta);
      }
      return;
    }
    for (size_t f = 0; f < files.size(); ++f)
      if (int(f % size_t(std::max(parts, 1))) == part)
        for (const auto& [name, x] : indices[f]) check_stored(f, name, /*finite=*/true);
  }

  void read(const std::string& name, int64_t global, int64_t n, float* dst) {
    const int64_t numel = shape_numel(shape(name));
    LOOM_CHECK(global >= 0 && n >= 0 && global + n <= numel, "{}: tensor '{}' has {} elements, cannot read [{}, {})",
               ckpt, name, numel, global, global + n);
    if (n == 0) return;
    if (state) {  // versions 1 and 2: the whole tensor, checked, kept for the next read
      if (cached != name) {
        cached.clear();
        cache.resize(size_t(numel));
        const size_t bytes = cache.size() * sizeof(float);
        state->read_into(name, cache.data(), bytes, DType::f32, shape(name));
        check_tensor(state->path(), name, cache.data(), bytes, DType::f32, meta);
        cached = name;
      }
      std::memcpy(dst, cache.data() + global, size_t(n) * sizeof(float));
      return;
    }
    const auto& v = pieces.at(name);
    // The first piece ending after `global`.
    auto it = std::upper_bound(v.begin(), v.end(), global,
                               [](int64_t g, const StoredPiece& p) { return g < p.global + p.n; });
    int64_t at = global;
    for (; at < global + n && it != v.end(); ++it) {
      LOOM_CHECK(it->global <= at, "{}: tensor '{}': element {} is in no rank's file", ckpt, name, at);
      const int64_t k = std::min(global + n, it->global + it->n) - at;
      if (verify && checked.insert({it->file, name}).second) check_stored(it->file, name);
      files[it->file]->read_range(name, uint64_t(it->offset + (at - it->global)) * sizeof(float), dst + (at - global),
                                  size_t(k) * sizeof(float));
      at += k;
    }
    LOOM_CHECK(at == global + n, "{}: tensor '{}': element {} is in no rank's file", ckpt, name, at);
    check_finite(ckpt, name, dst, n, global);
  }
};

CheckpointReader::CheckpointReader(const std::string& ckpt, bool verify)
    : impl_(std::make_unique<Impl>(ckpt, verify)) {}
CheckpointReader::~CheckpointReader() = default;
const CheckpointMeta& CheckpointReader::meta() const { return impl_->meta; }
Shape CheckpointReader::shape(const std::string& name) const { return impl_->shape(name); }
const std::string& CheckpointReader::path() const { return impl_->ckpt; }
bool CheckpointReader::has(const std::string& name) const { return impl_->shapes.count(name) > 0; }
std::vector<std::string> CheckpointReader::names() const {
  std::vector<std::string> v;
  for (const auto& [name, shape] : impl_->shapes) v.push_back(name);
  return v;
}

void CheckpointReader::read(const std::string& name, int64_t global, int64_t n, float* dst) {
  impl_->read(name, global, n, dst);
}

void CheckpointReader::read_into(const std::string& name, const Tensor& t) {
  const Shape& s = impl_->shape(name);
  LOOM_CHECK(t.dtype() == DType::f32 && t.shape() == s, "{}: tensor '{}' has shape {}, expected f32 {}", impl_->ckpt,
             name, shape_str(s), shape_str(t.shape()));
  impl_->read(name, 0, t.numel(), t.f32());
}

void load_checkpoint_tensors(const std::string& ckpt, const std::vector<NamedTensor>& into) {
  CheckpointReader r(ckpt);
  for (const auto& t : into) r.read_into(t.name, t.tensor);
}

std::string run_marker(const std::string& dir) {
  std::error_code ec;
  if (fs::exists(fs::path(dir) / "latest", ec)) return "latest";
  // (An empty metrics.jsonl is a run stopped before its first step: nothing to lose.)
  const fs::path metrics = fs::path(dir) / "metrics.jsonl";
  if (fs::exists(metrics, ec) && !(fs::is_regular_file(metrics, ec) && fs::file_size(metrics, ec) == 0 && !ec))
    return "metrics.jsonl";
  if (fs::is_directory(dir, ec))
    for (const auto& e : fs::directory_iterator(dir, ec))
      if (e.path().filename().string().rfind("ckpt_", 0) == 0) return e.path().filename().string();
  return "";
}

void remove_run(const std::string& dir) {
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string n = e.path().filename().string();
    if (n == "latest" || n == "metrics.jsonl" || n == "loss.png" || n == "memory.json" || n.rfind("ckpt_", 0) == 0 ||
        n.rfind(".tmp_ckpt_", 0) == 0)
      fs::remove_all(e.path());
  }
}

void verify_checkpoint(const std::string& ckpt, int part, int parts) {
  CheckpointReader reader(ckpt, /*verify=*/false);  // the manifest, and every index against it
  reader.impl_->verify_all(part, parts);
}

std::string resume_checkpoint(const std::string& dir, std::vector<std::string>* notes, comm::Comm* world) {
  const int part = world ? world->rank() : 0, parts = world ? world->size() : 1;
  // A `latest` that is not a file is not passed over: the run could not write its checkpoints.
  std::string fatal = latest_not_a_file(dir);
  if (!fatal.empty()) fatal += ": the run could not replace it; remove it (nothing was changed)";
  std::error_code ec;
  int who = part;
  if (world && parts > 1) std::tie(who, fatal) = first_failure(*world, fatal);
  if (!fatal.empty()) throw RankError(who, fatal);
  std::vector<std::string> candidates, reasons;
  try {
    const std::string latest = latest_checkpoint(dir);
    if (!latest.empty()) candidates.push_back(latest);
  } catch (const Error& e) {
    reasons.push_back(e.what());
  }
  std::vector<std::string> all;
  if (fs::is_directory(dir, ec))
    for (const auto& e : fs::directory_iterator(dir)) {
      const std::string n = e.path().filename().string();
      if (e.is_directory() && step_of_name(n) >= 0 && complete_checkpoint(e.path()))
        all.push_back((fs::path(dir) / n).string());
    }
  std::sort(all.begin(), all.end(), [](const std::string& a, const std::string& b) {  // newest first, by step
    return step_of_name(fs::path(a).filename().string()) > step_of_name(fs::path(b).filename().string());
  });
  for (const std::string& c : all)
    if (candidates.empty() || fs::path(c) != fs::path(candidates[0])) candidates.push_back(c);
  for (const std::string& c : candidates) {
    std::string why;
    try {
      verify_checkpoint(c, part, parts);
    } catch (const Error& e) {
      why = e.what();
    }
    if (world && parts > 1) why = first_failure(*world, why).second;  // the lowest rank that found a fault
    if (why.empty()) {
      if (notes)
        for (const std::string& r : reasons) notes->push_back("passed over: " + r);
      return c;
    }
    reasons.push_back(why);
  }
  if (candidates.empty() && reasons.empty()) return "";
  std::string all_reasons;
  for (const std::string& r : reasons) all_reasons += "\n  " + r;
  throw Error(fmt::format("{}: no checkpoint to resume from passes verification (nothing was changed):{}", dir,
                          all_reasons));
}

}  // namespace loom::train
