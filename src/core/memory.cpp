#include "core/memory.h"

#include <sys/mman.h>

#include <cstdlib>
#include <deque>
#include <iterator>
#include <mutex>
#include <new>
#include <vector>

#include "core/error.h"

namespace loom {

std::string_view mem_tag_name(MemTag t) {
  switch (t) {
    case MemTag::params: return "params";
    case MemTag::grads: return "grads";
    case MemTag::optimizer: return "optimizer";
    case MemTag::activations: return "activations";
    case MemTag::workspace: return "workspace";
    case MemTag::comm: return "comm";
    case MemTag::count: break;
  }
  return "?";
}

std::string_view device_name(Device d) {
  switch (d) {
    case Device::cpu: return "cpu";
    case Device::cuda: return "cuda";
    case Device::emu: return "emu";
  }
  return "?";
}

namespace {
// Host memory. Blocks of 1 MiB and more are mapped from the kernel and unmapped when freed, so
// the process's resident set follows the pools' accounting: through malloc, freed large blocks
// stay in the heap once glibc's adaptive threshold has moved past them, and a run that allocates
// and frees buffers every step (ZeRO's buckets) grows its resident set far beyond what it holds.
// But a fresh mapping costs a page fault per 4 KiB page on first touch (about 0.8 ms per MiB on
// a virtual machine, 35x the cost of writing it), and recomputation frees and re-allocates a
// block's activations at every forward: freed mapped blocks are kept for reuse by a later
// allocation of the same size, up to kCached bytes in all (the oldest unmapped first), so the
// resident set exceeds what the pools hold by at most that.
class CpuAllocator final : public Allocator {
 public:
  static constexpr size_t kMapped = size_t(1) << 20;
  static constexpr size_t kCached = size_t(64) << 20;
  void* allocate(size_t bytes) override {
    if (bytes == 0) return nullptr;
    size_t rounded = (bytes + 63) / 64 * 64;
    if (rounded >= kMapped) {
      rounded = (rounded + kPage - 1) / kPage * kPage;
      {
        std::lock_guard lk(mu_);
        for (auto it = cache_.rbegin(); it != cache_.rend(); ++it)
          if (it->second == rounded) {
            void* p = it->first;
            cache_.erase(std::next(it).base());
            cached_ -= rounded;
            return p;
          }
      }
      void* p = ::mmap(nullptr, rounded, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (p == MAP_FAILED) throw Error(fmt::format("out of host memory allocating {} bytes", bytes));
      return p;
    }
    void* p = std::aligned_alloc(64, rounded);
    if (!p) throw Error(fmt::format("out of host memory allocating {} bytes", bytes));
    return p;
  }
  void deallocate(void* p, size_t bytes) override {
    if (!p) return;
    size_t rounded = (bytes + 63) / 64 * 64;
    if (rounded < kMapped) {
      std::free(p);
      return;
    }
    rounded = (rounded + kPage - 1) / kPage * kPage;
    if (rounded > kCached) {
      ::munmap(p, rounded);
      return;
    }
    std::vector<std::pair<void*, size_t>> evicted;
    {
      std::lock_guard lk(mu_);
      cache_.emplace_back(p, rounded);
      cached_ += rounded;
      while (cached_ > kCached) {
        evicted.push_back(cache_.front());
        cached_ -= cache_.front().second;
        cache_.pop_front();
      }
    }
    for (const auto& [q, n] : evicted) ::munmap(q, n);
  }
  Device device() const override { return Device::cpu; }

 private:
  static constexpr size_t kPage = 4096;
  std::mutex mu_;
  std::deque<std::pair<void*, size_t>> cache_;  // oldest first
  size_t cached_ = 0;
};
}  // namespace

Allocator& cpu_allocator() {
  static CpuAllocator a;
  return a;
}

namespace {
class EmuAllocator final : public Allocator {
 public:
  void* allocate(size_t bytes) override { return cpu_allocator().allocate(bytes); }
  void deallocate(void* p, size_t bytes) override { cpu_allocator().deallocate(p, bytes); }
  Device device() const override { return Device::emu; }
};
}  // namespace

Allocator& emu_allocator() {
  static EmuAllocator a;
  return a;
}

MemoryPool::MemoryPool(std::string name, Allocator* alloc) : name_(std::move(name)), alloc_(alloc) {}

void MemoryPool::set_limit(int64_t bytes, std::string field) {
  LOOM_CHECK(bytes >= 0, "{}: a memory limit must be non-negative, got {}", field, bytes);
  std::lock_guard lk(mu_);
  limit_ = bytes;
  limit_field_ = std::move(field);
}

void* MemoryPool::allocate(size_t bytes, MemTag tag) {
  if (limit_ > 0) {
    std::lock_guard lk(mu_);
    if (s_.total_current + int64_t(bytes) > limit_) {
      std::string held;
      for (int t = 0; t < kNumMemTags; ++t)
        if (s_.current[t] > 0)
          held += fmt::format("{}{} {}", held.empty() ? "" : ", ", mem_tag_name(MemTag(t)), format_bytes(s_.current[t]));
      throw Error(fmt::format("{}: {} more bytes of {} ({}) would take pool '{}' to {}, over the limit of {} (it holds {})",
                              limit_field_, bytes, mem_tag_name(tag), format_bytes(int64_t(bytes)), name_,
                              format_bytes(s_.total_current + int64_t(bytes)), format_bytes(limit_),
                              held.empty() ? "nothing" : held));
    }
  }
  void* p = alloc_->allocate(bytes);
  std::lock_guard lk(mu_);
  int i = int(tag);
  s_.current[i] += int64_t(bytes);
  if (s_.current[i] > s_.peak[i]) s_.peak[i] = s_.current[i];
  ++s_.allocations[i];
  ++s_.total_allocations;
  s_.total_current += int64_t(bytes);
  if (s_.total_current > s_.total_peak) s_.total_peak = s_.total_current;
  return p;
}

void MemoryPool::deallocate(void* p, size_t bytes, MemTag tag) {
  alloc_->deallocate(p, bytes);
  std::lock_guard lk(mu_);
  s_.current[int(tag)] -= int64_t(bytes);
  s_.total_current -= int64_t(bytes);
}

int64_t MemoryPool::current(MemTag t) const { std::lock_guard lk(mu_); return s_.current[int(t)]; }
int64_t MemoryPool::peak(MemTag t) const { std::lock_guard lk(mu_); return s_.peak[int(t)]; }
int64_t MemoryPool::total_current() const { std::lock_guard lk(mu_); return s_.total_current; }
int64_t MemoryPool::total_peak() const { std::lock_guard lk(mu_); return s_.total_peak; }
int64_t MemoryPool::allocations(MemTag t) const { std::lock_guard lk(mu_); return s_.allocations[int(t)]; }
int64_t MemoryPool::total_allocations() const { std::lock_guard lk(mu_); return s_.total_allocations; }
MemStats MemoryPool::stats() const { std::lock_guard lk(mu_); return s_; }

void MemoryPool::reset_peaks() {
  std::lock_guard lk(mu_);
  s_.peak = s_.current;
  s_.total_peak = s_.total_current;
}

std::string MemoryPool::report() const {
  MemStats s = stats();
  std::string out;
  for (int i = 0; i < kNumMemTags; ++i) {
    out += fmt::format("  {:<12} current {:>12}  peak {:>12}\n", mem_tag_name(MemTag(i)),
                       format_bytes(s.current[i]), format_bytes(s.peak[i]));
  }
  out += fmt::format("  {:<12} current {:>12}  peak {:>12}\n", "total", format_bytes(s.total_current),
                     format_bytes(s.total_peak));
  return out;
}

MemoryPool& default_cpu_pool() {
  static MemoryPool pool("cpu");
  return pool;
}

std::string format_bytes(int64_t b) {
  double x = double(b);
  if (x < 1024) return fmt::format("{} B", b);
  if (x < 1024.0 * 1024) return fmt::format("{:.2f} KiB", x / 1024);
  if (x < 1024.0 * 1024 * 1024) return fmt::format("{:.2f} MiB", x / (1024.0 * 1024));
  return fmt::format("{:.2f} GiB", x / (1024.0 * 1024 * 1024));
}

}  // namespace loom
