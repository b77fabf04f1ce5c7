// Causal multi-head self-attention computed in tiles with an online softmax: no T x T matrix is
// kept; only the per-row log-sum-exp is saved for backward, which recomputes scores per tile.
//
// Both calls use the calling thread's OpenMP team (omp_get_max_threads() threads, fewer when there
// are fewer work units) and give bitwise the same results for any team size.
//
// Scratch memory: a call needs exactly attention_workspace_bytes(a, backward, threads) bytes. It holds
// each thread's tiles (64 queries x 64 keys) and panels of one (b, h), about 2 Tkv HS floats in
// forward and 2 to 3 Tq HS in backward; backward with fewer than 32 (b, h) pairs also holds partial
// dq sums of its key-tile groups. A caller that makes many calls keeps one AttnWorkspace (or its
// own buffer) and passes it in AttnArgs.scratch, so the calls allocate nothing; a call without
// scratch allocates it from a.pool under tag workspace, in one allocation, and frees it before
// returning: for one-off calls (glibc maps a block over 32 MiB afresh at every allocation).
#pragma once
#include <cstdint>

namespace loom {
class MemoryPool;
}

namespace loom::cpu {

// Row-strided views of Q, K, V and O: element (b, t, h, d) of X is at
// X[(b * T + t) * stride + h * HS + d] with T the sequence length of that tensor. Packed GPT-2
// qkv [B, T, 3C] is q = qkv, k = qkv + C, v = qkv + 2C with stride 3C.
// Grouped-query attention (Ainslie et al. 2023): with NKV key/value heads (NH a multiple of NKV),
// query head h reads key/value head h / (NH / NKV); K and V rows hold NKV heads.
struct AttnArgs {
  int64_t B = 0, NH = 0, HS = 0;
  int64_t NKV = 0;                  // key/value heads; 0 means NH (multi-head attention)
  int64_t Tq = 0, Tkv = 0;         // query and key/value lengths
  int64_t q_stride = 0, kv_stride = 0, o_stride = 0;
  // Elements between the first rows of consecutive batch entries of Q (and dQ), of K and V (and
  // their gradients), of O (and dO), and of lse.
  int64_t q_batch_stride() const { return Tq * q_stride; }
  int64_t kv_batch_stride() const { return Tkv * kv_stride; }
  int64_t o_batch_stride() const { return Tq * o_stride; }
  int64_t lse_batch_stride() const { return NH * Tq; }
  int64_t q_pos0 = 0, kv_pos0 = 0;  // global positions of the first query / key (causal mask:
                                    // key position > query position is masked)
  bool causal = true;
  float scale = 0;                  // 0 means 1 / sqrt(HS)
  // The call's scratch, owned by the caller: at least attention_workspace_bytes(*this, backward,
  // omp_get_max_threads()) bytes (a call given fewer throws naming both sizes), 64-byte aligned for
  // speed. Null: the call allocates its own from pool.
  float* scratch = nullptr;
  int64_t scratch_bytes = 0;
  MemoryPool* pool = nullptr;       // where a call without scratch allocates it (a cpu pool); null: default_cpu_pool()
};

// Bytes of scratch that one attention_forward (backward = false) or attention_backward
// (backward = true) call with these arguments uses when the calling thread's
// omp_get_max_threads() is `threads`; 0 for a call with nothing to compute. With
// HSp = HS rounded up to 8, units = B NH chunks in forward (chunks = clamp(ceil(4 threads / (B NH)),
// 1, query tiles)) and B NKV G in backward (a unit owns its key/value head's key tiles and runs
// the query heads that read them in order; G = 1 from 32 (b, kv head) pairs on, else
// min(ceil(32 / (B NKV)), key tiles)), and every buffer rounded up to 16 floats, it is 4 bytes times
//   forward:  min(threads, units) (64 HS + 2 Tkv HSp + 64 * 64 + 64 HSp)
//   backward: min(threads, units) (2 * 64 HS + 3 * 64 HSp + (2 + [G == 1]) Tq HSp + Tq + 2 * 64 * 64)
//             + [G > 1] G B NH Tq HSp.
int64_t attention_workspace_bytes(const AttnArgs& a, bool backward, int threads);
// The larger of the forward and backward call's: a training step's attention scratch.
int64_t attention_training_workspace_bytes(const AttnArgs& a, int threads);

// Attention scratch that a caller keeps across calls: one allocation from a pool under tag
// workspace that only grows, so calls sized up front for the largest of them allocate once.
class AttnWorkspace {
 public:
  explicit AttnWorkspace(MemoryPool& pool) : pool_(pool) {}
  ~AttnWorkspace() { release(); }
  AttnWorkspace(const AttnWorkspace&) = delete;
  AttnWorkspace& operator=(const AttnWorkspace&) = delete;

  // Holds at least `bytes` afterwards: when it holds fewer, it gives them back before taking
  // `bytes`, so the pool never holds both.
  void reserve(int64_t bytes);
  // a pointing at this workspace (AttnArgs.scratch, scratch_bytes, and pool its pool); throws when
  // nothing is reserved.
  AttnArgs args(AttnArgs a) const;
  // reserve(the bytes of this call at the calling thread's omp_get_max_threads()), then args(a).
  AttnArgs use(const AttnArgs& a, bool backward);
  void release();
  int64_t bytes() const { return bytes_; }
  MemoryPool& pool() const { return pool_; }

 private:
  MemoryPool& pool_;
  float* p_ = nullptr;
  int64_t bytes_ = 0;
};

// out (o_stride) = softmax(q k^T * scale, causal) v; lse f32 [B, NH, Tq] (natural log of the
// row's sum of exp of scaled scores; -inf for a row with no visible key).
void attention_forward(float* out, float* lse, const float* q, const float* k, const float* v,
                       const AttnArgs& a);

// Gradients dq (q_stride), dk, dv (kv_stride), written, from dout (o_stride), out and lse of the
// forward.
void attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* q, const float* k,
                        const float* v, const float* out, const float* lse, const AttnArgs& a);

}  // namespace loom::cpu
