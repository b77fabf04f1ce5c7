// A communicator that forwards to another and counts what this rank would put on the wire with
// bandwidth-optimal ring algorithms, so a layout's traffic can be compared with the analytic
// formulas (bench, tests) independently of the backend underneath:
//
//   all_reduce of n bytes over p ranks      2 (p-1)/p n
//   reduce_scatter / all_gather of n bytes  (p-1)/p n  (n: the full buffer)
//   broadcast of n bytes                    n          (root: p-1 ... counted as n per rank)
//   send / sendrecv                         the bytes sent
//
// Counts are per rank (this handle) and cumulative; reset() starts over. A communicator split
// from this one counts into this one's counts (it must not outlive this one).
#pragma once
#include <cstdint>
#include <memory>
#include <mutex>

#include "comm/comm.h"

namespace loom::parallel {

struct CommCounts {
  double wire_bytes = 0;      // as above
  int64_t payload_bytes = 0;  // the buffers passed in (the full buffer of each collective)
  int64_t calls = 0;
};

class CountingComm final : public comm::Comm {
 public:
  // `inner` must outlive this object.
  explicit CountingComm(comm::Comm& inner);
  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  std::string_view backend() const override { return inner_.backend(); }
  int world_rank() const override { return inner_.world_rank(); }

  const CommCounts& counts() const { return counts_; }
  void reset() { counts_ = {}; }

 protected:
  void do_all_reduce(void* buf, int64_t count, DType dt, comm::ReduceOp op) override;
  void do_reduce_scatter(const void* send, void* recv, std::span<const int64_t> counts, DType dt,
                         comm::ReduceOp op) override;
  void do_all_gather(const void* send, void* recv, std::span<const int64_t> counts, DType dt) override;
  void do_broadcast(void* buf, int64_t count, DType dt, int root) override;
  void do_send(const void* buf, int64_t count, DType dt, int dst, int tag) override;
  void do_recv(void* buf, int64_t count, DType dt, int src, int tag) override;
  void do_sendrecv(const void* send_buf, int64_t send_count, int dst, void* recv_buf, int64_t recv_count,
                   int src, DType dt, int tag) override;
  void do_barrier() override;
  std::unique_ptr<comm::Comm> do_split(int color, int key) override;

 private:
  void add(double wire, int64_t payload);
  comm::Comm& inner_;
  std::unique_ptr<comm::Comm> owned_;  // a split's communicator, when this wraps one
  CountingComm* parent_ = nullptr;     // a split counts into the communicator it was split from
  std::mutex mu_;                      // counts_ (a split may add from its own thread)
  CommCounts counts_;
};

}  // namespace loom::parallel
