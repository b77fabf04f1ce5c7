#include "parallel/tensor/counting_comm.h"

#include <numeric>

namespace loom::parallel {

CountingComm::CountingComm(comm::Comm& inner) : comm::Comm(inner.options()), inner_(inner) {}

void CountingComm::add(double wire, int64_t payload) {
  if (parent_) return parent_->add(wire, payload);
  std::lock_guard<std::mutex> lk(mu_);  // (a split may count from another thread)
  counts_.wire_bytes += wire;
  counts_.payload_bytes += payload;
  counts_.calls += 1;
}

void CountingComm::do_all_reduce(void* buf, int64_t count, DType dt, comm::ReduceOp op) {
  const double p = size(), n = double(count * int64_t(dtype_size(dt)));
  add(2.0 * (p - 1) / p * n, count * int64_t(dtype_size(dt)));
  inner_.all_reduce(buf, count, dt, op);
}

void CountingComm::do_reduce_scatter(const void* send, void* recv, std::span<const int64_t> counts, DType dt,
                                     comm::ReduceOp op) {
  const int64_t total = std::accumulate(counts.begin(), counts.end(), int64_t(0)) * int64_t(dtype_size(dt));
  const double p = size();
  add((p - 1) / p * double(total), total);
  inner_.reduce_scatter_v(send, recv, counts, dt, op);
}

void CountingComm::do_all_gather(const void* send, void* recv, std::span<const int64_t> counts, DType dt) {
  const int64_t total = std::accumulate(counts.begin(), counts.end(), int64_t(0)) * int64_t(dtype_size(dt));
  const double p = size();
  add((p - 1) / p * double(total), total);
  inner_.all_gather_v(send, recv, counts, dt);
}

void CountingComm::do_broadcast(void* buf, int64_t count, DType dt, int root) {
  const int64_t n = count * int64_t(dtype_size(dt));
  add(size() > 1 ? double(n) : 0.0, n);
  inner_.broadcast(buf, count, dt, root);
}

void CountingComm::do_send(const void* buf, int64_t count, DType dt, int dst, int tag) {
  const int64_t n = count * int64_t(dtype_size(dt));
  add(double(n), n);
  inner_.send(buf, count, dt, dst, tag);
}

void CountingComm::do_recv(void* buf, int64_t count, DType dt, int src, int tag) {
  inner_.recv(buf, count, dt, src, tag);
}

void CountingComm::do_sendrecv(const void* send_buf, int64_t send_count, int dst, void* recv_buf,
                               int64_t recv_count, int src, DType dt, int tag) {
  const int64_t n = send_count * int64_t(dtype_size(dt));
  add(dst == rank() ? 0.0 : double(n), n);
  inner_.sendrecv(send_buf, send_count, dst, recv_buf, recv_count, src, dt, tag);
}

void CountingComm::do_barrier() { inner_.barrier(); }

std::unique_ptr<comm::Comm> CountingComm::do_split(int color, int key) {
  auto sub = inner_.split(color, key);
  if (!sub) return nullptr;
  auto out = std::make_unique<CountingComm>(*sub);
  out->owned_ = std::move(sub);
  out->parent_ = this;
  return out;
}

}  // namespace loom::parallel
