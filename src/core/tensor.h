// Tensor: a shape, a dtype, a device and a byte offset into reference-counted storage that a
// MemoryPool allocated under a tag. Views share storage; only contiguous row-major layouts.
#pragma once
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "core/memory.h"

namespace loom {

using Shape = std::vector<int64_t>;
int64_t shape_numel(const Shape& s);
std::string shape_str(const Shape& s);
// The index of the first element of v[0, n) that is NaN or infinite, or -1 when all are finite.
int64_t first_nonfinite(const float* v, int64_t n);

class Storage {
 public:
  Storage(MemoryPool* pool, size_t bytes, MemTag tag);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;
  void* data() const { return ptr_; }
  size_t bytes() const { return bytes_; }
  MemTag tag() const { return tag_; }
  MemoryPool* pool() const { return pool_; }

 private:
  MemoryPool* pool_;
  void* ptr_;
  size_t bytes_;
  MemTag tag_;
};

class Tensor {
 public:
  Tensor() = default;
  // Uninitialised storage from `pool` under `tag`.
  static Tensor empty(const Shape& shape, DType dtype, MemTag tag, MemoryPool& pool = default_cpu_pool());
  // Zero-filled (CPU pools only; device pools are zeroed by their backend).
  static Tensor zeros(const Shape& shape, DType dtype, MemTag tag, MemoryPool& pool = default_cpu_pool());

  bool defined() const { return storage_ != nullptr; }
  const Shape& shape() const { return shape_; }
  int64_t dim() const { return int64_t(shape_.size()); }
  int64_t size(int64_t d) const;
  int64_t numel() const { return shape_numel(shape_); }
  size_t nbytes() const { return size_t(numel()) * dtype_size(dtype_); }
  DType dtype() const { return dtype_; }
  Device device() const;
  MemTag tag() const;

  void* raw() const;
  template <class T> T* data() const { return static_cast<T*>(raw()); }
  float* f32() const;  // checks dtype
  int32_t* i32() const;

  // Same storage, new shape with the same element count.
  Tensor view(const Shape& shape) const;
  // Rows [start, start + len) of the first dimension.
  Tensor slice0(int64_t start, int64_t len) const;
  void zero_();  // CPU only
  std::string str() const;  // "f32 [2, 3] cpu params"

 private:
  std::shared_ptr<Storage> storage_;
  size_t offset_ = 0;  // bytes
  Shape shape_;
  DType dtype_ = DType::f32;
};

}  // namespace loom
