#include "parallel/context/ring_attention.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "core/error.h"
#include "kernels/cpu/attention.h"

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

RingAttention::RingAttention(MemoryPool& pool, cpu::AttnWorkspace* attn) : pool_(pool), attn_(attn) {
  if (!attn_) {
    own_attn_ = std::make_unique<cpu::AttnWorkspace>(pool);
    attn_ = own_attn_.get();
  }
}

void RingAttention::ensure(const RingShape& s, int P, bool backward) {
  const int64_t C = s.NH * s.HS, Ck = s.kv_heads() * s.HS, Tl = s.T / P, Tc = Tl / 2;
  const Shape kv{s.B, Tl, 2 * Ck};
  for (Tensor& t : kv_)
    if (!t.defined() || t.shape() != kv) t = Tensor::empty(kv, DType::f32, MemTag::comm, pool_);
  if (backward) {
    for (Tensor& t : dkv_)
      if (!t.defined() || t.shape() != kv) t = Tensor::empty(kv, DType::f32, MemTag::comm, pool_);
  } else {
    if (!o_part_.defined() || o_part_.shape() != Shape{s.B, Tc, C})
      o_part_ = Tensor::empty({s.B, Tc, C}, DType::f32, MemTag::workspace, pool_);
    if (!lse_part_.defined() || lse_part_.shape() != Shape{s.B, s.NH, Tc})
      lse_part_ = Tensor::empty({s.B, s.NH, Tc}, DType::f32, MemTag::workspace, pool_);
  }
}

namespace {

// o f32 [Tc, C] (row stride C), l f32 [NH, Tc] absorb the partial result (op, lp) of more keys:
// out = (out e^l + op e^lp) / (e^l + e^lp), l = log(e^l + e^lp).
void merge(float* o, float* l, const float* op, const float* lp, int64_t Tc, int64_t NH, int64_t HS) {
  const int64_t C = NH * HS;
  for (int64_t h = 0; h < NH; ++h)
    for (int64_t t = 0; t < Tc; ++t) {
      const double lb = lp[h * Tc + t];
      if (std::isinf(lb) && lb < 0) continue;  // no visible key in this block
      const double la = l[h * Tc + t];
      float* od = o + t * C + h * HS;
      const float* pd = op + t * C + h * HS;
      if (std::isinf(la) && la < 0) {
        std::memcpy(od, pd, size_t(HS) * sizeof(float));
        l[h * Tc + t] = float(lb);
        continue;
      }
      const double m = std::max(la, lb), wa = std::exp(la - m), wb = std::exp(lb - m), sum = wa + wb;
      const double ca = wa / sum, cb = wb / sum;
      for (int64_t d = 0; d < HS; ++d) od[d] = float(ca * double(od[d]) + cb * double(pd[d]));
      l[h * Tc + t] = float(m + std::log(sum));
    }
}

// One chunk pair's call over every batch row: query chunk cq of each row's Tl local positions
// against key chunk ck (positions do not change the scratch size). The batch strides step from
// one row's chunk to the next row's: Tl rows of qkv, of the key/value block and of out, and the
// two chunks' log-sum-exps of lse [B, 2, NH, Tc].
cpu::AttnArgs chunk_args(const RingShape& s, int64_t Tc, int64_t cq, int64_t ck) {
  cpu::AttnArgs a;
  a.B = s.B;
  a.q_batch = 2 * Tc * s.row();
  a.kv_batch = 2 * Tc * 2 * s.kv_heads() * s.HS;
  a.o_batch = 2 * Tc * s.NH * s.HS;
  a.lse_batch = 2 * s.NH * Tc;
  a.NH = s.NH;
  a.HS = s.HS;
  a.Tq = a.Tkv = Tc;
  a.NKV = s.kv_heads();
  a.q_stride = s.row();
  a.kv_stride = 2 * s.kv_heads() * s.HS;
  a.o_stride = s.NH * s.HS;
  a.q_pos0 = cq * Tc;
  a.kv_pos0 = ck * Tc;
  return a;
}

constexpr int kTagKV = 101, kTagDKV = 102;

}  // namespace

int64_t RingAttention::workspace_bytes(const RingShape& s, int P, int threads) {
  check_sequence(s.T, P, "ring attention");
  const cpu::AttnArgs a = chunk_args(s, s.T / P / 2, 0, 0);
  return cpu::attention_training_workspace_bytes(a, threads);
}

void RingAttention::forward(comm::Comm& g, float* out, float* lse, const float* qkv, const RingShape& s) {
  const int P = g.size(), r = g.rank();
  check_sequence(s.T, P, "ring attention");
  LOOM_CHECK(P > 1, "ring attention needs a cp group of two or more ranks");
  const int64_t C = s.NH * s.HS, Ck = s.kv_heads() * s.HS, Q = s.row(), Tl = s.T / P, Tc = Tl / 2, rows = s.B * Tl;
  ensure(s, P, false);
  attn_->reserve(workspace_bytes(s, P, omp_get_max_threads()));
  float* kv0 = kv_[0].f32();
  for (int64_t n = 0; n < rows; ++n) std::memcpy(kv0 + n * 2 * Ck, qkv + n * Q + C, size_t(2 * Ck) * sizeof(float));
  int cur = 0;
  for (int j = 0; j < P; ++j) {
    const int src = (r - j + P) % P;
    const float* kv = kv_[cur].f32();
    for (int hq = 0; hq < 2; ++hq) {
      const int64_t cq = chunk_of(P, r, hq);
      for (int hk = 0; hk < 2; ++hk) {
        const int64_t ck = chunk_of(P, src, hk);
        if (ck > cq) continue;  // every key is in the future of every query
        const bool first = j == 0 && hk == 0;
        cpu::AttnArgs a = attn_->args(chunk_args(s, Tc, cq, ck));
        const float* q = qkv + hq * Tc * Q;
        const float* k = kv + hk * Tc * 2 * Ck;
        float* o = out + hq * Tc * C;
        float* l = lse + hq * s.NH * Tc;
        if (first) {
          cpu::attention_forward(o, l, q, k, k + Ck, a);
        } else {
          a.o_batch = a.lse_batch = 0;  // the partial result, packed [B, Tc, C] and [B, NH, Tc]
          cpu::attention_forward(o_part_.f32(), lse_part_.f32(), q, k, k + Ck, a);
          for (int64_t b = 0; b < s.B; ++b)
            merge(o + b * Tl * C, l + b * 2 * s.NH * Tc, o_part_.f32() + b * Tc * C, lse_part_.f32() + b * s.NH * Tc, Tc,
                  s.NH, s.HS);
        }
      }
    }
    if (j + 1 < P) {
      g.sendrecv(kv_[cur].f32(), rows * 2 * Ck, (r + 1) % P, kv_[1 - cur].f32(), rows * 2 * Ck, (r - 1 + P) % P,
                 DType::f32, kTagKV);
      cur = 1 - cur;
    }
  }
}

void RingAttention::backward(comm::Comm& g, float* dqkv, const float* dout, const float* qkv, const float* out,
                             const float* lse, const RingShape& s) {
  const int P = g.size(), r = g.rank();
  check_sequence(s.T, P, "ring attention");
  LOOM_CHECK(P > 1, "ring attention needs a cp group of two or more ranks");
  const int64_t C = s.NH * s.HS, Ck = s.kv_heads() * s.HS, Q = s.row(), Tl = s.T / P, Tc = Tl / 2, rows = s.B * Tl;
  ensure(s, P, true);
  attn_->reserve(workspace_bytes(s, P, omp_get_max_threads()));
  float* kv0 = kv_[0].f32();
  for (int64_t n = 0; n < rows; ++n) {
    std::memcpy(kv0 + n * 2 * Ck, qkv + n * Q + C, size_t(2 * Ck) * sizeof(float));
    std::memset(dqkv + n * Q, 0, size_t(C) * sizeof(float));  // dq accumulates over the ring
  }
  dkv_[0].zero_();
  int cur = 0;
  for (int j = 0; j < P; ++j) {
    const int src = (r - j + P) % P;
    const float* kv = kv_[cur].f32();
    float* dkv = dkv_[cur].f32();
    for (int hq = 0; hq < 2; ++hq) {
      const int64_t cq = chunk_of(P, r, hq);
      for (int hk = 0; hk < 2; ++hk) {
        const int64_t ck = chunk_of(P, src, hk);
        if (ck > cq) continue;
        const cpu::AttnArgs a = attn_->args(chunk_args(s, Tc, cq, ck));
        const int64_t qo = hq * Tc, ko = hk * Tc;
        const float* k = kv + ko * 2 * Ck;
        float* dk = dkv + ko * 2 * Ck;
        cpu::attention_backward(dqkv + qo * Q, dk, dk + Ck, dout + qo * C, qkv + qo * Q, k, k + Ck, out + qo * C,
                                lse + hq * s.NH * Tc, a, /*accumulate=*/true);
      }
    }
    // The block and its gradient move on; after the last step the gradient goes home.
    const int nxt = (r + 1) % P, prv = (r - 1 + P) % P;
    if (j + 1 < P)
      g.sendrecv(kv_[cur].f32(), rows * 2 * Ck, nxt, kv_[1 - cur].f32(), rows * 2 * Ck, prv, DType::f32, kTagKV);
    g.sendrecv(dkv_[cur].f32(), rows * 2 * Ck, nxt, dkv_[1 - cur].f32(), rows * 2 * Ck, prv, DType::f32, kTagDKV);
    cur = 1 - cur;
  }
  const float* dkv = dkv_[cur].f32();
  for (int64_t n = 0; n < rows; ++n)
    std::memcpy(dqkv + n * Q + C, dkv + n * 2 * Ck, size_t(2 * Ck) * sizeof(float));
}

int64_t RingAttention::buffer_bytes() const {
  int64_t n = 0;
  for (const Tensor* t : {&kv_[0], &kv_[1], &dkv_[0], &dkv_[1], &o_part_, &lse_part_})
    if (t->defined()) n += int64_t(t->nbytes());
  return n + (own_attn_ ? own_attn_->bytes() : 0);
}

void RingAttention::release() {
  kv_[0] = kv_[1] = dkv_[0] = dkv_[1] = o_part_ = lse_part_ = Tensor();
  if (own_attn_) own_attn_->release();
}

}  // namespace loom::parallel::cp
