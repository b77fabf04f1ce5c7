#include "core/tensor.h"

#include <cmath>
#include <cstdint>
#include <cstring>

namespace loom {

int64_t first_nonfinite(const float* v, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (!std::isfinite(v[i])) return i;
  return -1;
}


int64_t shape_numel(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s)
    if (__builtin_mul_overflow(n, d, &n)) throw Error(fmt::format("shape {} has more than 2^63 elements", shape_str(s)));
  return n;
}

std::string shape_str(const Shape& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

Storage::Storage(MemoryPool* pool, size_t bytes, MemTag tag)
    : pool_(pool), ptr_(pool->allocate(bytes, tag)), bytes_(bytes), tag_(tag) {}

Storage::~Storage() { pool_->deallocate(ptr_, bytes_, tag_); }

Tensor Tensor::empty(const Shape& shape, DType dtype, MemTag tag, MemoryPool& pool) {
  for (int64_t d : shape) LOOM_CHECK(d >= 0, "negative dimension in shape {}", shape_str(shape));
  LOOM_CHECK(uint64_t(shape_numel(shape)) <= SIZE_MAX / dtype_size(dtype), "shape {} is too large to allocate",
             shape_str(shape));
  Tensor t;
  t.shape_ = shape;
  t.dtype_ = dtype;
  t.storage_ = std::make_shared<Storage>(&pool, size_t(shape_numel(shape)) * dtype_size(dtype), tag);
  return t;
}

Tensor Tensor::zeros(const Shape& shape, DType dtype, MemTag tag, MemoryPool& pool) {
  Tensor t = empty(shape, dtype, tag, pool);
  t.zero_();
  return t;
}

int64_t Tensor::size(int64_t d) const {
  if (d < 0) d += dim();
  LOOM_CHECK(d >= 0 && d < dim(), "dimension {} out of range for shape {}", d, shape_str(shape_));
  return shape_[size_t(d)];
}

Device Tensor::device() const { return storage_ ? storage_->pool()->device() : Device::cpu; }
MemTag Tensor::tag() const { return storage_ ? storage_->tag() : MemTag::workspace; }

void* Tensor::raw() const {
  if (!storage_ || !storage_->data()) return nullptr;
  return static_cast<char*>(storage_->data()) + offset_;
}

float* Tensor::f32() const {
  LOOM_CHECK(dtype_ == DType::f32, "expected an f32 tensor, got {}", str());
  return data<float>();
}

int32_t* Tensor::i32() const {
  LOOM_CHECK(dtype_ == DType::i32, "expected an i32 tensor, got {}", str());
  return data<int32_t>();
}

Tensor Tensor::view(const Shape& shape) const {
  LOOM_CHECK(shape_numel(shape) == numel(), "cannot view {} as {}", shape_str(shape_), shape_str(shape));
  Tensor t = *this;
  t.shape_ = shape;
  return t;
}

Tensor Tensor::slice0(int64_t start, int64_t len) const {
  LOOM_CHECK(dim() >= 1 && start >= 0 && len >= 0 && start + len <= shape_[0],
             "slice [{}, {}) out of range for shape {}", start, start + len, shape_str(shape_));
  Tensor t = *this;
  int64_t row = numel() / (shape_[0] ? shape_[0] : 1);
  t.offset_ += size_t(start * row) * dtype_size(dtype_);
  t.shape_[0] = len;
  return t;
}

void Tensor::zero_() {
  LOOM_CHECK(device() == Device::cpu, "zero_() on a {} tensor", device_name(device()));
  if (nbytes()) std::memset(raw(), 0, nbytes());
}

std::string Tensor::str() const {
  return fmt::format("{} {} {} {}", dtype_name(dtype_), shape_str(shape_), device_name(device()),
                     mem_tag_name(tag()));
}

}  // namespace loom
