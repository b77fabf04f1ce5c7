// cuDNN fused attention through the backend graph API (cudnn_attention.cuh). Host code only: the
// graphs are built from backend descriptors (tensors, pointwise / matmul / reduction / reshape
// operations, operation graph, heuristics, engine configurations, execution plan, variant pack).
//
// The graphs follow the operation patterns cuDNN's runtime-fusion SDPA engines recognise:
//
// forward (Q [B,NH,Tq,HS], K^T [B,NKV,HS,Tkv], V [B,NKV,Tkv,HS] 16-bit views, "h" below: bf16 or
// f16, of loom's row layout; with grouped-query attention, NKV < NH, the matmuls broadcast each
// key/value head over its group):
//   S  = matmul(Q, K^T)                     f32 virtual [B,NH,Tq,Tkv]
//   S1 = S * scale                           (scale: f32 by-value scalar)
//   causal: row = gen_index(S1, axis 2), col = gen_index(S1, axis 3) (int32),
//           keep = row >= col (bool), S2 = keep ? S1 : -inf   (binary select)
//   M  = reduce_max(S2)                      f32 virtual [B,NH,Tq,1]
//   E  = exp(S2 - M); Z = reduce_add(E)
//   Stats = M + log(Z)                       f32 [B,NH,Tq,1] = loom's lse (natural log)
//   P  = E / Z                               h virtual
//   O  = matmul(P, V)                        h
//
// backward (Q, K^T, V^T, O, dO, Stats as above; dQ, dK, dV h):
//   Dsum = reduce_add(dO * O) * 1            f32 [B,NH,Tq,1], in the workspace
//   S2 = matmul(Q, K^T) * scale - Stats, causal mask as forward (-inf), P = exp(S2)  f32 virtual
//   dV = matmul(reshape(P) -> P^T h, dO)
//   dS = (matmul(dO, V^T) - Dsum) * P * scale
//   dK = matmul(reshape(dS) -> dS^T h, Q)
//   (NKV < NH: dV and dK per query head are virtual [B,NH,Tkv,HS] tensors, reduce_add into NKV heads)
//   dQacc = matmul(dS, reshape(K^T) -> K)   f32 [B,NH,Tq,HS], in the workspace; dQ = identity(dQacc)
#include "kernels/cuda/cudnn_attention.cuh"

#include <cuda_runtime.h>
#ifdef LOOM_HAVE_CUDNN
#include <cudnn.h>
#endif

#include <algorithm>
#include <array>
#include <cmath>
#include <memory>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "core/error.h"
#include "kernels/cuda/common.cuh"

namespace loom::cuda {

namespace {

std::string shape_string(const AttnArgs& a) {
  return fmt::format("B={}, NH={}, NKV={}, HS={}, Tq={}, Tkv={}, causal={}, strides q/kv/o={}/{}/{}", a.B, a.NH,
                     a.NKV > 0 ? a.NKV : a.NH, a.HS, a.Tq, a.Tkv, a.causal ? 1 : 0, a.q_stride, a.kv_stride,
                     a.o_stride);
}

}  // namespace

void cudnn_attention_check(const AttnArgs& a) {
  LOOM_CHECK(a.B >= 1 && a.NH >= 1 && a.Tq >= 1 && a.Tkv >= 1,
             "cuDNN attention: B, NH, Tq and Tkv must be at least 1 (B = {}, NH = {}, Tq = {}, Tkv = {})", a.B, a.NH,
             a.Tq, a.Tkv);
  LOOM_CHECK(a.HS == 64 || a.HS == 128, "cuDNN attention: head size HS = {} is not supported (64 or 128)", a.HS);
  LOOM_CHECK(a.NKV >= 0 && (a.NKV == 0 || a.NH % a.NKV == 0),
             "cuDNN attention: NKV = {} key/value heads must divide NH = {} query heads", a.NKV, a.NH);
  LOOM_CHECK(a.Tq > 1 || a.Tkv > 1,
             "cuDNN attention: Tq = 1 and Tkv = 1 (one query, one key) is a shape cuDNN's attention backward does "
             "not take; loom's own kernels (attention_forward) do");
  const int64_t C = a.NH * a.HS, Ckv = (a.NKV > 0 ? a.NKV : a.NH) * a.HS;
  LOOM_CHECK(a.q_stride >= C && a.o_stride >= C && a.kv_stride >= Ckv,
             "cuDNN attention: row strides (q_stride = {}, o_stride = {}) must be at least NH * HS = {} and kv_stride = "
             "{} at least NKV * HS = {}",
             a.q_stride, a.o_stride, C, a.kv_stride, Ckv);
  LOOM_CHECK(a.q_stride % 8 == 0 && a.kv_stride % 8 == 0 && a.o_stride % 8 == 0,
             "cuDNN attention: row strides (q_stride = {}, kv_stride = {}, o_stride = {}) must be multiples of 8 "
             "elements (16-byte rows)",
             a.q_stride, a.kv_stride, a.o_stride);
  LOOM_CHECK(!a.causal || a.q_pos0 == a.kv_pos0,
             "cuDNN attention: a causal mask needs queries and keys to start at the same position (q_pos0 = {}, "
             "kv_pos0 = {}); loom's own kernels (attention_forward) take shifted chunks",
             a.q_pos0, a.kv_pos0);
  LOOM_CHECK(std::isfinite(a.scale), "cuDNN attention: scale = {} is not finite", a.scale);
  LOOM_CHECK(a.B * a.NH * a.Tq <= std::numeric_limits<int32_t>::max() &&
                 a.B * a.NH * a.Tkv <= std::numeric_limits<int32_t>::max(),
             "cuDNN attention: B * NH * T must fit in 32 bits (B = {}, NH = {}, Tq = {}, Tkv = {})", a.B, a.NH, a.Tq,
             a.Tkv);
}

#ifndef LOOM_HAVE_CUDNN

bool cudnn_available() { return false; }
int64_t cudnn_runtime_version() { return 0; }

struct CudnnAttention::Impl {
  AttnArgs a;
};

CudnnAttention::CudnnAttention(const AttnArgs& a, DType) {
  cudnn_attention_check(a);
  LOOM_FAIL("cuDNN attention: loom was built without cuDNN (CMake did not find libcudnn) ({})", shape_string(a));
}
CudnnAttention::~CudnnAttention() = default;
const AttnArgs& CudnnAttention::args() const { return impl_->a; }
size_t CudnnAttention::forward_workspace_bytes() const { return 0; }
size_t CudnnAttention::backward_workspace_bytes() const { return 0; }
std::string CudnnAttention::describe() const { return "cuDNN not built in"; }
void CudnnAttention::forward(void*, float*, const void*, const void*, const void*, void*, cudaStream_t) {
  LOOM_FAIL("cuDNN attention: loom was built without cuDNN");
}
void CudnnAttention::backward(void*, void*, void*, const void*, const void*, const void*, const void*, const void*,
                              const float*, void*, cudaStream_t) {
  LOOM_FAIL("cuDNN attention: loom was built without cuDNN");
}

#else  // LOOM_HAVE_CUDNN

bool cudnn_available() { return true; }
int64_t cudnn_runtime_version() { return int64_t(cudnnGetVersion()); }

namespace {

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

// Throws loom::Error for a failed cuDNN call: the step, cuDNN's status and its last error message.
void cudnn_check(cudnnStatus_t s, const std::string& step) {
  if (s == CUDNN_STATUS_SUCCESS) return;
  std::array<char, 1024> msg{};
  cudnnGetLastErrorString(msg.data(), msg.size());
  LOOM_FAIL("cuDNN attention: {} failed: {} ({}){}{}", step, cudnnGetErrorString(s), int(s), msg[0] ? ": " : "",
            msg.data());
}

// One backend descriptor, destroyed with its owner.
class Desc {
 public:
  Desc() = default;
  Desc(cudnnBackendDescriptorType_t type, const char* what) : what_(what) {
    cudnn_check(cudnnBackendCreateDescriptor(type, &d_), std::string("creating the ") + what + " descriptor");
  }
  ~Desc() {
    if (d_) cudnnBackendDestroyDescriptor(d_);
  }
  Desc(Desc&& o) noexcept : d_(std::exchange(o.d_, nullptr)), what_(o.what_) {}
  Desc& operator=(Desc&& o) noexcept {
    std::swap(d_, o.d_);
    std::swap(what_, o.what_);
    return *this;
  }
  Desc(const Desc&) = delete;
  Desc& operator=(const Desc&) = delete;

  cudnnBackendDescriptor_t get() const { return d_; }

  void set(cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type, int64_t count, const void* value) {
    cudnn_check(cudnnBackendSetAttribute(d_, name, type, count, value),
                fmt::format("setting attribute {} of the {} descriptor", int(name), what_));
  }
  void set_desc(cudnnBackendAttributeName_t name, cudnnBackendDescriptor_t value) {
    set(name, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &value);
  }
  void set_i64(cudnnBackendAttributeName_t name, int64_t value) { set(name, CUDNN_TYPE_INT64, 1, &value); }
  void set_dtype(cudnnBackendAttributeName_t name, cudnnDataType_t value) {
    set(name, CUDNN_TYPE_DATA_TYPE, 1, &value);
  }
  void finalize() { cudnn_check(cudnnBackendFinalize(d_), fmt::format("finalizing the {} descriptor", what_)); }
  // Finalize that may fail (engine configurations a plan cannot be made from).
  cudnnStatus_t try_finalize() { return cudnnBackendFinalize(d_); }

 private:
  cudnnBackendDescriptor_t d_ = nullptr;
  const char* what_ = "";
};

using Dims = std::array<int64_t, 4>;

// Tensor uids of the graphs' non-virtual tensors (the variant pack's keys); virtual ones count
// up from kFirstVirtual.
enum Uid : int64_t {
  kQ = 1,
  kK = 2,
  kV = 3,
  kO = 4,
  kStats = 5,
  kScale = 6,
  kNegInf = 7,
  kDO = 8,
  kDQ = 9,
  kDK = 10,
  kDV = 11,
  kOne = 12,
  kDsum = 13,
  kDQAcc = 14,
  kFirstVirtual = 100,
};

// Builds one operation graph: owns every tensor and operation descriptor it creates.
class GraphBuilder {
 public:
  explicit GraphBuilder(const char* name) : name_(name) {}

  // A tensor with 16-byte alignment (what the fused engines assume for every tensor).
  cudnnBackendDescriptor_t tensor(int64_t uid, cudnnDataType_t dtype, const Dims& dims, const Dims& strides,
                                  bool is_virtual = false, bool by_value = false) {
    Desc t(CUDNN_BACKEND_TENSOR_DESCRIPTOR, "tensor");
    t.set_i64(CUDNN_ATTR_TENSOR_UNIQUE_ID, uid);
    t.set_dtype(CUDNN_ATTR_TENSOR_DATA_TYPE, dtype);
    t.set(CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, dims.data());
    t.set(CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 4, strides.data());
    t.set_i64(CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, 16);
    const bool v = is_virtual, bv = by_value;
    t.set(CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &v);
    t.set(CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &bv);
    t.finalize();
    return keep(std::move(t));
  }
  cudnnBackendDescriptor_t virt(cudnnDataType_t dtype, const Dims& dims, const Dims& strides) {
    return tensor(next_virtual_++, dtype, dims, strides, true);
  }
  // A by-value f32 scalar [1, 1, 1, 1]: its variant-pack pointer is a host float.
  cudnnBackendDescriptor_t scalar(int64_t uid) {
    return tensor(uid, CUDNN_DATA_FLOAT, {1, 1, 1, 1}, {1, 1, 1, 1}, false, true);
  }

  // y = op(x[, b[, t]]) with compute type `compute`; axis for gen_index.
  void pointwise(cudnnPointwiseMode_t mode, cudnnDataType_t compute, cudnnBackendDescriptor_t x,
                 cudnnBackendDescriptor_t b, cudnnBackendDescriptor_t t, cudnnBackendDescriptor_t y,
                 int64_t axis = -1) {
    Desc pw(CUDNN_BACKEND_POINTWISE_DESCRIPTOR, "pointwise");
    pw.set(CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode);
    pw.set_dtype(CUDNN_ATTR_POINTWISE_MATH_PREC, compute);
    if (axis >= 0) pw.set_i64(CUDNN_ATTR_POINTWISE_AXIS, axis);
    pw.finalize();
    Desc op(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR, "pointwise operation");
    op.set_desc(CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, pw.get());
    op.set_desc(CUDNN_ATTR_OPERATION_POINTWISE_XDESC, x);
    if (b) op.set_desc(CUDNN_ATTR_OPERATION_POINTWISE_BDESC, b);
    if (t) op.set_desc(CUDNN_ATTR_OPERATION_POINTWISE_TDESC, t);
    op.set_desc(CUDNN_ATTR_OPERATION_POINTWISE_YDESC, y);
    op.finalize();
    keep(std::move(pw));
    ops_.push_back(keep(std::move(op)));
  }
  void unary(cudnnPointwiseMode_t mode, cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y) {
    pointwise(mode, CUDNN_DATA_FLOAT, x, nullptr, nullptr, y);
  }
  void binary(cudnnPointwiseMode_t mode, cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t b,
              cudnnBackendDescriptor_t y) {
    pointwise(mode, CUDNN_DATA_FLOAT, x, b, nullptr, y);
  }

  // c = a @ b over the last two dimensions, f32 accumulation.
  void matmul(cudnnBackendDescriptor_t a, cudnnBackendDescriptor_t b, cudnnBackendDescriptor_t c) {
    Desc mm(CUDNN_BACKEND_MATMUL_DESCRIPTOR, "matmul");
    mm.set_dtype(CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_DATA_FLOAT);
    mm.finalize();
    Desc op(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR, "matmul operation");
    op.set_desc(CUDNN_ATTR_OPERATION_MATMUL_ADESC, a);
    op.set_desc(CUDNN_ATTR_OPERATION_MATMUL_BDESC, b);
    op.set_desc(CUDNN_ATTR_OPERATION_MATMUL_CDESC, c);
    op.set_desc(CUDNN_ATTR_OPERATION_MATMUL_DESC, mm.get());
    op.finalize();
    keep(std::move(mm));
    ops_.push_back(keep(std::move(op)));
  }

  // y = reduce(x) over the dimensions where y has extent 1.
  void reduction(cudnnReduceTensorOp_t red, cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y) {
    Desc rd(CUDNN_BACKEND_REDUCTION_DESCRIPTOR, "reduction");
    rd.set(CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &red);
    rd.set_dtype(CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_DATA_FLOAT);
    rd.finalize();
    Desc op(CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR, "reduction operation");
    op.set_desc(CUDNN_ATTR_OPERATION_REDUCTION_DESC, rd.get());
    op.set_desc(CUDNN_ATTR_OPERATION_REDUCTION_XDESC, x);
    op.set_desc(CUDNN_ATTR_OPERATION_REDUCTION_YDESC, y);
    op.finalize();
    keep(std::move(rd));
    ops_.push_back(keep(std::move(op)));
  }

  // y = x seen through y's dimensions and strides (a transpose when the strides are swapped).
  void reshape(cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y) {
    Desc op(CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR, "reshape operation");
    op.set_desc(CUDNN_ATTR_OPERATION_RESHAPE_XDESC, x);
    op.set_desc(CUDNN_ATTR_OPERATION_RESHAPE_YDESC, y);
    op.finalize();
    ops_.push_back(keep(std::move(op)));
  }

  // The causal mask on scores x [B,NH,Tq,Tkv] (f32 virtual): key column c stays visible to query
  // row r iff r >= c; masked scores become neg_inf (a by-value scalar).
  cudnnBackendDescriptor_t causal_mask(cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t neg_inf, const Dims& dims,
                                       const Dims& strides) {
    cudnnBackendDescriptor_t row = virt(CUDNN_DATA_INT32, dims, strides);
    cudnnBackendDescriptor_t col = virt(CUDNN_DATA_INT32, dims, strides);
    pointwise(CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_FLOAT, x, nullptr, nullptr, row, 2);
    pointwise(CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_FLOAT, x, nullptr, nullptr, col, 3);
    cudnnBackendDescriptor_t keep_mask = virt(CUDNN_DATA_BOOLEAN, dims, strides);
    pointwise(CUDNN_POINTWISE_CMP_GE, CUDNN_DATA_BOOLEAN, row, col, nullptr, keep_mask);
    cudnnBackendDescriptor_t y = virt(CUDNN_DATA_FLOAT, dims, strides);
    pointwise(CUDNN_POINTWISE_BINARY_SELECT, CUDNN_DATA_FLOAT, x, neg_inf, keep_mask, y);
    return y;
  }

  // Finalizes the operation graph on `handle`.
  Desc build(cudnnHandle_t handle) {
    Desc g(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR, name_);
    g.set(CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle);
    g.set(CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, int64_t(ops_.size()), ops_.data());
    g.finalize();
    return g;
  }

 private:
  cudnnBackendDescriptor_t keep(Desc d) {
    descs_.push_back(std::move(d));
    return descs_.back().get();
  }
  const char* name_;
  std::vector<Desc> descs_;
  std::vector<cudnnBackendDescriptor_t> ops_;
  int64_t next_virtual_ = kFirstVirtual;
};

// An execution plan of one graph and what it took to make it.
struct Plan {
  std::vector<Desc> configs;  // the heuristics' engine configurations (the plan was made from one)
  Desc plan;
  int64_t workspace = 0;
  int64_t engine = -1;     // the engine's global index
  int64_t candidate = -1;  // which heuristic configuration (0-based) finalized
  int64_t candidates = 0;  // how many the heuristics returned
  const char* heur = "";
};

// Asks the heuristics for engine configurations (mode A, then the fallback list) and keeps the
// first one that finalizes into an execution plan.
Plan make_plan(cudnnHandle_t handle, const Desc& graph, const std::string& what) {
  std::string last_error = "the heuristics returned no engine configuration";
  for (cudnnBackendHeurMode_t mode : {CUDNN_HEUR_MODE_A, CUDNN_HEUR_MODE_FALLBACK}) {
    const char* mode_name = mode == CUDNN_HEUR_MODE_A ? "heuristics mode A" : "fallback heuristics";
    Desc heur(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR, "engine heuristics");
    heur.set_desc(CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, graph.get());
    heur.set(CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode);
    if (cudnnStatus_t s = heur.try_finalize(); s != CUDNN_STATUS_SUCCESS) {
      std::array<char, 1024> msg{};
      cudnnGetLastErrorString(msg.data(), msg.size());
      last_error = fmt::format("{}: {} ({}) {}", mode_name, cudnnGetErrorString(s), int(s), msg.data());
      continue;
    }
    int64_t count = 0;
    cudnn_check(cudnnBackendGetAttribute(heur.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, 0,
                                         &count, nullptr),
                what + ": counting the engine configurations of the " + mode_name);
    if (count <= 0) continue;
    std::vector<Desc> cfgs;
    std::vector<cudnnBackendDescriptor_t> raw;
    for (int64_t i = 0; i < count; ++i) {
      cfgs.emplace_back(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, "engine configuration");
      raw.push_back(cfgs.back().get());
    }
    int64_t returned = 0;
    cudnn_check(cudnnBackendGetAttribute(heur.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR,
                                         count, &returned, raw.data()),
                what + ": reading the engine configurations of the " + mode_name);
    for (int64_t i = 0; i < std::min(count, returned); ++i) {
      Desc plan(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR, "execution plan");
      plan.set(CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle);
      plan.set_desc(CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, raw[size_t(i)]);
      if (cudnnStatus_t s = plan.try_finalize(); s != CUDNN_STATUS_SUCCESS) {
        std::array<char, 1024> msg{};
        cudnnGetLastErrorString(msg.data(), msg.size());
        last_error = fmt::format("{} configuration {} of {}: {} ({}) {}", mode_name, i, returned,
                                 cudnnGetErrorString(s), int(s), msg.data());
        continue;
      }
      Plan p;
      int64_t n = 0;
      cudnn_check(cudnnBackendGetAttribute(plan.get(), CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64, 1,
                                           &n, &p.workspace),
                  what + ": reading the plan's workspace size");
      Desc engine(CUDNN_BACKEND_ENGINE_DESCRIPTOR, "engine");
      cudnnBackendDescriptor_t engine_raw = engine.get();
      cudnn_check(cudnnBackendGetAttribute(raw[size_t(i)], CUDNN_ATTR_ENGINECFG_ENGINE, CUDNN_TYPE_BACKEND_DESCRIPTOR,
                                           1, &n, &engine_raw),
                  what + ": reading the configuration's engine");
      cudnn_check(
          cudnnBackendGetAttribute(engine_raw, CUDNN_ATTR_ENGINE_GLOBAL_INDEX, CUDNN_TYPE_INT64, 1, &n, &p.engine),
          what + ": reading the engine's index");
      p.plan = std::move(plan);
      p.configs = std::move(cfgs);
      p.candidate = i;
      p.candidates = returned;
      p.heur = mode_name;
      return p;
    }
  }
  LOOM_FAIL("cuDNN attention: no engine supports the {}: {}", what, last_error);
}

// Runs `plan` with the (uid, pointer) pairs of its non-virtual tensors.
void execute(cudnnHandle_t handle, const Plan& plan, const std::vector<int64_t>& uids, const std::vector<void*>& ptrs,
             void* workspace, const char* what) {
  Desc pack(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, "variant pack");
  pack.set(CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, int64_t(uids.size()), uids.data());
  pack.set(CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, int64_t(ptrs.size()), ptrs.data());
  pack.set(CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &workspace);
  pack.finalize();
  cudnn_check(cudnnBackendExecute(handle, plan.plan.get(), pack.get()), what);
}

constexpr size_t kAlign = 256;
size_t round_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

}  // namespace

struct CudnnAttention::Impl {
  AttnArgs a;
  cudnnDataType_t half = CUDNN_DATA_BFLOAT16;  // the 16-bit tensors' type (bf16 or f16)
  std::string shape;
  cudnnHandle_t handle = nullptr;
  int64_t version = 0;
  // Host values of the by-value scalars (the variant pack points at them).
  float scale = 0.f, one = 1.f, neg_inf = -INFINITY;
  // Each graph's tensors and operations, the finalized graph and its plan, kept for the plan's life.
  std::unique_ptr<GraphBuilder> fwd_ops, bwd_ops;
  Desc fwd_graph, bwd_graph;
  Plan fwd, bwd;
  size_t dsum_bytes = 0, dqacc_bytes = 0;
  size_t bwd_ws_offset_dsum = 0, bwd_ws_offset_dqacc = 0, bwd_ws_bytes = 0;

  ~Impl() {
    fwd = Plan();
    bwd = Plan();
    fwd_graph = Desc();
    bwd_graph = Desc();
    fwd_ops.reset();
    bwd_ops.reset();
    if (handle) cudnnDestroy(handle);
  }

  // Strides of loom's row layout seen as [B, NH, T, HS] (and transposed [B, NH, HS, T]).
  static Dims bhsd_strides(int64_t T, int64_t stride, int64_t HS) { return {T * stride, HS, stride, 1}; }
  static Dims bhds_strides(int64_t T, int64_t stride, int64_t HS) { return {T * stride, HS, 1, stride}; }

  int64_t kv_heads() const { return a.NKV > 0 ? a.NKV : a.NH; }

  void build_forward() {
    const int64_t B = a.B, NH = a.NH, NKV = kv_heads(), HS = a.HS, Tq = a.Tq, Tkv = a.Tkv;
    fwd_ops = std::make_unique<GraphBuilder>("forward attention graph");
    GraphBuilder& g = *fwd_ops;
    const Dims s_dims{B, NH, Tq, Tkv}, s_strides{NH * Tq * Tkv, Tq * Tkv, Tkv, 1};
    const Dims r_dims{B, NH, Tq, 1}, r_strides{NH * Tq, Tq, 1, 1};
    auto q = g.tensor(kQ, half, {B, NH, Tq, HS}, bhsd_strides(Tq, a.q_stride, HS));
    // Grouped-query attention: K and V have NKV heads; the matmuls broadcast each over the NH / NKV
    // query heads of its group.
    auto kt = g.tensor(kK, half, {B, NKV, HS, Tkv}, bhds_strides(Tkv, a.kv_stride, HS));
    auto v = g.tensor(kV, half, {B, NKV, Tkv, HS}, bhsd_strides(Tkv, a.kv_stride, HS));
    auto o = g.tensor(kO, half, {B, NH, Tq, HS}, bhsd_strides(Tq, a.o_stride, HS));
    auto stats = g.tensor(kStats, CUDNN_DATA_FLOAT, r_dims, r_strides);
    auto scale_t = g.scalar(kScale);

    auto s = g.virt(CUDNN_DATA_FLOAT, s_dims, s_strides);
    g.matmul(q, kt, s);
    auto s1 = g.virt(CUDNN_DATA_FLOAT, s_dims, s_strides);
    g.binary(CUDNN_POINTWISE_MUL, s, scale_t, s1);
    if (a.causal) s1 = g.causal_mask(s1, g.scalar(kNegInf), s_dims, s_strides);

    auto m = g.virt(CUDNN_DATA_FLOAT, r_dims, r_strides);
    g.reduction(CUDNN_REDUCE_TENSOR_MAX, s1, m);
    auto x = g.virt(CUDNN_DATA_FLOAT, s_dims, s_strides);
    g.binary(CUDNN_POINTWISE_SUB, s1, m, x);
    auto e = g.virt(CUDNN_DATA_FLOAT, s_dims, s_strides);
    g.unary(CUDNN_POINTWISE_EXP, x, e);
    auto z = g.virt(CUDNN_DATA_FLOAT, r_dims, r_strides);
    g.reduction(CUDNN_REDUCE_TENSOR_ADD, e, z);
    auto logz = g.virt(CUDNN_DATA_FLOAT, r_dims, r_strides);
    g.unary(CUDNN_POINTWISE_LOG, z, logz);
    g.binary(CUDNN_POINTWISE_ADD, m, logz, stats);
    auto p = g.virt(half, s_dims, s_strides);  // the second matmul reads P in the 16-bit type
    g.binary(CUDNN_POINTWISE_DIV, e, z, p);
    g.matmul(p, v, o);

    fwd_graph = g.build(handle);
    fwd = make_plan(handle, fwd_graph, "forward graph (" + shape + ")");
  }

  void build_backward() {
    const int64_t B = a.B, NH = a.NH, NKV = kv_heads(), HS = a.HS, Tq = a.Tq, Tkv = a.Tkv;
    bwd_ops = std::make_unique<GraphBuilder>("backward attention graph");
    GraphBuilder& g = *bwd_ops;
    const Dims s_dims{B, NH, Tq, Tkv}, s_strides{NH * Tq * Tkv, Tq * Tkv, Tkv, 1};
    const Dims st_dims{B, NH, Tkv, Tq}, st_strides{NH * Tq * Tkv, Tq * Tkv, 1, Tkv};  // transposed view
    const Dims r_dims{B, NH, Tq, 1}, r_strides{NH * Tq, Tq, 1, 1};
    const Dims qd_dims{B, NH, Tq, HS}, packed_q{NH * Tq * HS, Tq * HS, HS, 1};
    auto q = g.tensor(kQ, half, qd_dims, bhsd_strides(Tq, a.q_stride, HS));
    auto kt = g.tensor(kK, half, {B, NKV, HS, Tkv}, bhds_strides(Tkv, a.kv_stride, HS));
    auto vt = g.tensor(kV, half, {B, NKV, HS, Tkv}, bhds_strides(Tkv, a.kv_stride, HS));
    auto o = g.tensor(kO, half, qd_dims, bhsd_strides(Tq, a.o_stride, HS));
    auto dout = g.tensor(kDO, half, qd_dims, bhsd_strides(Tq, a.o_stride, HS));
    auto stats = g.tensor(kStats, CUDNN_DATA_FLOAT, r_dims, r_strides);
    auto dq = g.tensor(kDQ, half, qd_dims, bhsd_strides(Tq, a.q_stride, HS));
    auto dk = g.tensor(kDK, half, {B, NKV, Tkv, HS}, bhsd_strides(Tkv, a.kv_stride, HS));
    auto dv = g.tensor(kDV, half, {B, NKV, Tkv, HS}, bhsd_strides(Tkv, a.kv_stride, HS));
    // Grouped-query attention: dK and dV per query head (virtual, packed [B, NH, Tkv, HS]), summed
    // over each group's query heads by a reduction into the NKV heads.
    const Dims full_kv_dims{B, NH, Tkv, HS}, full_kv_strides{NH * Tkv * HS, Tkv * HS, HS, 1};
    auto grad_per_query_head = [&](cudnnBackendDescriptor_t grad) {
      return NKV == NH ? grad : g.virt(half, full_kv_dims, full_kv_strides);
    };
    auto reduce_over_group = [&](cudnnBackendDescriptor_t full, cudnnBackendDescriptor_t grad) {
      if (full != grad) g.reduction(CUDNN_REDUCE_TENSOR_ADD, full, grad);
    };
    auto scale_t = g.scalar(kScale);
    auto one_t = g.scalar(kOne);
    auto dsum = g.tensor(kDsum, CUDNN_DATA_FLOAT, r_dims, r_strides);
    auto dqacc = g.tensor(kDQAcc, CUDNN_DATA_FLOAT, qd_dims, packed_q);

    // Dsum = rowsum(dO * O)
    auto doo = g.virt(CUDNN_DATA_FLOAT, qd_dims, packed_q);
    g.binary(CUDNN_POINTWISE_MUL, dout, o, doo);
    auto rs = g.virt(CUDNN_DATA_FLOAT, r_dims, r_strides);
    g.reduction(CUDNN_REDUCE_TENSOR_ADD, doo, rs);
    g.binary(CUDNN_POINTWISE_MUL, rs, one_t, dsum);

    // P = exp(mask(Q K^T scale) - Stats)
    auto s = g.virt(CUDNN_DATA_FLOAT, s_dims, s_strides);
    g.matmul(q, kt, s);
    auto s1 = g.virt(CUDNN_DATA_FLOAT, s_dims, s_strides);
    g.binary(CUDNN_POINTWISE_MUL, s, scale_t, s1);
    auto s2 = g.virt(CUDNN_DATA_FLOAT, s_dims, s_strides);
    g.binary(CUDNN_POINTWISE_SUB, s1, stats, s2);
    if (a.causal) s2 = g.causal_mask(s2, g.scalar(kNegInf), s_dims, s_strides);
    auto p = g.virt(CUDNN_DATA_FLOAT, s_dims, s_strides);
    g.unary(CUDNN_POINTWISE_EXP, s2, p);

    // dV = P^T dO
    auto pt = g.virt(half, st_dims, st_strides);
    g.reshape(p, pt);
    auto dv_full = grad_per_query_head(dv);
    g.matmul(pt, dout, dv_full);
    reduce_over_group(dv_full, dv);

    // dS = (dO V^T - Dsum) * P * scale
    auto dp = g.virt(CUDNN_DATA_FLOAT, s_dims, s_strides);
    g.matmul(dout, vt, dp);
    auto dp1 = g.virt(CUDNN_DATA_FLOAT, s_dims, s_strides);
    g.binary(CUDNN_POINTWISE_SUB, dp, dsum, dp1);
    auto dp2 = g.virt(CUDNN_DATA_FLOAT, s_dims, s_strides);
    g.binary(CUDNN_POINTWISE_MUL, dp1, p, dp2);
    auto ds = g.virt(CUDNN_DATA_FLOAT, s_dims, s_strides);
    g.binary(CUDNN_POINTWISE_MUL, dp2, scale_t, ds);

    // dK = dS^T Q
    auto dst = g.virt(half, st_dims, st_strides);
    g.reshape(ds, dst);
    auto dk_full = grad_per_query_head(dk);
    g.matmul(dst, q, dk_full);
    reduce_over_group(dk_full, dk);

    // dQ = dS K, accumulated in f32
    auto k = g.virt(CUDNN_DATA_FLOAT, {B, NKV, Tkv, HS}, bhsd_strides(Tkv, a.kv_stride, HS));
    g.reshape(kt, k);
    g.matmul(ds, k, dqacc);
    g.unary(CUDNN_POINTWISE_IDENTITY, dqacc, dq);

    bwd_graph = g.build(handle);
    bwd = make_plan(handle, bwd_graph, "backward graph (" + shape + ")");
    dsum_bytes = size_t(B * NH * Tq) * sizeof(float);
    dqacc_bytes = size_t(B * NH * Tq * HS) * sizeof(float);
    bwd_ws_offset_dsum = round_up(size_t(bwd.workspace));
    bwd_ws_offset_dqacc = bwd_ws_offset_dsum + round_up(dsum_bytes);
    bwd_ws_bytes = bwd_ws_offset_dqacc + round_up(dqacc_bytes);
  }
};

CudnnAttention::CudnnAttention(const AttnArgs& a, DType dtype) : impl_(std::make_unique<Impl>()) {
  cudnn_attention_check(a);
  LOOM_CHECK(dtype == DType::bf16 || dtype == DType::f16, "cuDNN attention: dtype {} is not bf16 or f16",
             dtype_name(dtype));
  Impl& m = *impl_;
  m.a = a;
  m.half = dtype == DType::f16 ? CUDNN_DATA_HALF : CUDNN_DATA_BFLOAT16;
  m.shape = shape_string(a);
  m.version = cudnn_runtime_version();
  m.scale = a.scale != 0.f ? a.scale : 1.f / std::sqrt(float(a.HS));
  // Earlier releases need workarounds this path does not build (a finite mask value, a dQ
  // accumulator cleared before the backward, Tkv a multiple of 128 in the backward, no causal mask
  // with a single query, the bf16 forward bugs of 9.10.0 and 9.10.1).
  LOOM_CHECK(m.version >= 91600, "cuDNN attention: needs cuDNN 9.16 or newer, the loaded library is {}", m.version);
  int dev = 0, major = 0;
  LOOM_CUDA_CHECK(cudaGetDevice(&dev));
  LOOM_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  LOOM_CHECK(major >= 8, "cuDNN attention: fused attention needs compute capability 8.0 or newer (device {} is {}.x)",
             dev, major);
  cudnn_check(cudnnCreate(&m.handle), "creating the cuDNN handle");
  m.build_forward();
  m.build_backward();
}

CudnnAttention::~CudnnAttention() = default;

const AttnArgs& CudnnAttention::args() const { return impl_->a; }

size_t CudnnAttention::forward_workspace_bytes() const { return size_t(impl_->fwd.workspace); }

size_t CudnnAttention::backward_workspace_bytes() const { return impl_->bwd_ws_bytes; }

std::string CudnnAttention::describe() const {
  const Impl& m = *impl_;
  auto one = [](const Plan& p) {
    return fmt::format("engine {} ({} configuration {} of {}, workspace {} B)", p.engine, p.heur, p.candidate,
                       p.candidates, p.workspace);
  };
  return fmt::format("cuDNN {}: forward {}; backward {}", m.version, one(m.fwd), one(m.bwd));
}

void CudnnAttention::forward(void* out, float* lse, const void* q, const void* k, const void* v, void* workspace,
                             cudaStream_t stream) {
  Impl& m = *impl_;
  LOOM_CHECK(aligned16(out) && aligned16(lse) && aligned16(q) && aligned16(k) && aligned16(v),
             "cuDNN attention forward: out, lse, q, k and v must be 16-byte aligned ({})", m.shape);
  LOOM_CHECK(m.fwd.workspace == 0 || (workspace && aligned16(workspace)),
             "cuDNN attention forward: needs a 16-byte aligned workspace of {} bytes ({})", m.fwd.workspace, m.shape);
  cudnn_check(cudnnSetStream(m.handle, stream), "setting the stream");
  std::vector<int64_t> uids = {kQ, kK, kV, kO, kStats, kScale};
  std::vector<void*> ptrs = {const_cast<void*>(q), const_cast<void*>(k), const_cast<void*>(v), out, lse, &m.scale};
  if (m.a.causal) {
    uids.push_back(kNegInf);
    ptrs.push_back(&m.neg_inf);
  }
  execute(m.handle, m.fwd, uids, ptrs, workspace, "running the forward plan");
}

void CudnnAttention::backward(void* dq, void* dk, void* dv, const void* dout, const void* q, const void* k,
                              const void* v, const void* out, const float* lse, void* workspace, cudaStream_t stream) {
  Impl& m = *impl_;
  LOOM_CHECK(aligned16(dq) && aligned16(dk) && aligned16(dv) && aligned16(dout) && aligned16(q) && aligned16(k) &&
                 aligned16(v) && aligned16(out) && aligned16(lse),
             "cuDNN attention backward: dq, dk, dv, dout, q, k, v, out and lse must be 16-byte aligned ({})", m.shape);
  LOOM_CHECK(workspace && aligned16(workspace),
             "cuDNN attention backward: needs a 16-byte aligned workspace of {} bytes ({})", m.bwd_ws_bytes, m.shape);
  char* ws = static_cast<char*>(workspace);
  void* dsum = ws + m.bwd_ws_offset_dsum;
  void* dqacc = ws + m.bwd_ws_offset_dqacc;
  cudnn_check(cudnnSetStream(m.handle, stream), "setting the stream");
  std::vector<int64_t> uids = {kQ, kK, kV, kO, kDO, kStats, kDQ, kDK, kDV, kScale, kOne, kDsum, kDQAcc};
  std::vector<void*> ptrs = {const_cast<void*>(q),   const_cast<void*>(k),    const_cast<void*>(v),
                             const_cast<void*>(out), const_cast<void*>(dout), const_cast<float*>(lse),
                             dq,                     dk,                      dv,
                             &m.scale,               &m.one,                  dsum,
                             dqacc};
  if (m.a.causal) {
    uids.push_back(kNegInf);
    ptrs.push_back(&m.neg_inf);
  }
  execute(m.handle, m.bwd, uids, ptrs, m.bwd.workspace > 0 ? workspace : nullptr, "running the backward plan");
}

#endif  // LOOM_HAVE_CUDNN

}  // namespace loom::cuda
