#include "parallel/context/ring_attention.h"

#include <type_traits>

#include "core/error.h"

namespace loom::parallel::cp {

namespace {
// Chunk index (of 2 cp) of the rank's local half h (0: early, 1: late).
int64_t chunk_of(int size, int rank, int h) { return h == 0 ? rank : 2 * size - 1 - rank; }
}  // namespace

void check_sequence(int64_t T, int size, const char* where) {
  if (size > 1 && (T <= 0 || T % (2 * int64_t(size)) != 0))
    throw Error(fmt::format("{}: sequence length {} must be a positive multiple of 2 * cp = {} for context "
                            "parallelism (two load-balanced chunks per rank)",
                            where, T, 2 * size));
}

int64_t global_position(int64_t t, int64_t T, int size, int rank) {
  if (size == 1) return t;
  const int64_t Tc = T / (2 * size);
  const int h = t < Tc ? 0 : 1;
  return chunk_of(size, rank, h) * Tc + (t - h * Tc);
}

void slice_sequence(const int32_t* full, int32_t* local, int64_t B, int64_t T, int size, int rank) {
  check_sequence(T, size, "context parallel");
  const int64_t Tl = T / size;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < Tl; ++t) local[b * Tl + t] = full[b * T + global_position(t, T, size, rank)];
}

RingAttention::RingAttention(Backend& be) : be_(be), dt_(be.compute_dtype()) {}

AttnShape RingAttention::chunk_shape(const RingShape& s, int P, bool causal) {
  const int64_t C = s.NH * s.HS, Tc = s.T / P / 2;
  return {.B = s.B, .NH = s.NH, .HS = s.HS, .Tq = Tc, .Tkv = Tc, .q_stride = C, .kv_stride = 2 * s.kv_heads() * s.HS,
          .o_stride = C, .causal = causal, .NKV = s.kv_heads()};
}

RingAttention::Buffers RingAttention::buffer_bytes(const RingShape& s, int P, DType dtype) {
  const int64_t C = s.NH * s.HS, Ck = s.kv_heads() * s.HS, Tl = s.T / P, Tc = Tl / 2, e = int64_t(dtype_size(dtype));
  Buffers b;
  b.comm = 2 * s.B * Tl * 2 * Ck * (e + 4);                  // key/value blocks and their f32 gradients, double-buffered
  b.workspace = e * (4 * s.B * Tc * C + s.B * Tc * 2 * Ck);  // q, partial out / dout, out, dq chunks; a pair's dk | dv
  b.workspace += 4 * s.B * s.NH * Tc;                        // a chunk's log-sum-exps
  if (dtype != DType::f32) b.workspace += 4 * s.B * Tl * C;  // the f32 running output / dq sum
  return b;
}

void RingAttention::ensure(const RingShape& s, int P, bool backward) {
  const int64_t C = s.NH * s.HS, Ck = s.kv_heads() * s.HS, Tl = s.T / P, Tc = Tl / 2;
  auto need = [&](Tensor& t, const Shape& shape, DType dtype, MemTag tag) {
    if (!t.defined() || t.shape() != shape || t.dtype() != dtype) t = Tensor::empty(shape, dtype, tag, be_.pool());
  };
  for (Tensor& t : kv_) need(t, {2, s.B, Tc, 2 * Ck}, dt_, MemTag::comm);
  need(q_, {s.B, Tc, C}, dt_, MemTag::workspace);
  need(a_, {s.B, Tc, C}, dt_, MemTag::workspace);
  if (backward) {
    for (Tensor& t : dkv_) need(t, {2, s.B, Tc, 2 * Ck}, DType::f32, MemTag::comm);
    need(b_, {s.B, Tc, C}, dt_, MemTag::workspace);
    need(dq_, {s.B, Tc, C}, dt_, MemTag::workspace);
    need(dkvp_, {s.B, Tc, 2 * Ck}, dt_, MemTag::workspace);
  }
  need(lse_, {s.B, s.NH, Tc}, DType::f32, MemTag::workspace);
  if (dt_ != DType::f32) need(acc_, {s.B, Tl, C}, DType::f32, MemTag::workspace);
}

namespace {

constexpr int kTagKV = 101, kTagDKV = 102;

// p advanced by n elements of dtype.
template <class P>
P* at(P* p, int64_t n, DType dtype) {
  using Byte = std::conditional_t<std::is_const_v<P>, const char, char>;
  return reinterpret_cast<P*>(reinterpret_cast<Byte*>(p) + n * int64_t(dtype_size(dtype)));
}

// Checks shared by both passes; the chunk pairs' shapes prepared on the backend.
void start(Backend& be, DType dt, comm::Comm& g, const RingShape& s) {
  const int P = g.size();
  check_sequence(s.T, P, "ring attention");
  LOOM_CHECK(P > 1, "ring attention needs a cp group of two or more ranks");
  LOOM_CHECK(be.device() == Device::cpu || g.device_buffers(),
             "ring attention on the {} backend needs a communicator that takes its memory, got the {} backend's",
             be.name(), g.backend());
  for (bool causal : {true, false}) {
    const AttnShape a = RingAttention::chunk_shape(s, P, causal);
    if (be.attention_probs_bytes(dt, a) > 0)
      throw Error(fmt::format("ring attention (context parallelism) on the {} backend needs an attention kernel that "
                              "keeps no probabilities, and it runs '{}' for head size {} (CUDA: flash or cudnn, head "
                              "sizes 64 and 128)",
                              be.name(), attn_kernel_name(be.attention_kernel(a)), s.HS));
    be.prepare_attention(dt, a);
  }
}

}  // namespace

// The key/value columns of qkv into the block in hand, chunk-major.
void RingAttention::pack_kv(const void* qkv, const RingShape& s, int P) {
  const int64_t C = s.NH * s.HS, Ck = s.kv_heads() * s.HS, Q = s.row(), Tl = s.T / P, Tc = Tl / 2;
  for (int h = 0; h < 2; ++h)
    be_.copy_strided({.dst = at(kv_[0].raw(), h * s.B * Tc * 2 * Ck, dt_), .dst_dtype = dt_,
                      .src = at(qkv, h * Tc * Q + C, dt_), .src_dtype = dt_, .batches = s.B, .rows = Tc,
                      .cols = 2 * Ck, .dst_row = 2 * Ck, .dst_batch = Tc * 2 * Ck, .src_row = Q, .src_batch = Tl * Q});
}

void RingAttention::forward(comm::Comm& g, void* out, float* lse, const void* qkv, const RingShape& s) {
  const int P = g.size(), r = g.rank();
  start(be_, dt_, g, s);
  const int64_t C = s.NH * s.HS, Ck = s.kv_heads() * s.HS, Q = s.row(), Tl = s.T / P, Tc = Tl / 2;
  const int64_t block = s.B * Tl * 2 * Ck;
  const AttnShape diag = chunk_shape(s, P, true), full = chunk_shape(s, P, false);
  ensure(s, P, false);
  pack_kv(qkv, s, P);
  float* acc = dt_ == DType::f32 ? static_cast<float*>(out) : acc_.f32();
  int cur = 0;
  for (int j = 0; j < P; ++j) {
    const int src = (r - j + P) % P;
    for (int hq = 0; hq < 2; ++hq) {
      const int64_t cq = chunk_of(P, r, hq);
      bool packed = false;
      for (int hk = 0; hk < 2; ++hk) {
        const int64_t ck = chunk_of(P, src, hk);
        if (ck > cq) continue;  // every key is in the future of every query
        if (!packed) {
          be_.copy_strided({.dst = q_.raw(), .dst_dtype = dt_, .src = at(qkv, hq * Tc * Q, dt_), .src_dtype = dt_,
                            .batches = s.B, .rows = Tc, .cols = C, .dst_row = C, .dst_batch = Tc * C, .src_row = Q,
                            .src_batch = Tl * Q});
          packed = true;
        }
        const void* k = at(kv_[cur].raw(), hk * s.B * Tc * 2 * Ck, dt_);
        be_.attention_forward({.dtype = dt_, .shape = ck == cq ? diag : full, .out = a_.raw(), .lse = lse_.f32(),
                               .q = q_.raw(), .k = k, .v = at(k, Ck, dt_)});
        be_.attention_merge({.dtype = dt_, .out = acc + hq * Tc * C, .lse = lse + hq * s.B * s.NH * Tc,
                             .part = a_.raw(), .part_lse = lse_.f32(), .B = s.B, .NH = s.NH, .HS = s.HS, .Tq = Tc,
                             .o_row = C, .o_batch = Tl * C, .lse_batch = s.NH * Tc, .init = j == 0 && hk == 0});
      }
    }
    if (j + 1 < P) {
      g.sendrecv(kv_[cur].raw(), block, (r + 1) % P, kv_[1 - cur].raw(), block, (r - 1 + P) % P, dt_, kTagKV);
      cur = 1 - cur;
    }
  }
  if (dt_ != DType::f32)
    be_.copy({.dst = out, .dst_dtype = dt_, .src = acc, .src_dtype = DType::f32, .n = s.B * Tl * C});
}

void RingAttention::backward(comm::Comm& g, void* dqkv, const void* dout, const void* qkv, const void* out,
                             const float* lse, const RingShape& s) {
  const int P = g.size(), r = g.rank();
  start(be_, dt_, g, s);
  const int64_t C = s.NH * s.HS, Ck = s.kv_heads() * s.HS, Q = s.row(), Tl = s.T / P, Tc = Tl / 2;
  const int64_t block = s.B * Tl * 2 * Ck;
  const AttnShape diag = chunk_shape(s, P, true), full = chunk_shape(s, P, false);
  ensure(s, P, true);
  pack_kv(qkv, s, P);
  be_.fill_zero(dkv_[0].raw(), int64_t(dkv_[0].nbytes()));
  // dq's sum: in dqkv's q columns itself (f32), or in f32 beside it.
  const bool direct = dt_ == DType::f32;
  float* dq_sum = direct ? static_cast<float*>(dqkv) : acc_.f32();
  const int64_t dq_row = direct ? Q : C;
  // One chunk of every batch row of a [B, Tl, width] tensor into a packed [B, Tc, cols] one.
  auto pack = [&](void* dst, const void* src, int64_t width, int64_t h, int64_t cols) {
    be_.copy_strided({.dst = dst, .dst_dtype = dt_, .src = at(src, h * Tc * width, dt_), .src_dtype = dt_,
                      .batches = s.B, .rows = Tc, .cols = cols, .dst_row = cols, .dst_batch = Tc * cols,
                      .src_row = width, .src_batch = Tl * width});
  };
  int cur = 0;
  for (int j = 0; j < P; ++j) {
    const int src = (r - j + P) % P;
    for (int hq = 0; hq < 2; ++hq) {
      const int64_t cq = chunk_of(P, r, hq);
      bool packed = false;
      for (int hk = 0; hk < 2; ++hk) {
        const int64_t ck = chunk_of(P, src, hk);
        if (ck > cq) continue;
        if (!packed) {
          pack(q_.raw(), qkv, Q, hq, C);
          pack(a_.raw(), dout, C, hq, C);
          pack(b_.raw(), out, C, hq, C);
          // The chunk's log-sum-exps too, so that every operand starts at the pool's alignment.
          be_.copy({.dst = lse_.f32(), .src = lse + hq * s.B * s.NH * Tc, .n = s.B * s.NH * Tc});
          packed = true;
        }
        const void* k = at(kv_[cur].raw(), hk * s.B * Tc * 2 * Ck, dt_);
        be_.attention_backward({.dtype = dt_, .shape = ck == cq ? diag : full, .dq = dq_.raw(), .dk = dkvp_.raw(),
                                .dv = at(dkvp_.raw(), Ck, dt_), .dout = a_.raw(), .q = q_.raw(), .k = k,
                                .v = at(k, Ck, dt_), .out = b_.raw(), .lse = lse_.f32()});
        be_.copy_strided({.dst = dq_sum + hq * Tc * dq_row, .dst_dtype = DType::f32, .src = dq_.raw(),
                          .src_dtype = dt_, .batches = s.B, .rows = Tc, .cols = C, .dst_row = dq_row,
                          .dst_batch = Tl * dq_row, .src_row = C, .src_batch = Tc * C,
                          .accumulate = !(j == 0 && hk == 0)});
        be_.copy_strided({.dst = dkv_[cur].f32() + hk * s.B * Tc * 2 * Ck, .dst_dtype = DType::f32,
                          .src = dkvp_.raw(), .src_dtype = dt_, .cols = s.B * Tc * 2 * Ck, .accumulate = true});
      }
    }
    // The block and its gradient move on; after the last step the gradient goes home.
    const int nxt = (r + 1) % P, prv = (r - 1 + P) % P;
    if (j + 1 < P) g.sendrecv(kv_[cur].raw(), block, nxt, kv_[1 - cur].raw(), block, prv, dt_, kTagKV);
    g.sendrecv(dkv_[cur].raw(), block, nxt, dkv_[1 - cur].raw(), block, prv, DType::f32, kTagDKV);
    cur = 1 - cur;
  }
  for (int h = 0; h < 2; ++h)
    be_.copy_strided({.dst = at(dqkv, h * Tc * Q + C, dt_), .dst_dtype = dt_,
                      .src = dkv_[cur].f32() + h * s.B * Tc * 2 * Ck, .src_dtype = DType::f32, .batches = s.B,
                      .rows = Tc, .cols = 2 * Ck, .dst_row = Q, .dst_batch = Tl * Q, .src_row = 2 * Ck,
                      .src_batch = Tc * 2 * Ck});
  if (!direct)
    be_.copy_strided({.dst = dqkv, .dst_dtype = dt_, .src = dq_sum, .src_dtype = DType::f32, .rows = s.B * Tl,
                      .cols = C, .dst_row = Q, .src_row = C});
}

int64_t RingAttention::held_bytes() const {
  int64_t n = 0;
  for (const Tensor* t : {&kv_[0], &kv_[1], &dkv_[0], &dkv_[1], &q_, &a_, &b_, &dq_, &dkvp_, &lse_, &acc_})
    if (t->defined()) n += int64_t(t->nbytes());
  return n;
}

void RingAttention::release() {
  for (Tensor* t : {&kv_[0], &kv_[1], &dkv_[0], &dkv_[1], &q_, &a_, &b_, &dq_, &dkvp_, &lse_, &acc_}) *t = Tensor();
}

}  // namespace loom::parallel::cp
