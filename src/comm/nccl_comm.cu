// The nccl backend (comm/nccl_comm.h). Host code only (CUDA runtime and NCCL calls, no kernels):
// it is compiled by the C++ compiler as C++20, like the comm/ headers it implements.
#include "comm/nccl_comm.h"

#include <cuda_runtime.h>
#ifdef LOOM_HAVE_NCCL
#include <nccl.h>
#endif

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "kernels/cuda/backend.cuh"

namespace loom::comm {

std::string_view device_path_name(DevicePath p) {
  switch (p) {
    case DevicePath::automatic: return "automatic";
    case DevicePath::nccl: return "nccl";
    case DevicePath::staged: return "staged";
  }
  return "?";
}

bool nccl_available() {
#ifdef LOOM_HAVE_NCCL
  return true;
#else
  return false;
#endif
}

namespace {

using Clock = std::chrono::steady_clock;

std::string cuda_message(cudaError_t e) {
  return fmt::format("{} ({})", cudaGetErrorName(e), cudaGetErrorString(e));
}

void check_cuda(cudaError_t e, const char* call) {
  if (e != cudaSuccess) throw Error(fmt::format("device comm: {} failed: {}", call, cuda_message(e)));
}
#define LOOM_COMM_CUDA(call) check_cuda((call), #call)

std::string seconds(std::chrono::milliseconds t) { return fmt::format("{:g} s", t.count() / 1000.0); }

// Polling back-off: spin briefly (small collectives finish in microseconds), then sleep a little
// so a waiting rank does not hold a core that a rank sharing it needs.
void backoff(long it) {
  if (it < 2000) {
    std::this_thread::yield();
  } else {
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

// Makes `device` current for the calling thread and restores the previous device afterwards.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    LOOM_COMM_CUDA(cudaGetDevice(&prev_));
    if (prev_ != device) LOOM_COMM_CUDA(cudaSetDevice(device));
    changed_ = prev_ != device;
  }
  ~DeviceGuard() {
    if (changed_) cudaSetDevice(prev_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = 0;
  bool changed_ = false;
};

// Host staging memory from the communicator's pool (tagged MemTag::comm), page-locked with
// cudaHostRegister so copies run at full speed and asynchronously. Only whole pages inside the
// allocation are registered, so no other buffer's registration can overlap them. Kept between
// calls and grown to the largest request. If registration is refused, the memory stays pageable
// (copies still work, slower).
class PinnedScratch {
 public:
  PinnedScratch() = default;
  ~PinnedScratch() { release(); }
  PinnedScratch(const PinnedScratch&) = delete;
  PinnedScratch& operator=(const PinnedScratch&) = delete;

  char* get(MemoryPool* pool, size_t bytes) {
    if (bytes <= cap_) return aligned_;
    release();
    size_t cap = (bytes + kPage - 1) / kPage * kPage;
    pool_ = pool;
    raw_bytes_ = cap + kPage;
    raw_ = pool_->allocate(raw_bytes_, MemTag::comm);
    aligned_ = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(raw_) + kPage - 1) / kPage * kPage);
    cap_ = cap;
    registered_ = cudaHostRegister(aligned_, cap_, cudaHostRegisterDefault) == cudaSuccess;
    if (!registered_) cudaGetLastError();  // clear the (non-sticky) error: pageable copies work
    return aligned_;
  }

 private:
  static constexpr size_t kPage = 4096;
  void release() {
    if (!raw_) return;
    if (registered_) cudaHostUnregister(aligned_);
    pool_->deallocate(raw_, raw_bytes_, MemTag::comm);
    raw_ = nullptr;
    aligned_ = nullptr;
    cap_ = raw_bytes_ = 0;
    registered_ = false;
  }
  MemoryPool* pool_ = nullptr;
  void* raw_ = nullptr;
  size_t raw_bytes_ = 0;
  char* aligned_ = nullptr;
  size_t cap_ = 0;
  bool registered_ = false;
};

#ifdef LOOM_HAVE_NCCL
using NcclHandle = ncclComm_t;

std::string nccl_message(ncclResult_t r) { return fmt::format("{} ({})", ncclGetErrorString(r), int(r)); }

ncclDataType_t nccl_reduce_type(DType dt) {
  switch (dt) {
    case DType::f32: return ncclFloat32;
    case DType::bf16: return ncclBfloat16;
    case DType::f16: return ncclFloat16;
    default: throw Error(fmt::format("nccl comm: no reduction over {} values", dtype_name(dt)));
  }
}
ncclRedOp_t nccl_op(ReduceOp op) { return op == ReduceOp::sum ? ncclSum : ncclMax; }
#else
using NcclHandle = void*;
#endif

// Per rank, all-gathered when a device communicator is made (u32 words).
struct RankInfo {
  uint32_t ok = 0;  // 1: the device below exists and its properties were read
  uint32_t device = 0;
  uint32_t path = 0;  // the requested DevicePath
  uint32_t has_nccl = 0;
  std::array<uint32_t, 4> uuid{};
};
constexpr int kInfoWords = int(sizeof(RankInfo) / 4);
static_assert(sizeof(RankInfo) == 32, "RankInfo is all-gathered as 8 u32 words");

std::string uuid_text(const std::array<uint32_t, 4>& u) {
  return fmt::format("{:08x}-{:08x}-{:08x}-{:08x}", u[0], u[1], u[2], u[3]);
}

// A staged non-blocking send's host copy (tagged comm in the communicator's pool) and the host
// communicator's pending send of it; the copy is freed once the send is done.
struct StagedSend final : PendingSend {
  StagedSend(MemoryPool* pool, size_t bytes) : pool_(pool), bytes_(std::max<size_t>(bytes, 1)) {
    host = static_cast<char*>(pool_->allocate(bytes_, MemTag::comm));
  }
  ~StagedSend() override {
    // Gone unfinished (an error unwinding): a host backend may still read the copy (MPI's freed
    // request does), so it is left allocated rather than freed under it.
    const bool unfinished = send && !finished_ && !send->done();
    send.reset();
    if (!unfinished) pool_->deallocate(host, bytes_, MemTag::comm);
  }
  void wait() override {
    if (send && !finished_) send->wait();
    finished_ = true;
  }
  bool done() override { return finished_ || !send || send->done(); }
  char* host = nullptr;
  std::unique_ptr<PendingSend> send;

 private:
  MemoryPool* pool_;
  size_t bytes_;
  bool finished_ = false;
};

class DeviceComm final : public Comm {
 public:
  DeviceComm(std::unique_ptr<Comm> host, DeviceCommOptions dopts, DevicePath path, int device)
      : Comm(host->options()), host_(std::move(host)), dopts_(dopts), path_(path), device_(device) {
    if (!opts_.pool) opts_.pool = &default_cpu_pool();
    DeviceGuard g(device_);
    if (dopts_.stream) {
      stream_ = static_cast<cudaStream_t>(dopts_.stream);
    } else {
      // A blocking stream: work queued on the legacy default stream completes before ours runs.
      LOOM_COMM_CUDA(cudaStreamCreate(&stream_));
      own_stream_ = true;
    }
  }

  ~DeviceComm() override {
    int prev = -1;
    cudaGetDevice(&prev);
    cudaSetDevice(device_);
#ifdef LOOM_HAVE_NCCL
    if (nccl_) {
      // Finalize flushes outstanding work, bounded by the timeout; past it (or on an error) the
      // communicator is aborted instead: a destructor cannot report, only end promptly.
      bool done = false;
      ncclResult_t r = ncclCommFinalize(nccl_);
      if (r == ncclSuccess || r == ncclInProgress) {
        auto deadline = Clock::now() + opts_.timeout;
        for (long it = 0;; ++it) {
          ncclResult_t st = ncclSuccess;
          if (ncclCommGetAsyncError(nccl_, &st) != ncclSuccess) break;
          if (st == ncclSuccess) {
            done = true;
            break;
          }
          if (st != ncclInProgress || Clock::now() >= deadline) break;
          backoff(it);
        }
      }
      if (done) {
        ncclCommDestroy(nccl_);
      } else {
        ncclCommAbort(nccl_);
      }
      nccl_ = nullptr;
    }
#endif
    if (barrier_scratch_) cudaFree(barrier_scratch_);
    if (own_stream_) cudaStreamDestroy(stream_);
    if (prev >= 0 && prev != device_) cudaSetDevice(prev);
  }

  int rank() const override { return host_->rank(); }
  int size() const override { return host_->size(); }
  std::string_view backend() const override { return path_ == DevicePath::nccl ? "nccl" : "nccl-staged"; }
  bool device_buffers() const override { return true; }
  int world_rank() const override { return host_->world_rank(); }
  DevicePath path() const { return path_; }

  // Collective over host_ (rank 0 creates the id): sets up the NCCL communicator.
  void init_nccl() {
#ifdef LOOM_HAVE_NCCL
    DeviceGuard g(device_);
    // Word 0: rank 0's status (1: id valid), words 1..: ncclUniqueId. Broadcast even on failure so
    // the other ranks learn of it instead of waiting.
    constexpr int kIdWords = int((sizeof(ncclUniqueId) + 3) / 4);
    std::array<uint32_t, 1 + kIdWords> msg{};
    std::string id_error;
    if (rank() == 0) {
      ncclUniqueId id;
      ncclResult_t r = ncclGetUniqueId(&id);
      if (r == ncclSuccess) {
        msg[0] = 1;
        std::memcpy(&msg[1], &id, sizeof id);
      } else {
        id_error = nccl_message(r);
      }
    }
    host_->broadcast(msg.data(), int64_t(msg.size()), DType::u32, 0);
    LOOM_CHECK(msg[0] == 1, "nccl comm: rank {}: ncclGetUniqueId failed on rank 0{}", world_rank(),
               id_error.empty() ? "" : ": " + id_error);
    ncclUniqueId id;
    std::memcpy(&id, &msg[1], sizeof id);
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;  // every wait below is ours, bounded by the timeout
    begin(fmt::format("ncclCommInitRankConfig (rank {} of {}, device {})", rank(), size(), device_));
    ncclResult_t r = ncclCommInitRankConfig(&nccl_, size(), id, rank(), &cfg);
    if (r != ncclSuccess && r != ncclInProgress) {
      std::string detail = nccl_ ? std::string(ncclGetLastError(nccl_)) : std::string();
      if (nccl_) ncclCommAbort(nccl_);
      nccl_ = nullptr;
      throw Error(fmt::format("nccl comm: rank {}: {} failed: {}{}", world_rank(), what_, nccl_message(r),
                              detail.empty() ? "" : " - " + detail));
    }
    wait_nccl(/*stream=*/false);
    LOOM_COMM_CUDA(cudaMalloc(&barrier_scratch_, sizeof(float)));
#else
    throw Error("nccl comm: loom was built without NCCL");
#endif
  }

 protected:
  void do_all_reduce(void* buf, int64_t count, DType dt, ReduceOp op) override {
    begin(fmt::format("all_reduce ({}, {} [{}])", reduce_op_name(op), dtype_name(dt), count));
    DeviceGuard g(device_);
    if (local()) return;  // (the buffer is the result)
    if (path_ == DevicePath::staged) {
      const size_t bytes = size_t(count) * dtype_size(dt);
      char* h = stage_[0].get(opts_.pool, bytes);
      to_host(h, buf, bytes);
      sync_host_timeout();
      host_->all_reduce(h, count, dt, op);
      to_device(buf, h, bytes);
      return;
    }
#ifdef LOOM_HAVE_NCCL
    check_usable();
    if (count > 0) {
      enqueue(ncclAllReduce(buf, buf, size_t(count), nccl_reduce_type(dt), nccl_op(op), nccl_, stream_),
              "ncclAllReduce");
      wait_nccl(true);
    }
#endif
  }

  void do_reduce_scatter(const void* send, void* recv, std::span<const int64_t> counts, DType dt,
                         ReduceOp op) override {
    const auto offs = offsets(counts);
    const size_t es = dtype_size(dt);
    const int r = rank();
    begin(fmt::format("reduce_scatter ({}, {} [{}])", reduce_op_name(op), dtype_name(dt), offs.back()));
    DeviceGuard g(device_);
    if (local()) return local_copy(recv, send, size_t(offs.back()) * es);
    if (path_ == DevicePath::staged) {
      char* h = stage_[0].get(opts_.pool, size_t(offs.back()) * es);
      char* mine = h + size_t(offs[size_t(r)]) * es;
      to_host(h, send, size_t(offs.back()) * es);
      sync_host_timeout();
      host_->reduce_scatter_v(h, mine, counts, dt, op);
      to_device(recv, mine, size_t(counts[size_t(r)]) * es);
      return;
    }
#ifdef LOOM_HAVE_NCCL
    check_usable();
    const char* s = static_cast<const char*>(send);
    if (offs.back() == 0) return;
    if (all_equal(counts)) {
      enqueue(ncclReduceScatter(send, recv, size_t(counts[0]), nccl_reduce_type(dt), nccl_op(op), nccl_, stream_),
              "ncclReduceScatter");
    } else {
      // Uneven chunks: one reduce per chunk to its owner, fused into one NCCL group. recvbuff is
      // only read on the root; the others pass their own chunk (a valid buffer of that size).
      enqueue(ncclGroupStart(), "ncclGroupStart");
      for (int i = 0; i < size(); ++i) {
        if (counts[size_t(i)] == 0) continue;
        const char* chunk = s + size_t(offs[size_t(i)]) * es;
        void* out = i == r ? recv : const_cast<char*>(chunk);
        enqueue(ncclReduce(chunk, out, size_t(counts[size_t(i)]), nccl_reduce_type(dt), nccl_op(op), i, nccl_,
                           stream_),
                "ncclReduce");
      }
      enqueue(ncclGroupEnd(), "ncclGroupEnd");
    }
    wait_nccl(true);
#endif
  }

  void do_all_gather(const void* send, void* recv, std::span<const int64_t> counts, DType dt) override {
    const auto offs = offsets(counts);
    const size_t es = dtype_size(dt);
    const int r = rank();
    begin(fmt::format("all_gather ({} [{}])", dtype_name(dt), offs.back()));
    DeviceGuard g(device_);
    if (local()) return local_copy(recv, send, size_t(offs.back()) * es);
    if (path_ == DevicePath::staged) {
      char* h = stage_[0].get(opts_.pool, size_t(offs.back()) * es);
      char* mine = h + size_t(offs[size_t(r)]) * es;
      to_host(mine, send, size_t(counts[size_t(r)]) * es);
      sync_host_timeout();
      host_->all_gather_v(mine, h, counts, dt);
      to_device(recv, h, size_t(offs.back()) * es);
      return;
    }
#ifdef LOOM_HAVE_NCCL
    check_usable();
    char* out = static_cast<char*>(recv);
    if (offs.back() == 0) return;
    // Data movement only: bytes, so every dtype travels unchanged.
    if (all_equal(counts)) {
      enqueue(ncclAllGather(send, recv, size_t(counts[0]) * es, ncclUint8, nccl_, stream_), "ncclAllGather");
    } else {
      // Uneven chunks: one broadcast per chunk from its owner, fused into one NCCL group.
      enqueue(ncclGroupStart(), "ncclGroupStart");
      for (int i = 0; i < size(); ++i) {
        if (counts[size_t(i)] == 0) continue;
        char* chunk = out + size_t(offs[size_t(i)]) * es;
        const void* in = i == r ? send : chunk;
        enqueue(ncclBroadcast(in, chunk, size_t(counts[size_t(i)]) * es, ncclUint8, i, nccl_, stream_),
                "ncclBroadcast");
      }
      enqueue(ncclGroupEnd(), "ncclGroupEnd");
    }
    wait_nccl(true);
#endif
  }

  void do_broadcast(void* buf, int64_t count, DType dt, int root) override {
    begin(fmt::format("broadcast ({} [{}] from rank {})", dtype_name(dt), count, root));
    DeviceGuard g(device_);
    const size_t bytes = size_t(count) * dtype_size(dt);
    if (local()) return;  // (the root's buffer is the result)
    if (path_ == DevicePath::staged) {
      char* h = stage_[0].get(opts_.pool, bytes);
      if (rank() == root) to_host(h, buf, bytes);
      sync_host_timeout();
      host_->broadcast(h, count, dt, root);
      if (rank() != root) to_device(buf, h, bytes);
      return;
    }
#ifdef LOOM_HAVE_NCCL
    check_usable();
    if (bytes == 0) return;
    enqueue(ncclBroadcast(buf, buf, bytes, ncclUint8, root, nccl_, stream_), "ncclBroadcast");
    wait_nccl(true);
#endif
  }

  void do_send(const void* buf, int64_t count, DType dt, int dst, int tag) override {
    begin(fmt::format("send of {} [{}] to rank {} tag {}", dtype_name(dt), count, dst, tag));
    DeviceGuard g(device_);
    const size_t bytes = size_t(count) * dtype_size(dt);
    if (path_ == DevicePath::staged) {
      char* h = stage_[0].get(opts_.pool, bytes);
      to_host(h, buf, bytes);
      sync_host_timeout();
      host_->send(h, count, dt, dst, tag);
      return;
    }
#ifdef LOOM_HAVE_NCCL
    check_usable();
    if (bytes == 0) return;
    enqueue(ncclSend(buf, bytes, ncclUint8, dst, nccl_, stream_), "ncclSend");
    wait_nccl(true);
#endif
  }

  // The staged path's non-blocking send: the buffer copied to host memory of the send's own (from
  // the communicator's pool, tag comm), handed to the host communicator's isend, and kept until the
  // send completes. (The host backends' blocking sends wait for the receiver: a pipeline's ranks
  // sending to each other at once would wait for ever.) NCCL's path sends as do_send does.
  std::unique_ptr<PendingSend> do_isend(const void* buf, int64_t count, DType dt, int dst, int tag) override {
    if (path_ != DevicePath::staged) return Comm::do_isend(buf, count, dt, dst, tag);
    begin(fmt::format("send of {} [{}] to rank {} tag {} (non-blocking)", dtype_name(dt), count, dst, tag));
    DeviceGuard g(device_);
    const size_t bytes = size_t(count) * dtype_size(dt);
    auto p = std::make_unique<StagedSend>(opts_.pool, bytes);
    to_host(p->host, buf, bytes);
    sync_host_timeout();
    p->send = host_->isend(p->host, count, dt, dst, tag);
    return p;
  }

  void do_recv(void* buf, int64_t count, DType dt, int src, int tag) override {
    begin(fmt::format("recv of {} [{}] from rank {} tag {}", dtype_name(dt), count, src, tag));
    DeviceGuard g(device_);
    const size_t bytes = size_t(count) * dtype_size(dt);
    if (path_ == DevicePath::staged) {
      char* h = stage_[1].get(opts_.pool, bytes);
      sync_host_timeout();
      host_->recv(h, count, dt, src, tag);
      to_device(buf, h, bytes);
      return;
    }
#ifdef LOOM_HAVE_NCCL
    check_usable();
    if (bytes == 0) return;
    enqueue(ncclRecv(buf, bytes, ncclUint8, src, nccl_, stream_), "ncclRecv");
    wait_nccl(true);
#endif
  }

  void do_sendrecv(const void* send_buf, int64_t send_count, int dst, void* recv_buf, int64_t recv_count,
                   int src, DType dt, int tag) override {
    begin(fmt::format("sendrecv ({} [{}] to rank {}, [{}] from rank {}, tag {})", dtype_name(dt), send_count, dst,
                      recv_count, src, tag));
    DeviceGuard g(device_);
    const size_t es = dtype_size(dt);
    const size_t sbytes = size_t(send_count) * es, rbytes = size_t(recv_count) * es;
    if (path_ == DevicePath::staged) {
      char* hs = stage_[0].get(opts_.pool, sbytes);
      char* hr = stage_[1].get(opts_.pool, rbytes);
      to_host(hs, send_buf, sbytes);
      sync_host_timeout();
      host_->sendrecv(hs, send_count, dst, hr, recv_count, src, dt, tag);
      to_device(recv_buf, hr, rbytes);
      return;
    }
#ifdef LOOM_HAVE_NCCL
    check_usable();
    LOOM_CHECK((dst == rank()) == (src == rank()),
               "nccl comm: rank {}: {}: a rank sends to itself only where it also receives from itself",
               world_rank(), what_);
    if (dst == rank() && src == rank()) {
      LOOM_CHECK(send_count == recv_count, "nccl comm: {}: a rank exchanging with itself sends {} elements but "
                 "receives {}", what_, send_count, recv_count);
      if (sbytes > 0 && send_buf != recv_buf) {
        LOOM_COMM_CUDA(cudaMemcpyAsync(recv_buf, send_buf, sbytes, cudaMemcpyDefault, stream_));
      }
      wait_stream();
      return;
    }
    if (sbytes == 0 && rbytes == 0) return;
    enqueue(ncclGroupStart(), "ncclGroupStart");
    if (sbytes > 0) enqueue(ncclSend(send_buf, sbytes, ncclUint8, dst, nccl_, stream_), "ncclSend");
    if (rbytes > 0) enqueue(ncclRecv(recv_buf, rbytes, ncclUint8, src, nccl_, stream_), "ncclRecv");
    enqueue(ncclGroupEnd(), "ncclGroupEnd");
    wait_nccl(true);
#endif
  }

  void do_barrier() override {
    begin("barrier");
    DeviceGuard g(device_);
    if (local()) return wait_stream();
    if (path_ == DevicePath::staged) {
      wait_stream();  // this rank's queued work is done before it reports arrival
      sync_host_timeout();
      host_->barrier();
      return;
    }
#ifdef LOOM_HAVE_NCCL
    check_usable();
    // NCCL has no barrier: a one-element all-reduce completes only once every rank took part.
    enqueue(ncclAllReduce(barrier_scratch_, barrier_scratch_, 1, ncclFloat32, ncclSum, nccl_, stream_),
            "ncclAllReduce");
    wait_nccl(true);
#endif
  }

  std::unique_ptr<Comm> do_split(int color, int key) override {
    sync_host_timeout();
    auto part = host_->split(color, key);
    if (!part) return nullptr;
    DeviceCommOptions o = dopts_;
    o.device = device_;
    return make_device_comm(std::move(part), o);
  }

 private:
  void begin(std::string what) {
    what_ = std::move(what);
    deadline_ = Clock::now() + opts_.timeout;
  }

  // The host communicator runs the staged collectives: it gets this communicator's timeout.
  void sync_host_timeout() { host_->set_timeout(opts_.timeout); }

  static bool all_equal(std::span<const int64_t> counts) {
    return std::all_of(counts.begin(), counts.end(), [&](int64_t c) { return c == counts[0]; });
  }

  static std::vector<int64_t> offsets(std::span<const int64_t> counts) {
    std::vector<int64_t> o(counts.size() + 1, 0);
    for (size_t i = 0; i < counts.size(); ++i) o[i + 1] = o[i] + counts[i];
    return o;
  }

  // A group of one rank off NCCL: a collective's result is its input (no staging through host
  // memory), copied where it is not in place.
  bool local() const { return path_ == DevicePath::staged && size() == 1; }
  void local_copy(void* dst, const void* src, size_t bytes) {
    if (bytes > 0 && dst != src) LOOM_COMM_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream_));
    wait_stream();
  }

  // Waits for the stream (staged copies, local copies) against the deadline.
  void wait_stream() {
    for (long it = 0;; ++it) {
      cudaError_t e = cudaStreamQuery(stream_);
      if (e == cudaSuccess) return;
      if (e != cudaErrorNotReady) {
        throw Error(fmt::format("device comm ({}): rank {}: {}: the stream failed: {}", backend(), world_rank(),
                                what_, cuda_message(e)));
      }
      if (Clock::now() >= deadline_) {
        throw Error(fmt::format("device comm ({}): rank {}: {} timed out after {}: the work queued on the "
                                "communicator's stream did not finish", backend(), world_rank(), what_,
                                seconds(opts_.timeout)));
      }
      backoff(it);
    }
  }

  void to_host(char* h, const void* src, size_t bytes) {
    if (bytes == 0) return;
    LOOM_COMM_CUDA(cudaMemcpyAsync(h, src, bytes, cudaMemcpyDefault, stream_));
    wait_stream();
  }

  void to_device(void* dst, const char* h, size_t bytes) {
    if (bytes == 0) return;
    LOOM_COMM_CUDA(cudaMemcpyAsync(dst, h, bytes, cudaMemcpyDefault, stream_));
    wait_stream();
  }

#ifdef LOOM_HAVE_NCCL
  void check_usable() const {
    LOOM_CHECK(nccl_ != nullptr, "nccl comm: rank {}: {} on a communicator that was aborted after an earlier "
               "failure: {}", world_rank(), what_, failure_);
  }

  // Aborts the NCCL communicator (the only way to stop its work) and throws `msg`.
  [[noreturn]] void abort_with(const std::string& msg) {
    failure_ = msg;
    if (nccl_) ncclCommAbort(nccl_);
    nccl_ = nullptr;
    throw Error(msg);
  }

  // The return value of an NCCL call that queues work (non-blocking communicators may answer
  // ncclInProgress: the work is being queued, wait_nccl() finishes it).
  void enqueue(ncclResult_t r, const char* call) {
    if (r == ncclSuccess || r == ncclInProgress) return;
    std::string detail = nccl_ ? std::string(ncclGetLastError(nccl_)) : std::string();
    abort_with(fmt::format("nccl comm: rank {}: {}: {} failed: {}{}; NCCL communicator aborted", world_rank(),
                           what_, call, nccl_message(r), detail.empty() ? "" : " - " + detail));
  }

  // Polls the communicator's asynchronous state (and, with `stream`, the stream) until the call's
  // work is done; an NCCL error or the deadline aborts the communicator and throws naming the call.
  void wait_nccl(bool stream) {
    for (long it = 0;; ++it) {
      ncclResult_t st = ncclSuccess;
      ncclResult_t q = ncclCommGetAsyncError(nccl_, &st);
      if (q != ncclSuccess) st = q;
      if (st == ncclSuccess) {
        if (!stream) return;
        cudaError_t e = cudaStreamQuery(stream_);
        if (e == cudaSuccess) return;
        if (e != cudaErrorNotReady) {
          abort_with(fmt::format("nccl comm: rank {}: {}: the stream failed: {}; NCCL communicator aborted",
                                 world_rank(), what_, cuda_message(e)));
        }
      } else if (st != ncclInProgress) {
        std::string detail = ncclGetLastError(nccl_);
        abort_with(fmt::format("nccl comm: rank {}: {} failed: {}{}; NCCL communicator aborted", world_rank(),
                               what_, nccl_message(st), detail.empty() ? "" : " - " + detail));
      }
      if (Clock::now() >= deadline_) {
        abort_with(fmt::format("nccl comm: rank {}: {} timed out after {}: the GPU work did not finish or a rank "
                               "of the {} did not take part; NCCL communicator aborted", world_rank(), what_,
                               seconds(opts_.timeout), size() == 1 ? "communicator" : fmt::format("{} ranks", size())));
      }
      backoff(it);
    }
  }
#endif

  std::unique_ptr<Comm> host_;
  DeviceCommOptions dopts_;
  DevicePath path_;
  int device_;
  cudaStream_t stream_ = nullptr;
  bool own_stream_ = false;
  NcclHandle nccl_ = nullptr;
  float* barrier_scratch_ = nullptr;  // f32 [1], device: the nccl barrier's all-reduce
  std::string failure_;
  std::string what_;
  Clock::time_point deadline_{};
  PinnedScratch stage_[2];  // staged path: the collective's buffer (and sendrecv's receive side)
};

}  // namespace

std::unique_ptr<Comm> make_device_comm(std::unique_ptr<Comm> host, DeviceCommOptions opts) {
  LOOM_CHECK(host != nullptr, "device comm: no host communicator given");
  // Everything a rank could fail on is found before the all-gather and shared through it, so
  // every rank throws the same error instead of some waiting for the others.
  RankInfo mine;
  mine.path = uint32_t(opts.path);
  mine.has_nccl = nccl_available() ? 1 : 0;
  std::string local_error;
  int ndev = 0;
  cudaError_t e = cudaGetDeviceCount(&ndev);
  if (e != cudaSuccess || ndev == 0) {
    cudaGetLastError();
    local_error = e != cudaSuccess ? cuda_message(e) : std::string("no CUDA device");
  } else {
    int dev = opts.device;
    if (dev < 0) e = cudaGetDevice(&dev);
    cudaDeviceProp prop{};
    if (e == cudaSuccess && dev >= ndev) {
      local_error = fmt::format("device {} requested but only {} present", dev, ndev);
    } else if (e == cudaSuccess && (e = cudaGetDeviceProperties(&prop, dev)) == cudaSuccess) {
      mine.ok = 1;
      mine.device = uint32_t(dev);
      std::memcpy(mine.uuid.data(), prop.uuid.bytes, sizeof mine.uuid);
    }
    if (e != cudaSuccess) {
      cudaGetLastError();
      local_error = cuda_message(e);
    }
  }
  const int n = host->size(), me = host->rank();
  std::vector<RankInfo> all(static_cast<size_t>(n));
  host->all_gather(&mine, all.data(), int64_t(n) * kInfoWords, DType::u32);
  for (int i = 0; i < n; ++i) {
    const RankInfo& ri = all[size_t(i)];
    LOOM_CHECK(ri.ok, "device comm: rank {} of {} has no usable CUDA device{}", i, n,
               i == me && !local_error.empty() ? ": " + local_error : std::string());
    LOOM_CHECK(ri.path == all[0].path, "device comm: ranks disagree on the path: rank 0 asked for {}, rank {} for {}",
               device_path_name(DevicePath(all[0].path)), i, device_path_name(DevicePath(ri.path)));
  }
  // Ranks on one GPU (same UUID), reported as the first pair found.
  int share_a = -1, share_b = -1;
  for (int i = 0; i < n && share_a < 0; ++i) {
    for (int j = i + 1; j < n; ++j) {
      if (all[size_t(i)].uuid == all[size_t(j)].uuid) {
        share_a = i;
        share_b = j;
        break;
      }
    }
  }
  bool every_nccl = std::all_of(all.begin(), all.end(), [](const RankInfo& ri) { return ri.has_nccl != 0; });
  DevicePath path = opts.path;
  // A group of one rank copies locally (its collectives are copies at most): no NCCL communicator
  // unless one is asked for.
  if (path == DevicePath::automatic && n == 1) path = DevicePath::staged;
  if (path == DevicePath::automatic) path = every_nccl && share_a < 0 ? DevicePath::nccl : DevicePath::staged;
  if (path == DevicePath::nccl) {
    LOOM_CHECK(every_nccl, "device comm: the nccl path was requested but loom was built without NCCL");
    LOOM_CHECK(share_a < 0,
               "device comm: the nccl path was requested but ranks {} and {} share GPU {} (NCCL needs one GPU per "
               "rank; use the staged path, DevicePath::staged or automatic)",
               share_a, share_b, uuid_text(all[size_t(share_a < 0 ? 0 : share_a)].uuid));
  }
  opts.device = int(mine.device);
  auto comm = std::make_unique<DeviceComm>(std::move(host), opts, path, opts.device);
  if (path == DevicePath::nccl) comm->init_nccl();
  return comm;
}

DevicePath device_comm_path(const Comm& c) {
  const auto* d = dynamic_cast<const DeviceComm*>(&c);
  LOOM_CHECK(d != nullptr, "device_comm_path: communicator of backend '{}' is not a device communicator",
             c.backend());
  return d->path();
}

}  // namespace loom::comm

namespace loom::cuda {

std::unique_ptr<comm::Comm> CudaBackend::buffer_comm(std::unique_ptr<comm::Comm> host, bool staged) {
  comm::DeviceCommOptions o;
  o.path = staged ? comm::DevicePath::staged : require_nccl_ ? comm::DevicePath::nccl : comm::DevicePath::automatic;
  o.device = device_index();
  o.stream = native_queue();
  return comm::make_device_comm(std::move(host), o);
}

}  // namespace loom::cuda
