#include "train/safetensors.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/file.h"

namespace loom::train {

namespace {

using json = nlohmann::json;

struct DTypeName {
  const char* name;
  DType dtype;
};
constexpr DTypeName kDTypes[] = {{"F32", DType::f32}, {"BF16", DType::bf16}, {"F16", DType::f16},
                                 {"I32", DType::i32}, {"U16", DType::u16},   {"U32", DType::u32}};

[[noreturn]] void bad(const std::string& path, const std::string& msg) {
  throw Error(fmt::format("{}: {}", path, msg));
}

uint64_t read_le64(const unsigned char* b) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | b[i];
  return v;
}

void write_le64(unsigned char* b, uint64_t v) {
  for (int i = 0; i < 8; ++i) b[i] = static_cast<unsigned char>(v >> (8 * i));
}

float f16_to_f32(uint16_t h) {
  uint32_t sign = uint32_t(h >> 15) << 31, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  float f;
  if (exp == 0) {
    f = std::ldexp(float(man), -24);  // zero or subnormal
    return sign ? -f : f;
  }
  uint32_t u = exp == 31 ? (sign | 0x7f800000u | (man << 13)) : (sign | ((exp + 112) << 23) | (man << 13));
  std::memcpy(&f, &u, 4);
  return f;
}

// Non-negative integer from a JSON value, or an error naming the file, tensor and field.
uint64_t json_uint(const json& v, const std::string& path, const std::string& tensor, const char* field) {
  if (!v.is_number_integer()) bad(path, fmt::format("tensor '{}': {} must be non-negative integers", tensor, field));
  if (v.is_number_unsigned()) return v.get<uint64_t>();
  int64_t x = v.get<int64_t>();
  if (x < 0) bad(path, fmt::format("tensor '{}': {} has a negative value {}", tensor, field, x));
  return uint64_t(x);
}

}  // namespace

DType safetensors_dtype(const std::string& name, const std::string& where) {
  for (const auto& d : kDTypes)
    if (name == d.name) return d.dtype;
  throw Error(fmt::format("{}: unknown or unsupported dtype '{}' (loom reads F32, BF16, F16, I32, U16, U32)",
                          where, name));
}

std::string safetensors_dtype_name(DType t) {
  for (const auto& d : kDTypes)
    if (d.dtype == t) return d.name;
  LOOM_FAIL("dtype {} has no safetensors name", dtype_name(t));
}

SafetensorsReader::SafetensorsReader(std::string path) : path_(std::move(path)) {
  std::ifstream f(path_, std::ios::binary);
  if (!f) bad(path_, "cannot open file");
  std::error_code ec;
  uint64_t file_size = std::filesystem::file_size(path_, ec);
  if (ec) bad(path_, "cannot stat file: " + ec.message());
  if (file_size < 8) bad(path_, fmt::format("file is {} bytes, too short for the 8-byte header length", file_size));
  unsigned char lenbuf[8];
  f.read(reinterpret_cast<char*>(lenbuf), 8);
  if (!f) bad(path_, "cannot read the header length");
  uint64_t n = read_le64(lenbuf);
  if (n < 2) bad(path_, fmt::format("header length {} is too small for a JSON object", n));
  if (n > kMaxSafetensorsHeader)
    bad(path_, fmt::format("header length {} exceeds the limit of {} bytes", n, kMaxSafetensorsHeader));
  if (n > file_size - 8) bad(path_, fmt::format("header length {} runs past the end of the {}-byte file", n, file_size));
  std::string header(n, '\0');
  f.read(header.data(), std::streamsize(n));
  if (!f) bad(path_, "cannot read the header");
  data_start_ = 8 + n;
  const uint64_t data_size = file_size - data_start_;

  json h;
  try {
    h = json::parse(header);
  } catch (const json::parse_error& e) {
    bad(path_, fmt::format("header is not valid JSON: {}", e.what()));
  }
  if (!h.is_object()) bad(path_, "header must be a JSON object");

  for (auto it = h.begin(); it != h.end(); ++it) {
    const std::string& name = it.key();
    const json& v = it.value();
    if (name == "__metadata__") {
      if (!v.is_object()) bad(path_, "__metadata__ must be an object of strings");
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string()) bad(path_, fmt::format("__metadata__ field '{}' must be a string", m.key()));
        metadata_[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    if (name.empty()) bad(path_, "a tensor has an empty name");
    if (!v.is_object()) bad(path_, fmt::format("tensor '{}': entry must be an object", name));
    for (auto k = v.begin(); k != v.end(); ++k)
      if (k.key() != "dtype" && k.key() != "shape" && k.key() != "data_offsets")
        bad(path_, fmt::format("tensor '{}': unknown field '{}'", name, k.key()));
    if (!v.contains("dtype") || !v["dtype"].is_string())
      bad(path_, fmt::format("tensor '{}': missing or non-string dtype", name));
    if (!v.contains("shape") || !v["shape"].is_array())
      bad(path_, fmt::format("tensor '{}': missing or non-array shape", name));
    if (!v.contains("data_offsets") || !v["data_offsets"].is_array() || v["data_offsets"].size() != 2)
      bad(path_, fmt::format("tensor '{}': data_offsets must be an array [begin, end]", name));

    SafetensorsEntry e;
    e.name = name;
    e.dtype = safetensors_dtype(v["dtype"].get<std::string>(), fmt::format("{}: tensor '{}'", path_, name));
    uint64_t numel = 1;
    for (const auto& d : v["shape"]) {
      uint64_t x = json_uint(d, path_, name, "shape");
      if (x > uint64_t(std::numeric_limits<int64_t>::max()) || (x && numel > (uint64_t(1) << 62) / x))
        bad(path_, fmt::format("tensor '{}': shape is too large", name));
      numel *= x;
      e.shape.push_back(int64_t(x));
    }
    e.begin = json_uint(v["data_offsets"][0], path_, name, "data_offsets");
    e.end = json_uint(v["data_offsets"][1], path_, name, "data_offsets");
    if (e.begin > e.end)
      bad(path_, fmt::format("tensor '{}': data_offsets [{}, {}] end before they begin", name, e.begin, e.end));
    if (e.end > data_size)
      bad(path_, fmt::format("tensor '{}': data_offsets [{}, {}] run past the {}-byte data buffer", name, e.begin,
                             e.end, data_size));
    uint64_t want = numel * dtype_size(e.dtype);
    if (want != e.end - e.begin)
      bad(path_, fmt::format("tensor '{}': shape {} of {} needs {} bytes but data_offsets span {}", name,
                             shape_str(e.shape), dtype_name(e.dtype), want, e.end - e.begin));
    entries_.push_back(std::move(e));
  }

  // The buffer must be covered exactly: sorted by offset, each tensor starts where the last ended.
  std::stable_sort(entries_.begin(), entries_.end(), [](const SafetensorsEntry& a, const SafetensorsEntry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t pos = 0;
  for (size_t i = 0; i < entries_.size(); ++i) {
    const auto& e = entries_[i];
    if (e.begin < pos)
      bad(path_, fmt::format("tensor '{}': data_offsets [{}, {}] overlap tensor '{}'", e.name, e.begin, e.end,
                             entries_[i - 1].name));
    if (e.begin > pos)
      bad(path_, fmt::format("tensor '{}': data_offsets [{}, {}] leave a gap at bytes [{}, {}) of the data buffer",
                             e.name, e.begin, e.end, pos, e.begin));
    pos = e.end;
    index_[e.name] = i;
  }
  if (pos != data_size)
    bad(path_, fmt::format("data buffer has {} bytes but the tensors cover {}", data_size, pos));
}

const std::string& SafetensorsReader::meta(const std::string& key) const {
  auto it = metadata_.find(key);
  if (it == metadata_.end()) bad(path_, fmt::format("__metadata__ has no field '{}'", key));
  return it->second;
}

bool SafetensorsReader::contains(const std::string& name) const { return index_.count(name) != 0; }

const SafetensorsEntry& SafetensorsReader::entry(const std::string& name) const {
  auto it = index_.find(name);
  if (it == index_.end()) bad(path_, fmt::format("no tensor named '{}'", name));
  return entries_[it->second];
}

void SafetensorsReader::read_into(const std::string& name, void* dst, size_t bytes, DType dtype,
                                  const Shape& expect) const {
  const SafetensorsEntry& e = entry(name);
  if (e.dtype != dtype)
    bad(path_, fmt::format("tensor '{}' is {}, expected {}", name, dtype_name(e.dtype), dtype_name(dtype)));
  if (!expect.empty() && e.shape != expect)
    bad(path_, fmt::format("tensor '{}' has shape {}, expected {}", name, shape_str(e.shape), shape_str(expect)));
  if (bytes != e.nbytes())
    bad(path_, fmt::format("tensor '{}' has {} bytes, destination holds {}", name, e.nbytes(), bytes));
  std::ifstream f(path_, std::ios::binary);
  if (!f) bad(path_, "cannot open file");
  f.seekg(std::streamoff(data_start_ + e.begin));
  f.read(static_cast<char*>(dst), std::streamsize(bytes));
  if (!f) bad(path_, fmt::format("tensor '{}': short read", name));
}

void SafetensorsReader::read_range(const std::string& name, uint64_t offset, void* dst, size_t bytes) const {
  const SafetensorsEntry& e = entry(name);
  if (offset > e.nbytes() || bytes > e.nbytes() - offset)
    bad(path_, fmt::format("tensor '{}' has {} bytes, cannot read {} from byte {}", name, e.nbytes(), bytes, offset));
  std::ifstream f(path_, std::ios::binary);
  if (!f) bad(path_, "cannot open file");
  f.seekg(std::streamoff(data_start_ + e.begin + offset));
  f.read(static_cast<char*>(dst), std::streamsize(bytes));
  if (!f) bad(path_, fmt::format("tensor '{}': short read", name));
}

Tensor SafetensorsReader::load(const std::string& name, MemTag tag, MemoryPool& pool) const {
  const SafetensorsEntry& e = entry(name);
  Tensor t = Tensor::empty(e.shape, e.dtype, tag, pool);
  read_into(name, t.raw(), t.nbytes(), e.dtype);
  return t;
}

std::vector<float> SafetensorsReader::read_f32(const std::string& name) const {
  const SafetensorsEntry& e = entry(name);
  std::vector<float> out(size_t(e.numel()));
  if (e.dtype == DType::f32) {
    read_into(name, out.data(), out.size() * 4, DType::f32);
  } else if (e.dtype == DType::bf16 || e.dtype == DType::f16) {
    std::vector<uint16_t> raw(out.size());
    read_into(name, raw.data(), raw.size() * 2, e.dtype);
    for (size_t i = 0; i < raw.size(); ++i)
      out[i] = e.dtype == DType::bf16 ? bf16_to_f32(bf16{raw[i]}) : f16_to_f32(raw[i]);
  } else {
    bad(path_, fmt::format("tensor '{}' is {}, not a floating-point tensor", name, dtype_name(e.dtype)));
  }
  return out;
}

std::vector<float> SafetensorsReader::read_finite_f32(const std::string& name) const {
  std::vector<float> v = read_f32(name);
  for (size_t i = 0; i < v.size(); ++i)
    if (!std::isfinite(v[i]))
      bad(path_, fmt::format("tensor '{}' holds {} at index {}: a model's weights must be finite", name, v[i], i));
  return v;
}

size_t SafetensorsWriter::check_new(const std::string& name, DType dtype, const Shape& shape) const {
  LOOM_CHECK(!name.empty() && name != "__metadata__", "safetensors: invalid tensor name '{}'", name);
  for (const auto& it : items_) LOOM_CHECK(it.name != name, "safetensors: tensor '{}' added twice", name);
  for (int64_t d : shape) LOOM_CHECK(d >= 0, "safetensors: tensor '{}' has a negative dimension", name);
  return size_t(shape_numel(shape)) * dtype_size(dtype);
}

void SafetensorsWriter::add(const std::string& name, DType dtype, const Shape& shape, const void* data) {
  add_pieces(name, dtype, shape, {{data, size_t(shape_numel(shape)) * dtype_size(dtype)}});
}

void SafetensorsWriter::add_lazy(const std::string& name, DType dtype, const Shape& shape,
                                 std::function<void(void* dst)> fill) {
  const size_t n = check_new(name, dtype, shape);
  items_.push_back(Item{name, dtype, shape, {}, n, std::move(fill), Tensor()});
}

void SafetensorsWriter::add_pieces(const std::string& name, DType dtype, const Shape& shape,
                                   std::vector<std::pair<const void*, size_t>> pieces) {
  const size_t n = check_new(name, dtype, shape);
  size_t have = 0;
  for (const auto& [data, bytes] : pieces) {
    LOOM_CHECK(bytes == 0 || data != nullptr, "safetensors: tensor '{}' has no data", name);
    have += bytes;
  }
  LOOM_CHECK(have == n, "safetensors: tensor '{}' of shape {} needs {} bytes, its pieces hold {}", name,
             shape_str(shape), n, have);
  items_.push_back(Item{name, dtype, shape, std::move(pieces), n, {}, Tensor()});
}

void SafetensorsWriter::add(const std::string& name, const Tensor& t) {
  LOOM_CHECK(t.device() == Device::cpu, "safetensors: tensor '{}' is not on the CPU", name);
  add(name, t.dtype(), t.shape(), t.raw());
  items_.back().keep = t;
}

void SafetensorsWriter::set_metadata(const std::string& key, const std::string& value) { metadata_[key] = value; }

void SafetensorsWriter::write(const std::string& path) const {
  json h = json::object();
  if (!metadata_.empty()) h["__metadata__"] = metadata_;
  uint64_t off = 0;
  for (const auto& it : items_) {
    h[it.name] = {{"dtype", safetensors_dtype_name(it.dtype)},
                  {"shape", it.shape},
                  {"data_offsets", {off, off + it.nbytes}}};
    off += it.nbytes;
  }
  std::string header = h.dump();
  header.append((8 - header.size() % 8) % 8, ' ');  // the buffer starts 8-byte aligned
  AtomicFile f(path);  // its temporary file is removed when a fill throws
  unsigned char lenbuf[8];
  write_le64(lenbuf, header.size());
  f.write(lenbuf, 8);
  f.write(header);
  std::vector<char> buf;
  for (const auto& it : items_) {
    if (it.fill) {
      buf.assign(std::max<size_t>(it.nbytes, 1), 0);
      it.fill(buf.data());  // may throw (a tensor read from a checkpoint that fails its checks)
      f.write(buf.data(), it.nbytes);
    }
    for (const auto& [data, bytes] : it.pieces) f.write(data, bytes);
  }
  f.commit();
}

}  // namespace loom::train
