#include "comm/comm.h"

#include <vector>

#include "core/error.h"

namespace loom::comm {

std::string_view reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return "sum";
    case ReduceOp::max: return "max";
  }
  return "?";
}

Range chunk_range(int64_t count, int n, int i) {
  LOOM_CHECK(n > 0 && i >= 0 && i < n, "chunk_range: chunk {} of {}", i, n);
  LOOM_CHECK(count >= 0, "chunk_range: negative count {}", count);
  int64_t base = count / n, rem = count % n;
  int64_t begin = i * base + std::min<int64_t>(i, rem);
  return {begin, begin + base + (i < rem ? 1 : 0)};
}

namespace {

void check_count(std::string_view call, int64_t count) {
  LOOM_CHECK(count >= 0, "{}: negative element count {}", call, count);
}

void check_reducible(std::string_view call, DType dt) {
  LOOM_CHECK(dt == DType::f32 || dt == DType::bf16,
             "{}: reductions support f32 and bf16, got {}", call, dtype_name(dt));
}

void check_ptr(std::string_view call, std::string_view what, const void* p, int64_t count) {
  LOOM_CHECK(count == 0 || p != nullptr, "{}: {} is null for {} elements", call, what, count);
}

void check_peer(std::string_view call, std::string_view what, int peer, int size) {
  LOOM_CHECK(peer >= 0 && peer < size, "{}: {} {} is not a rank of this communicator of {}", call,
             what, peer, size);
}

void check_tag(std::string_view call, int tag) {
  LOOM_CHECK(tag >= 0 && tag <= kMaxTag, "{}: tag {} outside [0, {}]", call, tag, kMaxTag);
}

int64_t check_counts(std::string_view call, std::span<const int64_t> counts, int size) {
  LOOM_CHECK(int64_t(counts.size()) == size, "{}: {} counts given for a communicator of {} ranks",
             call, counts.size(), size);
  int64_t total = 0;
  for (size_t i = 0; i < counts.size(); ++i) {
    LOOM_CHECK(counts[i] >= 0, "{}: counts[{}] is negative ({})", call, i, counts[i]);
    total += counts[i];
  }
  return total;
}

std::vector<int64_t> equal_counts(std::string_view call, int64_t count, int size) {
  check_count(call, count);
  LOOM_CHECK(count % size == 0,
             "{}: count {} is not divisible by the {} ranks of the communicator (use the _v "
             "form with explicit counts)",
             call, count, size);
  return std::vector<int64_t>(size_t(size), count / size);
}

void check_cpu(std::string_view call, const Tensor& t) {
  LOOM_CHECK(t.defined(), "{}: undefined tensor", call);
  LOOM_CHECK(t.device() == Device::cpu, "{}: tensor {} is not on the CPU (this backend moves host memory)",
             call, t.str());
}

}  // namespace

void Comm::all_reduce(void* buf, int64_t count, DType dt, ReduceOp op) {
  check_count("all_reduce", count);
  check_reducible("all_reduce", dt);
  check_ptr("all_reduce", "buffer", buf, count);
  do_all_reduce(buf, count, dt, op);
}

void Comm::reduce_scatter(const void* send, void* recv, int64_t count, DType dt, ReduceOp op) {
  auto counts = equal_counts("reduce_scatter", count, size());
  reduce_scatter_v(send, recv, counts, dt, op);
}

void Comm::reduce_scatter_v(const void* send, void* recv, std::span<const int64_t> counts, DType dt,
                            ReduceOp op) {
  int64_t total = check_counts("reduce_scatter", counts, size());
  check_reducible("reduce_scatter", dt);
  check_ptr("reduce_scatter", "send buffer", send, total);
  check_ptr("reduce_scatter", "receive buffer", recv, counts[size_t(rank())]);
  do_reduce_scatter(send, recv, counts, dt, op);
}

void Comm::all_gather(const void* send, void* recv, int64_t count, DType dt) {
  auto counts = equal_counts("all_gather", count, size());
  all_gather_v(send, recv, counts, dt);
}

void Comm::all_gather_v(const void* send, void* recv, std::span<const int64_t> counts, DType dt) {
  int64_t total = check_counts("all_gather", counts, size());
  check_ptr("all_gather", "send buffer", send, counts[size_t(rank())]);
  check_ptr("all_gather", "receive buffer", recv, total);
  do_all_gather(send, recv, counts, dt);
}

void Comm::broadcast(void* buf, int64_t count, DType dt, int root) {
  check_count("broadcast", count);
  check_peer("broadcast", "root", root, size());
  check_ptr("broadcast", "buffer", buf, count);
  do_broadcast(buf, count, dt, root);
}

void Comm::send(const void* buf, int64_t count, DType dt, int dst, int tag) {
  check_count("send", count);
  check_peer("send", "destination", dst, size());
  check_tag("send", tag);
  check_ptr("send", "buffer", buf, count);
  LOOM_CHECK(dst != rank(), "send: rank {} sends to itself, which would never complete (use sendrecv)",
             rank());
  do_send(buf, count, dt, dst, tag);
}

std::unique_ptr<PendingSend> Comm::isend(const void* buf, int64_t count, DType dt, int dst, int tag) {
  check_count("isend", count);
  check_peer("isend", "destination", dst, size());
  check_tag("isend", tag);
  check_ptr("isend", "buffer", buf, count);
  LOOM_CHECK(dst != rank(), "isend: rank {} sends to itself (use sendrecv)", rank());
  return do_isend(buf, count, dt, dst, tag);
}

namespace {
struct FinishedSend final : PendingSend {
  void wait() override {}
  bool done() override { return true; }
};
}  // namespace

std::unique_ptr<PendingSend> Comm::do_isend(const void* buf, int64_t count, DType dt, int dst, int tag) {
  do_send(buf, count, dt, dst, tag);
  return std::make_unique<FinishedSend>();
}

void Comm::recv(void* buf, int64_t count, DType dt, int src, int tag) {
  check_count("recv", count);
  check_peer("recv", "source", src, size());
  check_tag("recv", tag);
  check_ptr("recv", "buffer", buf, count);
  LOOM_CHECK(src != rank(), "recv: rank {} receives from itself, which would never complete (use sendrecv)",
             rank());
  do_recv(buf, count, dt, src, tag);
}

void Comm::sendrecv(const void* send_buf, int64_t send_count, int dst, void* recv_buf,
                    int64_t recv_count, int src, DType dt, int tag) {
  check_count("sendrecv", send_count);
  check_count("sendrecv", recv_count);
  check_peer("sendrecv", "destination", dst, size());
  check_peer("sendrecv", "source", src, size());
  check_tag("sendrecv", tag);
  check_ptr("sendrecv", "send buffer", send_buf, send_count);
  check_ptr("sendrecv", "receive buffer", recv_buf, recv_count);
  do_sendrecv(send_buf, send_count, dst, recv_buf, recv_count, src, dt, tag);
}

void Comm::barrier() { do_barrier(); }

std::unique_ptr<Comm> Comm::split(int color, int key) { return do_split(color, key); }

void Comm::all_reduce(const Tensor& t, ReduceOp op) {
  check_cpu("all_reduce", t);
  all_reduce(t.raw(), t.numel(), t.dtype(), op);
}

void Comm::reduce_scatter(const Tensor& in, const Tensor& out, ReduceOp op) {
  check_cpu("reduce_scatter", in);
  check_cpu("reduce_scatter", out);
  LOOM_CHECK(in.dtype() == out.dtype(), "reduce_scatter: input {} and output {} differ in dtype",
             in.str(), out.str());
  LOOM_CHECK(out.numel() * size() == in.numel(),
             "reduce_scatter: output {} must hold 1/{} of input {}", out.str(), size(), in.str());
  reduce_scatter(in.raw(), out.raw(), in.numel(), in.dtype(), op);
}

void Comm::all_gather(const Tensor& in, const Tensor& out) {
  check_cpu("all_gather", in);
  check_cpu("all_gather", out);
  LOOM_CHECK(in.dtype() == out.dtype(), "all_gather: input {} and output {} differ in dtype",
             in.str(), out.str());
  LOOM_CHECK(in.numel() * size() == out.numel(),
             "all_gather: output {} must hold {} times input {}", out.str(), size(), in.str());
  all_gather(in.raw(), out.raw(), out.numel(), in.dtype());
}

void Comm::broadcast(const Tensor& t, int root) {
  check_cpu("broadcast", t);
  broadcast(t.raw(), t.numel(), t.dtype(), root);
}

void Comm::send(const Tensor& t, int dst, int tag) {
  check_cpu("send", t);
  send(t.raw(), t.numel(), t.dtype(), dst, tag);
}

std::unique_ptr<PendingSend> Comm::isend(const Tensor& t, int dst, int tag) {
  check_cpu("isend", t);
  return isend(t.raw(), t.numel(), t.dtype(), dst, tag);
}

void Comm::recv(const Tensor& t, int src, int tag) {
  check_cpu("recv", t);
  recv(t.raw(), t.numel(), t.dtype(), src, tag);
}

}  // namespace loom::comm
