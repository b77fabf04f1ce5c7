// The device backend: every op the model's blocks need, each taking one options struct, behind one
// interface that the CPU (kernels/cpu/backend.cpp) and the CUDA (kernels/cuda/backend.cuh)
// implementations provide, and a registry that makes one for a device.
//
// Buffers are raw pointers into the backend's memory: activations (inputs, outputs, weights as the
// ops read them) are of the op's `dtype`, which the backend must support (supports(op, dtype));
// parameter gradients, LayerNorm statistics, attention's log-sum-exp and losses are always f32.
// Everything a backend keeps between calls (library handles, workspaces, tuned algorithms, launch
// caches, planned attention graphs, its stream) belongs to the instance, never to the process: one
// instance per rank, so ranks may be threads of one process, sharing a device or not.
//
// Ops run in order on the backend's queue (the calling thread on the CPU, the instance's stream on
// CUDA); synchronize() waits for them. On CUDA the ops only enqueue work, so a sequence of them
// can be captured as a CUDA graph: run the sequence once eagerly first (its scratch, attention
// plans, BLAS handles and tuned algorithms are made then); an op that would allocate while a
// capture is under way is an error, and memory_epoch() says when captured graphs went stale.
//
// This header is also read by nvcc in C++17 mode: no C++20 here.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/dtype.h"
#include "core/memory.h"
#include "core/tensor.h"

namespace loom {

namespace comm {
class Comm;
}

enum class Op : uint8_t {
  linear, layernorm, attention, crossentropy, embedding, gelu, add, adamw, copy, sum, rmsnorm, rope, swiglu, count
};
constexpr int kNumOps = int(Op::count);
std::string_view op_name(Op op);

// out [M, N] = inp [M, K] @ weight [N, K]^T (+ bias [N]) (+ residual [M, N]); with gelu,
// out = gelu(that) (tanh form, no residual) and pre_gelu receives the value before the GELU (what
// the backward needs). The residual add is part of the GEMM where the backend can (its epilogue).
struct LinearForward {
  DType dtype = DType::f32;
  void* out = nullptr;
  void* pre_gelu = nullptr;     // with gelu: [M, N]
  const void* inp = nullptr;
  const void* weight = nullptr;
  const void* bias = nullptr;   // or null
  int64_t M = 0, K = 0, N = 0;
  bool gelu = false;
  const void* residual = nullptr;  // or null; must not alias out
};

// dinp [M, K] = dout [M, N] @ weight (+= with accumulate_dinp); dweight f32 [N, K] += dout^T @ inp;
// dbias f32 [N] += column sums of dout. Any of dinp, dweight, dbias may be null. With gelu_pre
// ([M, K], the pre-GELU value that produced inp), dinp = (dout @ weight) * gelu'(gelu_pre): the
// backward through the GELU in front of this linear layer (not with accumulate_dinp).
struct LinearBackward {
  DType dtype = DType::f32;
  void* dinp = nullptr;
  bool accumulate_dinp = false;
  float* dweight = nullptr;
  float* dbias = nullptr;
  const void* dout = nullptr;
  const void* inp = nullptr;
  const void* weight = nullptr;
  const void* gelu_pre = nullptr;
  int64_t M = 0, K = 0, N = 0;
};

// A linear layer's calls at one shape, for the scratch they keep (Backend::linear_workspace_bytes):
// the forward (with a bias or not), then the backward's input gradient (accumulated or not) and
// weight gradient (each done at once or, split, apart).
struct LinearShape {
  int64_t M = 0, K = 0, N = 0;
  bool bias = false;
  bool dinp = true, accumulate_dinp = false, dweight = true;
};

// out [N, C] = (x - mean) * rstd * weight + bias with mean, rstd f32 [N] saved (either may be null
// when no backward follows; on the CPU bias may be null too, CUDA needs it). x is inp, or, with
// residual_b set, the residual sum residual_out = inp + residual_b (rounded to dtype;
// residual_out may alias inp). With rms (Op::rmsnorm, the Llama family's RMSNorm): out = x * rstd
// * weight, rstd = 1 / sqrt(mean(x^2) + eps), no mean and no bias (both null).
struct LayerNormForward {
  DType dtype = DType::f32;
  void* out = nullptr;
  float* mean = nullptr;
  float* rstd = nullptr;
  const void* inp = nullptr;
  const void* residual_b = nullptr;
  void* residual_out = nullptr;
  const void* weight = nullptr;
  const void* bias = nullptr;
  int64_t N = 0, C = 0;
  float eps = 1e-5f;
  bool rms = false;
};

// dinp [N, C] (= or += with accumulate), dweight, dbias f32 [C] +=; inp is the LayerNorm's input
// (the residual sum when the forward had one). On the CPU dweight and dbias may be null; CUDA
// needs both. With rms, the RMSNorm's: no mean and no dbias.
struct LayerNormBackward {
  DType dtype = DType::f32;
  void* dinp = nullptr;
  bool accumulate = false;
  float* dweight = nullptr;
  float* dbias = nullptr;
  const void* dout = nullptr;
  const void* inp = nullptr;
  const void* weight = nullptr;
  const float* mean = nullptr;
  const float* rstd = nullptr;
  int64_t N = 0, C = 0;
  bool rms = false;
};

// Which attention kernels run: the backend's default (CPU: tiled; CUDA: cuDNN where loom has it
// and the shape is one it takes, else flash for head sizes 64 and 128, else GEMM), or one by name.
enum class AttnKernel : uint8_t { automatic, tiled, flash, cudnn, gemm };
std::string_view attn_kernel_name(AttnKernel k);
AttnKernel attn_kernel_from_name(std::string_view name);  // throws naming the value

// The geometry of one causal (or full) multi-head attention call: element (b, t, h, d) of X is at
// X[(b * T + t) * stride + h * HS + d] with T that tensor's sequence length. Causal mask: key
// position kv_pos0 + s is visible to query position q_pos0 + t iff kv_pos0 + s <= q_pos0 + t.
struct AttnShape {
  int64_t B = 0, NH = 0, HS = 0;
  int64_t Tq = 0, Tkv = 0;
  int64_t q_stride = 0, kv_stride = 0, o_stride = 0;
  int64_t q_pos0 = 0, kv_pos0 = 0;
  bool causal = true;
  float scale = 0;  // 0: 1 / sqrt(HS)
  // Grouped-query attention: NKV key/value heads (dividing NH; query head h reads key/value head
  // h / (NH / NKV)), so K and V rows hold NKV heads. 0: NH.
  int64_t NKV = 0;
  int64_t kv_heads() const { return NKV > 0 ? NKV : NH; }
};

namespace detail {
template <class A>
auto set_kv_heads(A& a, int64_t n, int) -> decltype(a.NKV = n, void()) {
  a.NKV = n;
}
template <class A>
void set_kv_heads(A&, int64_t, long) {}
}  // namespace detail

// A kernel's own argument struct of the same fields (cpu::AttnArgs, cuda::AttnArgs) from a shape
// (NKV where the struct has it).
template <class Args>
Args attn_args_of(const AttnShape& s) {
  Args a;
  a.B = s.B;
  a.NH = s.NH;
  a.HS = s.HS;
  a.Tq = s.Tq;
  a.Tkv = s.Tkv;
  a.q_stride = s.q_stride;
  a.kv_stride = s.kv_stride;
  a.o_stride = s.o_stride;
  a.q_pos0 = s.q_pos0;
  a.kv_pos0 = s.kv_pos0;
  a.causal = s.causal;
  a.scale = s.scale;
  detail::set_kv_heads(a, s.NKV, 0);
  return a;
}

// out = softmax(q k^T scale, mask) v; lse f32 [B, NH, Tq] (natural log of each row's sum of exp of
// the scaled scores). With the GEMM kernels, probs (dtype [B, NH, Tq, Tkv], attention_probs_bytes)
// receives the probabilities the backward reads; the others save lse only.
struct AttentionForward {
  DType dtype = DType::f32;
  AttnShape shape;
  void* out = nullptr;
  float* lse = nullptr;
  void* probs = nullptr;
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
};

// dq (q_stride), dk, dv (kv_stride), written, from dout (o_stride) and the forward's out and lse
// (and probs). With the GEMM
// kernels, dq, dk and dv must be the q, k, v columns of one packed [B, T, 3 NH HS] buffer, and
// probs is overwritten.
struct AttentionBackward {
  DType dtype = DType::f32;
  AttnShape shape;
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
  const void* dout = nullptr;
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const void* out = nullptr;
  const float* lse = nullptr;
  void* probs = nullptr;
};

// losses f32 [N] = -log softmax(logits[n, :V])[targets[n]] over logits [N, Vp] (columns [V, Vp)
// are padding, masked); targets i32 [N], -1 ignored (loss 0). With dlogits, the same pass writes
// dlogits [N, Vp] = dloss * (softmax - onehot), zeros in padding and ignored rows (dlogits may
// alias logits). losses may be null when dlogits is set.
struct CrossEntropy {
  DType dtype = DType::f32;
  float* losses = nullptr;
  void* dlogits = nullptr;
  const void* logits = nullptr;
  const int32_t* targets = nullptr;
  float dloss = 1.f;
  int64_t N = 0, V = 0, Vp = 0;
};

// The same loss over a vocabulary split by columns (tensor parallelism, parallel/tensor/
// vocab_parallel.h): this rank's logits [N, Vs] are columns [v0, v0 + Vs) of the padded
// vocabulary (those >= V are padding). Three passes, the caller reducing `stats` (f32 [3 N], this
// backend's memory) over the ranks between them:
//   max     stats[n] = the max of row n's real columns here (-inf where the shard has none);
//           then the max over the ranks;
//   sums    stats[N + n] = sum of exp(logit - stats[n]) over them, stats[2 N + n] = the target's
//           logit where this shard holds the target, else 0; then the sum over the ranks;
//   finish  losses[n] = stats[n] + log(stats[N + n]) - stats[2 N + n] (0 for target -1); with
//           dlogits (may alias logits), dloss * (softmax - onehot) over this shard's columns, 0 in
//           its padding and in ignored rows.
// targets i32 [N] in [-1, V) (the caller checks them).
struct VocabCrossEntropy {
  enum class Pass : uint8_t { max, sums, finish };
  Pass pass = Pass::max;
  DType dtype = DType::f32;
  float* losses = nullptr;
  void* dlogits = nullptr;
  const void* logits = nullptr;
  const int32_t* targets = nullptr;
  float* stats = nullptr;
  float dloss = 1.f;
  int64_t N = 0, Vs = 0, v0 = 0, V = 0;
};

// out [B, T, C] = wte[tokens[b, t]] + wpe[position of t], the position pos0 + t, or positions[t]
// (i32 [T] in this backend's memory) where given; wpe may be null (no position table: rotary
// positions). Token ids are in [0, V): the CPU checks them, a device takes its caller's check
// (the blocks check host tokens before they upload them). A vocabulary split (vocab_rows > 0):
// wte holds rows [vocab_begin, vocab_begin + vocab_rows) of the table, and a token outside them
// gives a zero row (before the position's).
struct EmbeddingForward {
  DType dtype = DType::f32;
  void* out = nullptr;
  const int32_t* tokens = nullptr;
  const void* wte = nullptr;
  const void* wpe = nullptr;
  int64_t B = 0, T = 0, C = 0, V = 0, pos0 = 0;
  const int32_t* positions = nullptr;
  int64_t vocab_begin = 0, vocab_rows = 0;
};

// dwte f32 [V, C] (or [vocab_rows, C]) += scatter of dout by token; dwpe f32 [maxT, C] += sum over
// the batch by position. Either may be null. Positions and the vocabulary split as the forward's.
struct EmbeddingBackward {
  DType dtype = DType::f32;
  float* dwte = nullptr;
  float* dwpe = nullptr;
  const void* dout = nullptr;
  const int32_t* tokens = nullptr;
  int64_t B = 0, T = 0, C = 0, V = 0, pos0 = 0;
  const int32_t* positions = nullptr;
  int64_t vocab_begin = 0, vocab_rows = 0;
};

// Llama 3's rotary frequency scaling (`rope_scaling` of rope_type "llama3" in a Hugging Face
// config); factor 0 leaves the frequencies as they are.
struct RopeScaling {
  double factor = 0;
  double low_freq_factor = 1, high_freq_factor = 4;
  int64_t original_max_position = 8192;
};
// inv_freq [HS / 2] = base^(-2 i / HS), then scaled as Llama 3 does; throws naming a bad value.
std::vector<double> rope_inv_freq(int64_t HS, double base, const RopeScaling& scaling = RopeScaling());

// Rotary position embeddings (Su et al. 2021) in Hugging Face's Llama layout: within each of the NH
// heads of HS elements at x[(b * T + t) * stride + h * HS + d], elements i and i + HS / 2 are
// rotated by the angle (pos0 + t, or positions[t]) * inv_freq[i]; with inverse by the opposite
// angle (the backward: the input's gradient is the output's rotated back). In place. positions
// i32 [T] in this backend's memory; inv_freq [HS / 2] on the host (rope_inv_freq).
struct Rope {
  DType dtype = DType::f32;
  void* x = nullptr;
  int64_t B = 0, T = 0, NH = 0, HS = 0, stride = 0, pos0 = 0;
  const int32_t* positions = nullptr;
  const double* inv_freq = nullptr;
  bool inverse = false;
};

// One tensor of a multi-tensor AdamW: f32 master weights, gradient and moments of n elements, and
// the compute copy the ops read (in the backend's compute dtype; null when the master is that).
struct AdamWTensor {
  float* param = nullptr;
  void* compute = nullptr;
  const float* grad = nullptr;
  float* m = nullptr;
  float* v = nullptr;
  int64_t n = 0;
  double weight_decay = 0;   // decoupled, multiplied by lr
};

struct AdamWHyper {
  double lr = 3e-4, beta1 = 0.9, beta2 = 0.95, eps = 1e-8;
  int64_t step = 1;        // 1-based, for bias correction
  float max_norm = 0.f;    // global-norm clipping threshold; <= 0 disables
  float grad_scale = 1.f;  // applied to every gradient before the norm and clipping
  // >= 0: the global gradient norm the caller formed (data parallelism: over every rank's shard,
  // Backend::sum_squares and a sum over the ranks); the plan's own norm pass is skipped and this
  // norm clips (and is what grad_norm() returns). Not finite: the update is skipped.
  double global_norm = -1;
};

// AdamW over a fixed list of tensors (PyTorch torch.optim.AdamW semantics): one pass for the
// global gradient norm (after grad_scale; or AdamWHyper::global_norm), the clip scale
// min(1, max_norm / (norm + 1e-6)), then every tensor's update and its compute copy refreshed.
class AdamWPlan {
 public:
  virtual ~AdamWPlan() = default;
  // The hyperparameters of the next launch (host only; waits for the previous launch, which reads
  // them from host memory on CUDA).
  virtual void set_hyper(const AdamWHyper& h) = 0;
  // Enqueues the update with the hyperparameters set last. On CUDA it can be captured in a graph:
  // a replay updates with the values of the last set_hyper before it.
  virtual void launch() = 0;
  void step(const AdamWHyper& h) {
    set_hyper(h);
    launch();
  }
  // The gradient norm (after grad_scale, before clipping) of the last launch; waits for it.
  virtual double grad_norm() = 0;
};

// A recorded sequence of ops, replayed as one launch (CUDA graphs).
class Graph {
 public:
  virtual ~Graph() = default;
  virtual void replay() = 0;
};

// Told after each op what it was and how many floating-point operations it did (matrix products
// and attention: 2 per multiply-add; attention as FlashAttention-2 counts it), to break a step's
// time down without a profiler (kernels/cuda/profile.cuh).
class OpObserver {
 public:
  virtual ~OpObserver() = default;
  virtual void op_done(const char* what, double flops) = 0;
  // Whether op_done may be called while the ops are being captured into a graph (the observer
  // then puts what it records into the graph and reads it after each replay). Otherwise a step
  // runs op by op while the observer is set.
  virtual bool in_graph() const { return false; }
};

// dst[i] = src[i], converting between dtypes (f32 and bf16; same dtypes copy bytes), from and to
// host or device memory of this backend.
struct Copy {
  void* dst = nullptr;
  DType dst_dtype = DType::f32;
  bool dst_host = false;
  const void* src = nullptr;
  DType src_dtype = DType::f32;
  bool src_host = false;
  int64_t n = 0;
};

// dst[b * dst_batch + r * dst_row + c] = src[b * src_batch + r * src_row + c] for b < batches,
// r < rows, c < cols (strides in elements of each side's dtype), converting as Copy does; with
// accumulate, dst (f32) += the converted src instead. Both in this backend's memory, not
// overlapping; with more than one row, each side's row stride is at least cols. Packs and unpacks
// strided blocks, e.g. ring attention's chunks of a sequence.
struct StridedCopy {
  void* dst = nullptr;
  DType dst_dtype = DType::f32;
  const void* src = nullptr;
  DType src_dtype = DType::f32;
  int64_t batches = 1, rows = 1, cols = 0;
  int64_t dst_row = 0, dst_batch = 0, src_row = 0, src_batch = 0;
  bool accumulate = false;
};
// Throws, naming the op, on negative sizes or an accumulation into anything but f32 from anything
// but a floating-point type (every backend's copy_strided checks this first).
void check_strided_copy(const StridedCopy& a);

// Ring attention's merge of a partial result over more keys into the running one: for each
// (b, h, t) whose part_lse is finite, out = (out e^lse + part e^part_lse) / (e^lse + e^part_lse)
// and lse = log(e^lse + e^part_lse) (computed in double); with init, out and lse become part and
// part_lse. out f32, element (b, t, h, d) at out[b * o_batch + t * o_row + h * HS + d]; lse f32 at
// lse[b * lse_batch + h * Tq + t]; part (dtype) packed [B, Tq, NH HS] and part_lse f32 [B, NH, Tq],
// an attention_forward's out and lse.
struct AttentionMerge {
  DType dtype = DType::f32;
  float* out = nullptr;
  float* lse = nullptr;
  const void* part = nullptr;
  const float* part_lse = nullptr;
  int64_t B = 0, NH = 0, HS = 0, Tq = 0;
  int64_t o_row = 0, o_batch = 0, lse_batch = 0;
  bool init = false;
};

struct BackendOptions {
  int device_index = 0;          // CUDA: the GPU ordinal
  MemoryPool* pool = nullptr;    // where the backend allocates (a pool of its device); null: its own
  AttnKernel attention = AttnKernel::automatic;
  int gemm_tune = -1;  // CUDA: GEMM algorithm tuning, 0 off, 1 on, 2 verbose; -1: LOOM_GEMM_TUNE
  // CPU: the linear layers' GEMM inputs, f32, or bf16 with f32 accumulation (train.precision =
  // bf16; needs AVX512-BF16 or AMX-BF16). Activations, weights and gradients stay f32.
  DType matmul = DType::f32;
  // CUDA: the dtype the model computes and keeps activations in, bf16 or f16 (train.precision =
  // fp16, with loss scaling); master weights, gradients and moments stay f32. The CPU computes in f32.
  DType compute = DType::bf16;
};

class Backend {
 public:
  virtual ~Backend() = default;

  virtual Device device() const = 0;
  virtual std::string name() const = 0;  // "cpu", "cuda:0 (NVIDIA H100 80GB HBM3)"
  // The dtype the blocks keep activations and compute copies of parameters in.
  virtual DType compute_dtype() const = 0;
  virtual bool supports(Op op, DType dtype) const = 0;
  virtual MemoryPool& pool() = 0;
  // The attention kernels this instance runs (after `automatic` was resolved for the last shape).
  virtual AttnKernel attention_kernel(const AttnShape& s) const = 0;
  // Why the kernel differs from the one asked for (e.g. cuDNN could not plan the shape), or "".
  virtual std::string attention_note() const { return {}; }

  virtual void linear_forward(const LinearForward& a) = 0;
  virtual void linear_backward(const LinearBackward& a) = 0;
  // Bytes of scratch that linear calls of these shapes keep in the instance (tag workspace) once
  // made: the CPU's bf16 matmuls' operand copies and oneDNN's scratch, each the largest any of the
  // shapes needs; 0 for the others.
  virtual int64_t linear_workspace_bytes(const std::vector<LinearShape>& shapes) const {
    (void)shapes;
    return 0;
  }
  virtual void layernorm_forward(const LayerNormForward& a) = 0;
  virtual void layernorm_backward(const LayerNormBackward& a) = 0;
  // Allocates what calls of this shape will need (workspaces, planned graphs) so that the calls
  // themselves allocate nothing: call it before capturing them into a graph.
  virtual void prepare_attention(DType dtype, const AttnShape& s) = 0;
  // Bytes of the probabilities the GEMM kernels save ([B, NH, Tq, Tkv] of dtype); 0 for others.
  virtual int64_t attention_probs_bytes(DType dtype, const AttnShape& s) const = 0;
  // Bytes of scratch calls of this shape keep in the instance (tag workspace) once prepared: the
  // larger of one forward and one backward call's. On the CPU it depends on the OpenMP team
  // that runs the calls: `threads` of them (0: the calling thread's team).
  virtual int64_t attention_workspace_bytes(DType dtype, const AttnShape& s, int threads = 0) const = 0;
  virtual void attention_forward(const AttentionForward& a) = 0;
  virtual void attention_backward(const AttentionBackward& a) = 0;
  virtual void attention_merge(const AttentionMerge& a) = 0;
  virtual void crossentropy(const CrossEntropy& a) = 0;
  virtual void vocab_crossentropy(const VocabCrossEntropy& a) = 0;
  virtual void embedding_forward(const EmbeddingForward& a) = 0;
  virtual void embedding_backward(const EmbeddingBackward& a) = 0;
  // out = gelu(inp), [n] (out may alias inp).
  virtual void gelu_forward(DType dtype, void* out, const void* inp, int64_t n) = 0;
  // dinp = dout * gelu'(inp), [n] (dinp may alias dout).
  virtual void gelu_backward(DType dtype, void* dinp, const void* inp, const void* dout, int64_t n) = 0;
  virtual void rope(const Rope& a) = 0;
  // SwiGLU: out [N, H] = silu(gate) * up, inp [N, 2 H] holding gate in columns [0, H) and up in
  // [H, 2 H) of each row; the backward writes dinp [N, 2 H] (may alias inp) from dout [N, H].
  virtual void swiglu_forward(DType dtype, void* out, const void* inp, int64_t N, int64_t H) = 0;
  virtual void swiglu_backward(DType dtype, void* dinp, const void* dout, const void* inp, int64_t N, int64_t H) = 0;
  // out = a + b, [n] (out may alias a or b). Every backend also takes f32 (gradient sums).
  virtual void add(DType dtype, void* out, const void* a, const void* b, int64_t n) = 0;
  // host[i] += src[i], i < n: src f32 in this backend's memory, host f32 in host memory; returns once
  // host holds the sums (a GPU's: through its page-locked staging, each piece's transfer beside the
  // host's addition of the one before, the addition on the calling thread's OpenMP team).
  virtual void add_to_host(float* host, const float* src, int64_t n) = 0;
  // The sums of squares of the f32 values of `ranges` (this backend's memory), in double, one per
  // range into sums[i]: each in a fixed order (the CPU's: cpu::sum_squares, as its optimizers form
  // norms), so the result is the same from call to call. Every range in one pass and one wait (a
  // GPU's: one copy of the partial sums back, one synchronisation).
  struct Range {
    const float* x = nullptr;
    int64_t n = 0;
  };
  virtual void sum_squares(const std::vector<Range>& ranges, double* sums) = 0;
  // out[0] = scale * (x[0] + ... + x[n - 1]), f32 in this backend's memory, in a fixed order.
  virtual void sum(const float* x, int64_t n, float scale, float* out) = 0;
  virtual std::unique_ptr<AdamWPlan> plan_adamw(const std::vector<AdamWTensor>& tensors) = 0;
  virtual void copy(const Copy& a) = 0;
  virtual void copy_strided(const StridedCopy& a) = 0;
  virtual void fill_zero(void* dst, int64_t bytes) = 0;
  // Gives back the scratch the instance keeps between calls (attention workspace and the like);
  // later calls take it again.
  virtual void release_workspace() = 0;
  // Waits for every op enqueued so far.
  virtual void synchronize() = 0;
  // The native queue the ops are enqueued on (CUDA: the instance's cudaStream_t), for work that
  // must be ordered with them, e.g. a device communicator's collectives (comm::DeviceCommOptions::
  // stream); null on the CPU, whose ops run on the calling thread.
  virtual void* native_queue() const { return nullptr; }
  // Collective over `host`: a communicator over its ranks whose collectives take this backend's
  // memory. The CPU's: host itself. A GPU's: a device communicator on this instance's queue
  // (comm/nccl_comm.h: NCCL where every rank has a GPU of its own, else staged through host
  // memory), which keeps host for its scalars' bootstrap and splits. With `staged` a GPU's goes
  // through host memory even where NCCL could run: point-to-point transfers that a rank posts
  // without waiting for them (a pipeline's; NCCL's would hold the compute stream until received).
  virtual std::unique_ptr<comm::Comm> buffer_comm(std::unique_ptr<comm::Comm> host, bool staged);

  // Whether sequences of ops can be captured and replayed (CUDA graphs).
  virtual bool can_capture() const { return false; }
  // Records the ops enqueued from here to end_capture instead of running them. Every buffer,
  // workspace and plan they use must exist already (run the sequence once first): an op that
  // would allocate during a capture is an error.
  virtual void begin_capture();
  virtual std::unique_ptr<Graph> end_capture();
  // Counts the times the instance freed or moved memory that enqueued ops may point at (its
  // scratch, its plans): a captured graph recorded under another count must not be replayed.
  uint64_t memory_epoch() const { return epoch_; }
  // Ops report to `o` (not owned; null: none) from now on, where the backend supports it (CUDA).
  void set_observer(OpObserver* o) {
    observer_ = o;
    ++observer_sets_;  // (every call: another observer may live where an unset one did)
  }
  // Reports to the observer that a step's ops begin here: what ran before, since its last
  // report, is charged to "(before the step)".
  void step_begins() { observed("(before the step)"); }
  OpObserver* observer() const { return observer_; }
  // Counts set_observer's calls (a graph captured with one observer is not replayed under another).
  uint64_t observer_sets() const { return observer_sets_; }

  // An uninitialised tensor from pool() under tag.
  Tensor empty(const Shape& shape, DType dtype, MemTag tag) { return Tensor::empty(shape, dtype, tag, pool()); }
  // Host values -> device (converting from f32 into dtype) and back, synchronously.
  void upload(void* dst, DType dtype, const float* host, int64_t n);
  void download(float* host, const void* src, DType dtype, int64_t n);

 protected:
  void observed(const char* what, double flops = 0) {
    if (observer_) observer_->op_done(what, flops);
  }
  void memory_moved() { ++epoch_; }

 private:
  OpObserver* observer_ = nullptr;
  uint64_t observer_sets_ = 0;
  uint64_t epoch_ = 0;
};

// Loads the CUDA plugin (libloom_cuda.so beside the executable, or the file LOOM_CUDA_PLUGIN
// names) once, registering the CUDA backend and trainer: the loom executable maps the CUDA
// libraries only when a run asks for the GPU. Programs linked with the CUDA code (tests,
// benchmarks) have it registered already. False, with the reason, when it cannot be loaded.
bool load_cuda_plugin(std::string* why = nullptr);

// The registry: each backend compiled into the program registers a factory for its device, and a
// probe that says whether it can start here (CUDA: a GPU is present).
using BackendFactory = std::unique_ptr<Backend> (*)(const BackendOptions& opt);
using BackendProbe = bool (*)(std::string* why);
// What a device's backend says of the hardware a run would use, without starting on it (no
// context, no pool): the device's name and memory, and how many such devices this host has.
struct DeviceInfo {
  std::string name;    // "NVIDIA H100 80GB HBM3"
  int64_t memory = 0;  // bytes
  int count = 0;       // devices of this kind visible on this host
};
using DeviceInfoFn = bool (*)(DeviceInfo* info, std::string* why);
void register_backend(Device device, BackendFactory factory, BackendProbe probe = nullptr,
                      DeviceInfoFn info = nullptr);
// The current device's DeviceInfo (CUDA: the current GPU's) where its backend can say it; false,
// with the reason in `why`, otherwise.
bool device_info(Device device, DeviceInfo* info, std::string* why = nullptr);
// Whether a backend for `device` is in this program and can start; `why` receives the reason when
// not.
bool backend_available(Device device, std::string* why = nullptr);
// A new instance; throws naming the device when none is registered or it cannot start.
std::unique_ptr<Backend> make_backend(Device device, const BackendOptions& opt = {});

}  // namespace loom
