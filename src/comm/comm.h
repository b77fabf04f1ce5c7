// Communicators: the collectives and point-to-point transfers every parallel dimension uses.
//
// A `Comm` is one rank's handle on a group of ranks. Backends: threads (ranks are threads of one
// process, comm/threads.h) and mpi (one rank per process, comm/mpi_comm.h). Every call is
// collective over the group unless it says otherwise, and every blocking call is bounded by the
// communicator's timeout.
//
// Determinism contract (both backends, bit-identical on every rank and between the backends):
// the elements are split into `size()` contiguous chunks by chunk_range(); chunk c is reduced by
// folding the ranks' inputs in the order c+1, c+2, ..., c+size()-1, c (mod size()), i.e. the
// order of a ring reduce-scatter that ends at rank c. Reductions accumulate in f32; bf16 inputs
// are widened to f32 and the final value is rounded to bf16 once (round to nearest even).
#pragma once
#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "core/dtype.h"
#include "core/memory.h"
#include "core/tensor.h"

namespace loom::comm {

enum class ReduceOp : uint8_t { sum, max };
std::string_view reduce_op_name(ReduceOp op);

struct CommOptions {
  // Every blocking call throws (threads) or aborts the job (mpi) when it waits longer than this,
  // naming the call and the ranks it was waiting for.
  std::chrono::milliseconds timeout{300'000};
  // Where backends allocate their staging buffers (tagged MemTag::comm); nullptr: the process's
  // default CPU pool.
  MemoryPool* pool = nullptr;
};

// Elements [begin, end) of chunk i when `count` elements are split over n ranks: the first
// count % n chunks hold one element more than the others.
struct Range {
  int64_t begin = 0;
  int64_t end = 0;
  int64_t size() const { return end - begin; }
};
Range chunk_range(int64_t count, int n, int i);

// Highest user tag for send/recv (the smallest upper bound every MPI guarantees).
constexpr int kMaxTag = 32767;

// A send in flight (Comm::isend). wait() returns once the buffer may be reused, bounded by the
// communicator's timeout counted from the wait, and fails as the blocking send would have. The
// buffer must stay unchanged and alive until then. Destroying a handle that was not waited for
// withdraws the message if the receiver has not taken it yet (else waits for its copy): that is
// for unwinding after an error, never for normal use. The communicator must outlive the handle.
class PendingSend {
 public:
  virtual ~PendingSend() = default;
  virtual void wait() = 0;
  // Whether the send has completed (never blocks); wait() must still be called.
  virtual bool done() = 0;
};

class Comm {
 public:
  explicit Comm(CommOptions opts) : opts_(opts) {}
  virtual ~Comm() = default;
  Comm(const Comm&) = delete;
  Comm& operator=(const Comm&) = delete;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string_view backend() const = 0;
  // This rank's number in the world the communicator was split from (for messages).
  virtual int world_rank() const = 0;
  // Whether the buffers may be in a GPU's memory (a device communicator, comm/nccl_comm.h); the
  // host backends take host memory only.
  virtual bool device_buffers() const { return false; }

  std::chrono::milliseconds timeout() const { return opts_.timeout; }
  void set_timeout(std::chrono::milliseconds t) { opts_.timeout = t; }
  const CommOptions& options() const { return opts_; }

  // In place: buf (f32 or bf16) [count] becomes the reduction over the ranks.
  void all_reduce(void* buf, int64_t count, DType dt, ReduceOp op = ReduceOp::sum);
  // send [count] -> recv [count / size()]: rank r receives chunk r of the reduction. count must
  // be divisible by size(). recv may alias send's chunk r.
  void reduce_scatter(const void* send, void* recv, int64_t count, DType dt,
                      ReduceOp op = ReduceOp::sum);
  // As reduce_scatter with explicit chunk sizes: send [sum(counts)] -> recv [counts[rank()]].
  // counts has size() entries and is the same on every rank.
  void reduce_scatter_v(const void* send, void* recv, std::span<const int64_t> counts, DType dt,
                        ReduceOp op = ReduceOp::sum);
  // send [count / size()] -> recv [count]: chunk r of recv is rank r's send. Any dtype. send may
  // alias recv's chunk rank().
  void all_gather(const void* send, void* recv, int64_t count, DType dt);
  void all_gather_v(const void* send, void* recv, std::span<const int64_t> counts, DType dt);
  // buf [count] of `root` is copied to every rank. Any dtype.
  void broadcast(void* buf, int64_t count, DType dt, int root);
  // Point to point (not collective). Messages between a pair with the same tag arrive in order;
  // recv's count and dtype must match the send's. send returns once buf may be reused (on the
  // threads backend: once the receiver has copied it). tag in [0, kMaxTag].
  void send(const void* buf, int64_t count, DType dt, int dst, int tag = 0);
  void recv(void* buf, int64_t count, DType dt, int src, int tag = 0);
  // Non-blocking send: returns at once (both backends); the message joins the same ordered
  // channel as send()'s. Backends without a non-blocking path send before returning.
  std::unique_ptr<PendingSend> isend(const void* buf, int64_t count, DType dt, int dst, int tag = 0);
  // Sends to dst and receives from src at once (no ordering deadlock; dst and src may be equal
  // or this rank).
  void sendrecv(const void* send_buf, int64_t send_count, int dst, void* recv_buf,
                int64_t recv_count, int src, DType dt, int tag = 0);
  void barrier();
  // Collective: ranks passing the same color form a new communicator, ranked by (key, rank()).
  // A negative color takes part in the call but gets no communicator (nullptr).
  std::unique_ptr<Comm> split(int color, int key);

  // Tensor forms (CPU tensors; dtype and sizes are checked).
  void all_reduce(const Tensor& t, ReduceOp op = ReduceOp::sum);
  void reduce_scatter(const Tensor& in, const Tensor& out, ReduceOp op = ReduceOp::sum);
  void all_gather(const Tensor& in, const Tensor& out);
  void broadcast(const Tensor& t, int root);
  void send(const Tensor& t, int dst, int tag = 0);
  void recv(const Tensor& t, int src, int tag = 0);
  std::unique_ptr<PendingSend> isend(const Tensor& t, int dst, int tag = 0);

 protected:
  // Arguments are validated by the public functions before these run; size() > 1 where it
  // matters is not assumed (backends handle a world of one).
  virtual void do_all_reduce(void* buf, int64_t count, DType dt, ReduceOp op) = 0;
  virtual void do_reduce_scatter(const void* send, void* recv, std::span<const int64_t> counts,
                                 DType dt, ReduceOp op) = 0;
  virtual void do_all_gather(const void* send, void* recv, std::span<const int64_t> counts,
                             DType dt) = 0;
  virtual void do_broadcast(void* buf, int64_t count, DType dt, int root) = 0;
  virtual void do_send(const void* buf, int64_t count, DType dt, int dst, int tag) = 0;
  virtual void do_recv(void* buf, int64_t count, DType dt, int src, int tag) = 0;
  // Default: a blocking do_send and a finished handle.
  virtual std::unique_ptr<PendingSend> do_isend(const void* buf, int64_t count, DType dt, int dst, int tag);
  virtual void do_sendrecv(const void* send_buf, int64_t send_count, int dst, void* recv_buf,
                           int64_t recv_count, int src, DType dt, int tag) = 0;
  virtual void do_barrier() = 0;
  virtual std::unique_ptr<Comm> do_split(int color, int key) = 0;

  CommOptions opts_;
};

}  // namespace loom::comm
