// Safetensors files (https://github.com/huggingface/safetensors format): an 8-byte little-endian
// header length N, N bytes of JSON {name: {dtype, shape, data_offsets: [begin, end]}, ...,
// "__metadata__": {string: string}}, then the byte buffer the offsets index. The reader validates
// the header completely before any tensor is read and names the file and tensor in every error.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "core/dtype.h"
#include "core/memory.h"
#include "core/tensor.h"

namespace loom::train {

// Largest header the reader accepts (the format's own limit is 100 MB).
constexpr uint64_t kMaxSafetensorsHeader = 100ull << 20;

// "F32" <-> DType::f32 and so on; only the dtypes loom has. Unknown names throw with `where`.
DType safetensors_dtype(const std::string& name, const std::string& where);
std::string safetensors_dtype_name(DType t);

struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::f32;
  Shape shape;
  uint64_t begin = 0, end = 0;  // byte offsets into the data buffer, [begin, end)
  int64_t numel() const { return shape_numel(shape); }
  uint64_t nbytes() const { return end - begin; }
};

class SafetensorsReader {
 public:
  // Reads and validates the header of `path`; tensor data is read on demand.
  explicit SafetensorsReader(std::string path);

  const std::string& path() const { return path_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // Metadata value for `key`; throws naming the file and key when absent.
  const std::string& meta(const std::string& key) const;
  const std::vector<SafetensorsEntry>& entries() const { return entries_; }  // in offset order
  bool contains(const std::string& name) const;
  const SafetensorsEntry& entry(const std::string& name) const;  // throws naming the file and tensor

  // Copies tensor `name` into dst, which must hold exactly its bytes; checks dtype and shape
  // (an empty expected shape skips the shape check).
  void read_into(const std::string& name, void* dst, size_t bytes, DType dtype, const Shape& expect = {}) const;
  // Copies `bytes` bytes of tensor `name` from byte `offset` of its data into dst.
  void read_range(const std::string& name, uint64_t offset, void* dst, size_t bytes) const;
  // A new tensor from `pool` under `tag` holding tensor `name`.
  Tensor load(const std::string& name, MemTag tag, MemoryPool& pool = default_cpu_pool()) const;
  // Tensor `name` as f32 values in a host vector (f32, bf16, f16 tensors), for tests and tools.
  std::vector<float> read_f32(const std::string& name) const;
  // read_f32, refusing a value that is not finite (a model to take in), naming the file, the tensor
  // and the first such element.
  std::vector<float> read_finite_f32(const std::string& name) const;

 private:
  std::string path_;
  uint64_t data_start_ = 0;  // file offset of the byte buffer
  std::map<std::string, std::string> metadata_;
  std::vector<SafetensorsEntry> entries_;
  std::map<std::string, size_t> index_;
};

class SafetensorsWriter {
 public:
  // Tensors are written in the order they are added. Nothing is copied: raw data must stay alive
  // and unchanged until write(); an added Tensor is kept alive by the writer.
  void add(const std::string& name, DType dtype, const Shape& shape, const void* data);
  void add(const std::string& name, const Tensor& t);
  // A tensor whose bytes `fill` writes into a buffer of its size when write() comes to it (one
  // such tensor in memory at a time).
  void add_lazy(const std::string& name, DType dtype, const Shape& shape, std::function<void(void* dst)> fill);
  // A tensor whose bytes are `pieces` (pointer, bytes) one after another (their sum its size).
  void add_pieces(const std::string& name, DType dtype, const Shape& shape,
                  std::vector<std::pair<const void*, size_t>> pieces);
  void set_metadata(const std::string& key, const std::string& value);
  // Writes the file (through a temporary name and a rename, so readers never see half a file).
  void write(const std::string& path) const;

 private:
  // Checks a new tensor's name (not empty, not taken) and shape; its bytes.
  size_t check_new(const std::string& name, DType dtype, const Shape& shape) const;
  struct Item {
    std::string name;
    DType dtype;
    Shape shape;
    std::vector<std::pair<const void*, size_t>> pieces;
    size_t nbytes;
    std::function<void(void*)> fill;  // instead of pieces
    Tensor keep;  // holds the storage of an added Tensor
  };
  std::vector<Item> items_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace loom::train
