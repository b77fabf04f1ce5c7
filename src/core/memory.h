// Memory pools with per-category byte accounting. Every byte loom allocates goes through a pool
// and carries a tag; the pool reports current and peak bytes per tag (and in all), so the memory
// model's predictions can be checked exactly. One pool per rank and device.
#pragma once
#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>

namespace loom {

enum class MemTag : uint8_t { params, grads, optimizer, activations, workspace, comm, count };
constexpr int kNumMemTags = int(MemTag::count);
std::string_view mem_tag_name(MemTag t);

// cpu and cuda, and emu: the emulated device (kernels/emu/backend.h), a device held in host
// memory, on which the CPU's kernels run behind a device's interface, for testing device paths.
enum class Device : uint8_t { cpu, cuda, emu };
std::string_view device_name(Device d);
// Whether the host can read and write the device's memory directly (cpu and emu).
inline bool host_memory(Device d) { return d != Device::cuda; }

// Raw allocation for one kind of memory. The CPU one is built in; the CUDA backend adds its own.
class Allocator {
 public:
  virtual ~Allocator() = default;
  virtual void* allocate(size_t bytes) = 0;
  virtual void deallocate(void* p, size_t bytes) = 0;
  virtual Device device() const = 0;
};

// 64-byte aligned host memory (cache lines and AVX-512 vectors).
Allocator& cpu_allocator();
// The same host memory as the emulated device's (Device::emu).
Allocator& emu_allocator();

struct MemStats {
  std::array<int64_t, kNumMemTags> current{};
  std::array<int64_t, kNumMemTags> peak{};
  int64_t total_current = 0;
  int64_t total_peak = 0;
  // allocate() calls since the pool was made (reset_peaks leaves them): a loop that should reuse
  // its buffers shows as a count that stops growing.
  std::array<int64_t, kNumMemTags> allocations{};
  int64_t total_allocations = 0;
};

class MemoryPool {
 public:
  explicit MemoryPool(std::string name = "cpu", Allocator* alloc = &cpu_allocator());
  MemoryPool(const MemoryPool&) = delete;
  MemoryPool& operator=(const MemoryPool&) = delete;

  void* allocate(size_t bytes, MemTag tag);
  void deallocate(void* p, size_t bytes, MemTag tag);

  int64_t current(MemTag t) const;
  int64_t peak(MemTag t) const;
  int64_t total_current() const;
  int64_t total_peak() const;
  int64_t allocations(MemTag t) const;
  int64_t total_allocations() const;
  MemStats stats() const;
  // Peaks restart from the current values (for measuring one phase, e.g. one training step).
  void reset_peaks();
  // An allocation that would take the pool's total above `bytes` (0: no limit) throws loom::Error
  // naming `field`, the tag, what the pool holds and the limit, before allocating.
  void set_limit(int64_t bytes, std::string field);
  int64_t limit() const { return limit_; }

  Device device() const { return alloc_->device(); }
  const std::string& name() const { return name_; }
  // A short multi-line report: one line per tag with current and peak bytes.
  std::string report() const;

 private:
  std::string name_;
  Allocator* alloc_;
  mutable std::mutex mu_;
  MemStats s_;
  int64_t limit_ = 0;
  std::string limit_field_;
};

// The process-wide default CPU pool, for code that has no rank of its own (tools, tests).
MemoryPool& default_cpu_pool();

std::string format_bytes(int64_t bytes);

}  // namespace loom
