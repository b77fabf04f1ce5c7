#include "kernels/cuda/common.cuh"
#include "kernels/cuda/allocator.cuh"

#include <cuda_runtime.h>

#include <cstdio>

#include <fmt/format.h>

#include "core/error.h"

namespace loom::cuda {

ArenaAllocator::ArenaAllocator(size_t arena_bytes, int device) : arena_bytes_(arena_bytes), device_(device) {
  LOOM_CHECK(arena_bytes_ >= kAlign, "ArenaAllocator: arena size {} is below {}", int64_t(arena_bytes_), int64_t(kAlign));
  if (device_ < 0) LOOM_CUDA_CHECK(cudaGetDevice(&device_));
}

ArenaAllocator::~ArenaAllocator() {
  for (Arena& a : arenas_) cudaFree(a.base);  // no throwing from a destructor
}

bool ArenaAllocator::carve(Arena& a, size_t bytes, void** out) {
  for (auto it = a.free.begin(); it != a.free.end(); ++it) {
    if (it->second < bytes) continue;
    size_t off = it->first, len = it->second;
    a.free.erase(it);
    if (len > bytes) a.free.emplace(off + bytes, len - bytes);
    a.used += bytes;
    *out = a.base + off;
    return true;
  }
  return false;
}

void* ArenaAllocator::allocate(size_t bytes) {
  if (bytes == 0) return nullptr;
  const size_t rounded = (bytes + kAlign - 1) / kAlign * kAlign;
  std::lock_guard lk(mu_);
  void* p = nullptr;
  size_t index = 0;
  for (; index < arenas_.size(); ++index)
    if (carve(arenas_[index], rounded, &p)) break;
  if (!p) {
    Arena a;
    a.size = rounded > arena_bytes_ ? rounded : arena_bytes_;
    int prev = 0;
    LOOM_CUDA_CHECK(cudaGetDevice(&prev));
    if (prev != device_) LOOM_CUDA_CHECK(cudaSetDevice(device_));
    cudaError_t err = cudaMalloc(reinterpret_cast<void**>(&a.base), a.size);
    if (prev != device_) LOOM_CUDA_CHECK(cudaSetDevice(prev));
    if (err != cudaSuccess) {
      cudaGetLastError();  // clear the sticky-free allocation error
      size_t free_b = 0, total_b = 0;
      cudaMemGetInfo(&free_b, &total_b);
      throw Error(fmt::format("out of device memory: allocating {} (arena {}) on device {} with {} free of {}; "
                              "{} reserved by loom in {} arenas",
                              format_bytes(int64_t(bytes)), format_bytes(int64_t(a.size)), device_,
                              format_bytes(int64_t(free_b)), format_bytes(int64_t(total_b)),
                              format_bytes(int64_t(reserved_bytes_locked())), int64_t(arenas_.size())));
    }
    a.free.emplace(0, a.size);
    arenas_.push_back(std::move(a));
    index = arenas_.size() - 1;
    carve(arenas_[index], rounded, &p);
  }
  live_.emplace(reinterpret_cast<uintptr_t>(p), std::make_pair(index, rounded));
  return p;
}

void ArenaAllocator::deallocate(void* p, size_t bytes) {
  if (!p) return;
  std::lock_guard lk(mu_);
  auto it = live_.find(reinterpret_cast<uintptr_t>(p));
  LOOM_CHECK(it != live_.end(), "ArenaAllocator: freeing {} which it did not allocate", p);
  auto [index, len] = it->second;
  LOOM_CHECK((bytes + kAlign - 1) / kAlign * kAlign == len,
             "ArenaAllocator: freeing {} with size {} but it was allocated with {}", p, int64_t(bytes), int64_t(len));
  live_.erase(it);
  Arena& a = arenas_[index];
  size_t off = size_t(static_cast<char*>(p) - a.base);
  a.used -= len;
  auto next = a.free.lower_bound(off);
  if (next != a.free.end() && next->first == off + len) {  // merge with the following block
    len += next->second;
    next = a.free.erase(next);
  }
  if (next != a.free.begin()) {  // merge with the preceding block
    auto prev = std::prev(next);
    if (prev->first + prev->second == off) {
      prev->second += len;
      return;
    }
  }
  a.free.emplace(off, len);
}

size_t ArenaAllocator::reserved_bytes_locked() const {
  size_t s = 0;
  for (const Arena& a : arenas_) s += a.size;
  return s;
}

size_t ArenaAllocator::reserved_bytes() const {
  std::lock_guard lk(mu_);
  return reserved_bytes_locked();
}

size_t ArenaAllocator::arena_count() const {
  std::lock_guard lk(mu_);
  return arenas_.size();
}

void ArenaAllocator::release_unused() {
  std::lock_guard lk(mu_);
  // Arena indices are stored in live_, so only trailing empty arenas are dropped; empty arenas in
  // the middle are kept (they are reused first-fit).
  while (!arenas_.empty() && arenas_.back().used == 0) {
    LOOM_CUDA_CHECK(cudaFree(arenas_.back().base));
    arenas_.pop_back();
  }
}

void* PinnedHostAllocator::allocate(size_t bytes) {
  if (bytes == 0) return nullptr;
  if (bytes >= kMinPinned) {
    void* p = nullptr;
    if (cudaHostAlloc(&p, bytes, cudaHostAllocPortable) == cudaSuccess) {
      std::lock_guard lk(mu_);
      pinned_.emplace(p, bytes);
      pinned_bytes_ += bytes;
      return p;
    }
    const cudaError_t e = cudaGetLastError();  // (clears the non-sticky error: pageable memory serves it)
    std::lock_guard lk(mu_);
    if (!refused_)
      fmt::print(stderr,
                 "note: the host would not page-lock {} bytes ({}; {} bytes locked already): that host buffer of "
                 "the device, and any other refused, is pageable memory, its transfers slower\n",
                 int64_t(bytes), cudaGetErrorString(e), int64_t(pinned_bytes_));
    refused_ = true;
  }
  return cpu_allocator().allocate(bytes);
}

void PinnedHostAllocator::deallocate(void* p, size_t bytes) {
  if (!p) return;
  bool pinned = false;
  {
    std::lock_guard lk(mu_);
    auto it = pinned_.find(p);
    if (it != pinned_.end()) {
      pinned_bytes_ -= it->second;
      pinned_.erase(it);
      pinned = true;
    }
  }
  // Freed outside the lock: cudaFreeHost may wait for the device, and other rank threads' frees
  // (their small pageable buffers too) need only the lookup.
  if (pinned) {
    if (cudaFreeHost(p) != cudaSuccess) cudaGetLastError();  // (no throwing from a pool's release)
    return;
  }
  cpu_allocator().deallocate(p, bytes);
}

Allocator& pinned_host_allocator() {
  static PinnedHostAllocator* a = new PinnedHostAllocator();  // leaked on purpose: outlives static pools
  return *a;
}

ArenaAllocator& device_allocator() {
  static ArenaAllocator* a = new ArenaAllocator();  // leaked on purpose: outlives static pools
  return *a;
}

MemoryPool& device_pool() {
  static MemoryPool* p = new MemoryPool("cuda", &device_allocator());
  return *p;
}

}  // namespace loom::cuda
