// Device memory for loom's tagged pools: an Allocator over cudaMalloc'd arenas. Allocations are
// carved from large arenas (first fit over an address-ordered free list, neighbours coalesced on
// free), so a training run calls cudaMalloc a handful of times and never during a step. No managed
// memory. A MemoryPool over this allocator tags device bytes exactly as host bytes.
#pragma once
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <map>
#include <mutex>
#include <vector>

#include "core/memory.h"

namespace loom::cuda {

class ArenaAllocator final : public Allocator {
 public:
  // Arenas are at least `arena_bytes` (larger requests get an arena of their own size).
  explicit ArenaAllocator(size_t arena_bytes = size_t(256) << 20, int device = -1);
  ~ArenaAllocator() override;
  ArenaAllocator(const ArenaAllocator&) = delete;
  ArenaAllocator& operator=(const ArenaAllocator&) = delete;

  // 256-byte aligned device memory (null for 0 bytes). Throws loom::Error when the device is full.
  void* allocate(size_t bytes) override;
  void deallocate(void* p, size_t bytes) override;
  Device device() const override { return Device::cuda; }

  size_t reserved_bytes() const;  // sum of the arenas' sizes (what cudaMalloc gave)
  size_t arena_count() const;
  // Returns every arena with no live allocation to the driver.
  void release_unused();

  static constexpr size_t kAlign = 256;

 private:
  struct Arena {
    char* base = nullptr;
    size_t size = 0;
    size_t used = 0;
    std::map<size_t, size_t> free;  // offset -> length, address ordered
  };
  bool carve(Arena& a, size_t bytes, void** out);
  size_t reserved_bytes_locked() const;

  size_t arena_bytes_;
  int device_;
  mutable std::mutex mu_;
  std::vector<Arena> arenas_;
  std::map<uintptr_t, std::pair<size_t, size_t>> live_;  // address -> (arena index, length)
};

// Host memory (Device::cpu) for a device's transfers: allocations of at least kMinPinned bytes
// page-locked (cudaHostAlloc), so the transfers to and from the device run at the link's rate
// without the driver's staging copy (an offloaded optimizer's state, gradients and master weights;
// DeviceMesh::host_allocator); smaller ones, and any the host refuses to lock (page-locked memory
// cannot be swapped, and a node's limit may be lower than its memory), ordinary host memory.
// Locking is slow, and freeing synchronises the device, so small buffers made and freed often
// (an evaluation's tokens) stay pageable.
class PinnedHostAllocator final : public Allocator {
 public:
  static constexpr size_t kMinPinned = size_t(1) << 20;
  void* allocate(size_t bytes) override;
  void deallocate(void* p, size_t bytes) override;
  Device device() const override { return Device::cpu; }

 private:
  std::mutex mu_;
  std::map<void*, size_t> pinned_;
  size_t pinned_bytes_ = 0;
  bool refused_ = false;
};
Allocator& pinned_host_allocator();

// The process-wide device allocator and pool (device 0 or the current device at first use).
ArenaAllocator& device_allocator();
MemoryPool& device_pool();

}  // namespace loom::cuda
