#include "kernels/cuda/common.cuh"
#include "kernels/cuda/matmul.cuh"

#include <cublasLt.h>
#include <cublas_v2.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <tuple>
#include <type_traits>
#include <vector>


#define LOOM_CUBLAS_CHECK(expr)                                                                  \
  do {                                                                                           \
    cublasStatus_t st_ = (expr);                                                                 \
    if (st_ != CUBLAS_STATUS_SUCCESS) LOOM_FAIL("cuBLASLt error {} ({}) in {}", int(st_), cublasGetStatusString(st_), #expr); \
  } while (0)

namespace loom::cuda {
namespace {

bool is_f16(DType dtype, const char* what) {
  LOOM_CHECK(dtype == DType::bf16 || dtype == DType::f16, "{}: dtype {} is not bf16 or f16", what, dtype_name(dtype));
  return dtype == DType::f16;
}

constexpr size_t kWorkspaceBytes = size_t(32) << 20;

constexpr size_t kCublasWorkspaceBytes = kBlasCublasWorkspaceBytes;

int gemm_tuning();  // LOOM_GEMM_TUNE, below

}  // namespace

struct Blas::State {
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;
  cublasHandle_t cublas = nullptr;
  void* cublas_workspace = nullptr;
  std::mutex mu;
  // Heuristic choices by problem description (shapes, types, epilogue, alignments).
  std::map<std::vector<int64_t>, cublasLtMatmulAlgo_t> algos;
  std::set<std::vector<int64_t>> unsupported;  // try_only calls no algorithm supports
  std::map<std::vector<int64_t>, int> bias_paths;  // weight + bias gradient: 1 epilogue, 0 separate
  std::atomic<BiasGradPath> bias_grad_path{BiasGradPath::tuned};
  std::atomic<int64_t> epilogue_runs{0};
  int tune = 1;  // GEMM tuning: 0 off, 1 on, 2 on and verbose
};

Blas::Blas(MemoryPool& pool, int tune) : pool_(pool), s_(std::make_unique<State>()) {
  LOOM_CHECK(pool.device() == Device::cuda, "Blas: pool '{}' is not a device pool", pool.name().c_str());
  LOOM_CHECK(tune >= -1 && tune <= 2, "Blas: GEMM tuning mode {} (0 off, 1 on, 2 verbose, -1 LOOM_GEMM_TUNE)", tune);
  s_->tune = tune >= 0 ? tune : gemm_tuning();
  LOOM_CUDA_CHECK(cudaGetDevice(&device_));
  LOOM_CUBLAS_CHECK(cublasLtCreate(&s_->handle));
  try {
    s_->workspace = pool_.allocate(kWorkspaceBytes, MemTag::workspace);
  } catch (...) {
    cublasLtDestroy(s_->handle);
    throw;
  }
}

Blas::~Blas() {
  if (s_->cublas) cublasDestroy(s_->cublas);
  if (s_->cublas_workspace) pool_.deallocate(s_->cublas_workspace, kCublasWorkspaceBytes, MemTag::workspace);
  cublasLtDestroy(s_->handle);
  pool_.deallocate(s_->workspace, kWorkspaceBytes, MemTag::workspace);
}

cublasContext* Blas::cublas() {
  std::lock_guard lk(s_->mu);
  if (!s_->cublas) {
    s_->cublas_workspace = pool_.allocate(kCublasWorkspaceBytes, MemTag::workspace);
    if (cublasCreate(&s_->cublas) != CUBLAS_STATUS_SUCCESS) {
      pool_.deallocate(s_->cublas_workspace, kCublasWorkspaceBytes, MemTag::workspace);
      s_->cublas_workspace = nullptr;
      s_->cublas = nullptr;
      LOOM_FAIL("cuBLAS: cublasCreate failed on device {}", device_);
    }
  }
  return s_->cublas;
}

void* Blas::cublas_workspace() {
  (void)cublas();
  return s_->cublas_workspace;
}

void Blas::set_bias_grad_path(BiasGradPath p) { s_->bias_grad_path.store(p); }
BiasGradPath Blas::bias_grad_path() const { return s_->bias_grad_path.load(); }
int64_t Blas::bias_grad_epilogue_runs() const { return s_->epilogue_runs.load(); }

namespace {

using LtState = Blas::State;

int alignment_of(const void* p) {
  uintptr_t u = reinterpret_cast<uintptr_t>(p);
  int a = 256;
  while (a > 1 && (u % uintptr_t(a)) != 0) a /= 2;
  return a;
}

// One cuBLASLt call in column-major terms: D[m, n] = alpha op(A) op(B) + beta D, with an
// epilogue. A and B are bf16 (or f16 with f16 set); D is the same type or f32.
struct LtCall {
  bool ta = false, tb = false;
  bool f16 = false;  // the 16-bit operands (A, B, a 16-bit D, bias, aux) are f16 instead of bf16
  int64_t m = 0, n = 0, k = 0;
  const void* A = nullptr;
  int64_t lda = 0;
  const void* B = nullptr;
  int64_t ldb = 0;
  void* D = nullptr;
  int64_t ldd = 0;
  const void* C = nullptr;  // when set, the input C (D's layout) that beta scales; else D itself
  bool d_f32 = false;
  float alpha = 1.f, beta = 0.f;
  cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
  const void* bias = nullptr;
  bool bias_f32 = false;  // bias (or bias gradient) vector in f32 instead of the 16-bit type
  void* aux = nullptr;
  int64_t ld_aux = 0;
  bool try_only = false;  // return false instead of failing when no algorithm supports the call
};

// GEMM tuning (LOOM_GEMM_TUNE: unset or 1 = on, 0 = off, 2 = on and print each choice to stderr):
// the first time a problem is seen, cuBLASLt's heuristic offers up to kTuneCandidates algorithms
// and each is timed on the call's own operands; the fastest is kept for the problem when it beats
// the heuristic's first choice by more than kTuneMargin (else the first choice stays, so noise
// does not pick). Not while the stream is being captured into a graph (the heuristic's first
// choice then), nor for calls that no algorithm supports.
constexpr int kTuneCandidates = 8;
constexpr double kTuneMargin = 0.03;
// An accumulating call is timed on a scratch copy of its output, and the weight + bias gradient
// choice on scratch outputs; larger outputs than this are not timed (the heuristic's first
// choice, and the epilogue), so that tuning never asks the pool for more than this at once. For
// GPT-2 124M that leaves out only the tied lm_head's weight gradient (154 MB), 0.3% of the step.
constexpr size_t kTuneScratchBytes = size_t(32) << 20;

// Device scratch from the pool (workspace tag) for the length of a tuning, returned on any exit.
struct TuneScratch {
  MemoryPool& pool;
  void* p = nullptr;
  size_t bytes = 0;
  TuneScratch(MemoryPool& pool, size_t n) : pool(pool), p(pool.allocate(n, MemTag::workspace)), bytes(n) {}
  ~TuneScratch() { pool.deallocate(p, bytes, MemTag::workspace); }
  TuneScratch(const TuneScratch&) = delete;
  TuneScratch& operator=(const TuneScratch&) = delete;
};

struct EventPair {
  cudaEvent_t e0 = nullptr, e1 = nullptr;
  EventPair() {
    LOOM_CUDA_CHECK(cudaEventCreate(&e0));
    LOOM_CUDA_CHECK(cudaEventCreate(&e1));
  }
  ~EventPair() {
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
  }
  EventPair(const EventPair&) = delete;
  EventPair& operator=(const EventPair&) = delete;
};

int gemm_tuning() {
  static const int mode = [] {
    const char* e = std::getenv("LOOM_GEMM_TUNE");
    if (!e || !*e) return 1;
    const std::string v(e);
    LOOM_CHECK(v == "0" || v == "1" || v == "2", "LOOM_GEMM_TUNE='{}': must be 0 (off), 1 (on) or 2 (on, verbose)", v);
    return std::stoi(v);
  }();
  return mode;
}

// Median milliseconds of `run` (which enqueues work on stream and returns false when it cannot
// run) over kTuneRuns launches after one warm-up; infinity when it cannot run.
template <class Run>
double median_ms(Run&& run, cudaStream_t stream) {
  constexpr int kTuneRuns = 5;
  if (!run()) return INFINITY;
  EventPair ev;
  std::vector<double> ms;
  for (int i = 0; i < kTuneRuns && ms.size() == size_t(i); ++i) {
    LOOM_CUDA_CHECK(cudaEventRecord(ev.e0, stream));
    const bool ok = run();
    LOOM_CUDA_CHECK(cudaEventRecord(ev.e1, stream));
    LOOM_CUDA_CHECK(cudaEventSynchronize(ev.e1));
    float t = 0.f;
    LOOM_CUDA_CHECK(cudaEventElapsedTime(&t, ev.e0, ev.e1));
    if (ok) ms.push_back(t);
  }
  if (ms.size() != size_t(kTuneRuns)) return INFINITY;
  std::sort(ms.begin(), ms.end());
  return ms[kTuneRuns / 2];
}

cublasLtMatmulAlgo_t fastest_algo(Blas& blas, LtState& s, const LtCall& c, cublasLtMatmulDesc_t op, cublasLtMatrixLayout_t la,
                                  cublasLtMatrixLayout_t lb, cublasLtMatrixLayout_t ld,
                                  const cublasLtMatmulHeuristicResult_t* res, int found, cudaStream_t stream) {
  if (found < 2 || stream_capturing(stream)) return res[0].algo;
  // Timed in place when the call overwrites D (the real call then writes it again); an
  // accumulating call (beta != 0) is timed on a scratch copy so that D is added to once.
  const size_t d_bytes = (size_t(c.n - 1) * size_t(c.ldd) + size_t(c.m)) * (c.d_f32 ? 4 : 2);
  const bool accumulates = c.beta != 0.f && !c.C;
  if (accumulates && d_bytes > kTuneScratchBytes) return res[0].algo;
  std::unique_ptr<TuneScratch> scratch;
  void* D = c.D;
  if (accumulates) {
    scratch = std::make_unique<TuneScratch>(blas.pool(), d_bytes);
    D = scratch->p;
    LOOM_CUDA_CHECK(cudaMemcpyAsync(D, c.D, d_bytes, cudaMemcpyDeviceToDevice, stream));
  }
  std::vector<double> ms(size_t(found), INFINITY);
  for (int i = 0; i < found; ++i)
    ms[size_t(i)] = median_ms(
        [&] {
          return cublasLtMatmul(s.handle, op, &c.alpha, c.A, la, c.B, lb, &c.beta, c.C ? c.C : D, ld, D, ld, &res[i].algo,
                                s.workspace, kWorkspaceBytes, stream) == CUBLAS_STATUS_SUCCESS;
        },
        stream);
  LOOM_CUDA_CHECK(cudaStreamSynchronize(stream));
  int best = 0;
  for (int i = 1; i < found; ++i)
    if (ms[size_t(i)] < ms[size_t(best)]) best = i;
  if (!(ms[size_t(best)] < ms[0] * (1.0 - kTuneMargin))) best = 0;
  if (s.tune == 2)
    std::fprintf(stderr, "gemm tune m=%lld n=%lld k=%lld ta=%d tb=%d epilogue=%d beta=%g: heuristic %.4f ms, %d of %d "
                 "taken, %.4f ms\n", (long long)c.m, (long long)c.n, (long long)c.k, int(c.ta), int(c.tb),
                 int(c.epilogue), double(c.beta), ms[0], best, found, ms[size_t(best)]);
  return res[best].algo;
}

bool lt_matmul(Blas& blas, const LtCall& c, cudaStream_t stream) {
  LtState& s = blas.state();
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, ld = nullptr;
  const cudaDataType half_type = c.f16 ? CUDA_R_16F : CUDA_R_16BF;
  LOOM_CUBLAS_CHECK(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  cublasOperation_t ta = c.ta ? CUBLAS_OP_T : CUBLAS_OP_N, tb = c.tb ? CUBLAS_OP_T : CUBLAS_OP_N;
  LOOM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
  LOOM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
  LOOM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE, &c.epilogue, sizeof(c.epilogue)));
  if (c.bias) {
    LOOM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &c.bias, sizeof(c.bias)));
    cudaDataType bt = c.bias_f32 ? CUDA_R_32F : half_type;
    LOOM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt, sizeof(bt)));
  }
  if (c.aux) {
    LOOM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &c.aux, sizeof(c.aux)));
    LOOM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &c.ld_aux, sizeof(c.ld_aux)));
  }
  LOOM_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&la, half_type, c.ta ? c.k : c.m, c.ta ? c.m : c.k, c.lda));
  LOOM_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&lb, half_type, c.tb ? c.n : c.k, c.tb ? c.k : c.n, c.ldb));
  LOOM_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&ld, c.d_f32 ? CUDA_R_32F : half_type, c.m, c.n, c.ldd));

  const int al_a = alignment_of(c.A), al_b = alignment_of(c.B), al_d = alignment_of(c.D);
  const int al_bias = c.bias ? alignment_of(c.bias) : 256;
  const int al_c = c.C ? alignment_of(c.C) : 0;
  std::vector<int64_t> key{c.ta, c.tb, c.m, c.n, c.k, c.lda, c.ldb, c.ldd, c.d_f32, int64_t(c.epilogue),
                           c.bias != nullptr, c.bias_f32, c.ld_aux, al_a, al_b, al_d, al_bias, c.beta != 0.f, al_c,
                           c.f16};
  cublasLtMatmulAlgo_t algo;
  bool found_none = false;
  {
    std::lock_guard lk(s.mu);
    auto it = s.algos.find(key);
    if (it != s.algos.end()) {
      algo = it->second;
    } else if (s.unsupported.count(key)) {
      found_none = true;
    } else {
      cublasLtMatmulPreference_t pref = nullptr;
      LOOM_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
      size_t ws = kWorkspaceBytes;
      LOOM_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
      uint32_t a32 = uint32_t(al_a), b32 = uint32_t(al_b), d32 = uint32_t(al_d);
      const uint32_t c32 = c.C ? uint32_t(std::min(al_c, al_d)) : d32;  // a separate C may be less aligned
      LOOM_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &a32, 4));
      LOOM_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &b32, 4));
      LOOM_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &c32, 4));
      LOOM_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &d32, 4));
      cublasLtMatmulHeuristicResult_t res[kTuneCandidates]{};
      int found = 0;
      const int want = s.tune != 0 ? kTuneCandidates : 1;
      cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(s.handle, op, la, lb, ld, ld, pref, want, res, &found);
      cublasLtMatmulPreferenceDestroy(pref);
      if ((st != CUBLAS_STATUS_SUCCESS || found == 0) && c.try_only) {
        s.unsupported.insert(key);
        found_none = true;
      } else if (st != CUBLAS_STATUS_SUCCESS || found == 0) {
        LOOM_FAIL("cuBLASLt found no algorithm for m={} n={} k={} ta={} tb={} lda={} ldb={} ldd={} f32_out={} "
                  "epilogue={} (status {})", c.m, c.n, c.k, c.ta, c.tb, c.lda, c.ldb, c.ldd, c.d_f32,
                  int(c.epilogue), int(st));
      } else {
        algo = fastest_algo(blas, s, c, op, la, lb, ld, res, found, stream);
        s.algos.emplace(key, algo);
      }
    }
  }
  if (found_none) {
    cublasLtMatrixLayoutDestroy(la);
    cublasLtMatrixLayoutDestroy(lb);
    cublasLtMatrixLayoutDestroy(ld);
    cublasLtMatmulDescDestroy(op);
    return false;
  }
  const cublasStatus_t run = cublasLtMatmul(s.handle, op, &c.alpha, c.A, la, c.B, lb, &c.beta, c.C ? c.C : c.D, ld, c.D, ld, &algo,
                                            s.workspace, kWorkspaceBytes, stream);
  if (run == CUBLAS_STATUS_NOT_SUPPORTED && c.try_only) {
    std::lock_guard lk(s.mu);
    s.algos.erase(key);
    s.unsupported.insert(key);
  } else {
    LOOM_CUBLAS_CHECK(run);
  }
  cublasLtMatrixLayoutDestroy(la);
  cublasLtMatrixLayoutDestroy(lb);
  cublasLtMatrixLayoutDestroy(ld);
  cublasLtMatmulDescDestroy(op);
  return run == CUBLAS_STATUS_SUCCESS;
}

// Bias gradient (column sums of a bf16 or f16 [M, N] matrix) in two deterministic kernels. The first
// splits the rows into R chunks (grid y) and the columns into tiles of kBiasCols (grid x); a block
// is kBiasRows rows of 32 threads, each thread summing 8 adjacent columns (one 16-byte load per
// row) over the rows r = its row, + kBiasRows, ... of its chunk; the block adds its rows in order
// into partial[chunk, col]. The second sums the R chunks in order.
constexpr int kBiasCols = 256;  // 32 threads x 8 columns
constexpr int kBiasRows = 8;

int64_t bias_row_chunks(int64_t M) { return std::min<int64_t>(64, ceil_div(M, 64)); }

template <class T>
__global__ void bias_grad_partial_kernel(float* partial, const T* __restrict__ x, int64_t M, int64_t N,
                                         int64_t rows_per_chunk) {
  __shared__ float sums[kBiasRows][kBiasCols + 1];
  const int64_t col = int64_t(blockIdx.x) * kBiasCols + threadIdx.x * 8;
  const int64_t r0 = int64_t(blockIdx.y) * rows_per_chunk, r1 = min(M, r0 + rows_per_chunk);
  float s[8] = {};
  if (col < N) {
#pragma unroll 4
    for (int64_t i = r0 + threadIdx.y; i < r1; i += kBiasRows) {
      const Vec8<T> v = *reinterpret_cast<const Vec8<T>*>(x + i * N + col);
#pragma unroll
      for (int k = 0; k < 8; ++k) s[k] += to_f32(v.v[k]);
    }
  }
#pragma unroll
  for (int k = 0; k < 8; ++k) sums[threadIdx.y][threadIdx.x * 8 + k] = s[k];
  __syncthreads();
  // 256 threads, one column of the tile each: the rows' sums in order.
  const int t = threadIdx.y * 32 + threadIdx.x;
  const int64_t c = int64_t(blockIdx.x) * kBiasCols + t;
  if (c >= N) return;
  float total = 0.f;
#pragma unroll
  for (int r = 0; r < kBiasRows; ++r) total += sums[r][t];
  partial[int64_t(blockIdx.y) * N + c] = total;
}

// dbias[col] += the sum over r of partial[r, col]: a block takes 32 columns (coalesced loads) and
// kReduceRows thread rows, each summing the chunks r, r + kReduceRows, ...; row 0 adds the rows in
// order.
constexpr int kReduceRows = 16;

__global__ void bias_grad_reduce_kernel(float* dbias, const float* __restrict__ partial, int64_t R, int64_t N) {
  __shared__ float rows[kReduceRows][33];
  const int64_t col = int64_t(blockIdx.x) * 32 + threadIdx.x;
  float s = 0.f;
  if (col < N)
    for (int64_t r = threadIdx.y; r < R; r += kReduceRows) s += partial[r * N + col];
  rows[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y != 0 || col >= N) return;
  for (int r = 1; r < kReduceRows; ++r) s += rows[r][threadIdx.x];
  dbias[col] += s;
}

__global__ void accumulate_kernel(float* dst, const float* src, int64_t n) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) dst[i] += src[i];
}

// The weight gradient c (accumulating, f32) with the bias gradient from the GEMM's BGRADB epilogue
// (column sums of dout into scratch, then added: the epilogue writes rather than accumulates);
// false, with nothing run, when no algorithm takes the call.
bool run_dweight_bgradb(Blas& blas, const MatmulBwdArgs& a, const LtCall& c, float* dbias, cudaStream_t stream) {
  LtCall cb = c;
  cb.epilogue = CUBLASLT_EPILOGUE_BGRADB;
  cb.bias = a.dbias_scratch;
  cb.bias_f32 = true;
  cb.try_only = true;
  if (!lt_matmul(blas, cb, stream)) return false;
  accumulate_kernel<<<unsigned(ceil_div(a.N, 256)), 256, 0, stream>>>(dbias, a.dbias_scratch, a.N);
  LOOM_CUDA_LAUNCH_CHECK();
  blas.state().epilogue_runs.fetch_add(1);
  return true;
}

// Weight and bias gradient together: through the epilogue (run_dweight_bgradb), or a plain GEMM
// and bias_grad after it. The epilogue saves a pass over dout but rules out the split-K
// algorithms that a weight gradient with few output tiles and a long K (GPT-2's: K = B T) runs
// fastest with. So the first time a problem is seen (with GEMM tuning on, the stream not being
// captured) both are timed on scratch outputs and the faster is kept for the problem; otherwise
// the epilogue, where an algorithm takes it. Returns true when the epilogue ran the call.
bool fused_bias_grad(Blas& blas, const MatmulBwdArgs& a, const LtCall& c, cudaStream_t stream) {
  LtState& s = blas.state();
  const std::vector<int64_t> key{a.M, a.N, a.K, alignment_of(a.inp), alignment_of(a.dout), alignment_of(a.dweight),
                                 a.dtype == DType::f16};
  const BiasGradPath forced = blas.bias_grad_path();
  if (forced != BiasGradPath::tuned)
    return forced == BiasGradPath::epilogue && run_dweight_bgradb(blas, a, c, a.dbias, stream);
  int choice = -1;  // 1: epilogue, 0: separate
  {
    std::lock_guard lk(s.mu);
    auto it = s.bias_paths.find(key);
    if (it != s.bias_paths.end()) choice = it->second;
  }
  const size_t w_floats = size_t(a.K) * size_t(a.N);
  const size_t scratch_bytes = (w_floats + size_t(a.N)) * sizeof(float);
  if (choice < 0 && s.tune != 0 && scratch_bytes <= kTuneScratchBytes && !stream_capturing(stream)) {
    TuneScratch scratch(blas.pool(), scratch_bytes);
    auto* w = static_cast<float*>(scratch.p);
    float* db = w + w_floats;
    LOOM_CUDA_CHECK(cudaMemsetAsync(w, 0, scratch_bytes, stream));
    LtCall cw = c;
    cw.D = w;
    const double fused = median_ms([&] { return run_dweight_bgradb(blas, a, cw, db, stream); }, stream);
    const double separate = median_ms(
        [&] {
          lt_matmul(blas, cw, stream);
          bias_grad(a.dtype, db, a.dout, a.M, a.N, a.dbias_scratch, stream);
          return true;
        },
        stream);
    LOOM_CUDA_CHECK(cudaStreamSynchronize(stream));
    choice = fused < separate * (1.0 + kTuneMargin) ? 1 : 0;
    if (s.tune == 2)
      std::fprintf(stderr, "gemm tune dweight+dbias M=%lld N=%lld K=%lld: epilogue %.4f ms, GEMM + bias_grad %.4f ms: %s\n",
                   (long long)a.M, (long long)a.N, (long long)a.K, fused, separate, choice ? "epilogue" : "separate");
    std::lock_guard lk(s.mu);
    s.bias_paths.emplace(key, choice);
  }
  if (choice == 0) return false;
  return run_dweight_bgradb(blas, a, c, a.dbias, stream);
}

}  // namespace

int64_t matmul_dbias_scratch_floats(int64_t N) { return 64 * N; }

template <class T>
void bias_grad(float* dbias, const T* x, int64_t M, int64_t N, float* scratch, cudaStream_t stream) {
  LOOM_CHECK(N % 8 == 0, "bias_grad: N = {} must be a multiple of 8", N);
  LOOM_CHECK(scratch != nullptr, "bias_grad: scratch is null");
  if (M == 0 || N == 0) return;
  const int64_t R = bias_row_chunks(M);
  const int64_t rows = ceil_div(M, R);
  dim3 grid(unsigned(ceil_div(N, kBiasCols)), unsigned(R));
  bias_grad_partial_kernel<T><<<grid, dim3(32, kBiasRows), 0, stream>>>(scratch, x, M, N, rows);
  LOOM_CUDA_LAUNCH_CHECK();
  bias_grad_reduce_kernel<<<unsigned(ceil_div(N, 32)), dim3(32, kReduceRows), 0, stream>>>(dbias, scratch, R, N);
  LOOM_CUDA_LAUNCH_CHECK();
}

template void bias_grad<bf16>(float*, const bf16*, int64_t, int64_t, float*, cudaStream_t);
template void bias_grad<f16>(float*, const f16*, int64_t, int64_t, float*, cudaStream_t);

void bias_grad(DType dtype, float* dbias, const void* x, int64_t M, int64_t N, float* scratch, cudaStream_t stream) {
  LOOM_CUDA_DISPATCH_16(dtype, "bias_grad", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    bias_grad(dbias, static_cast<const T*>(x), M, N, scratch, stream);
  });
}

void matmul_forward(Blas& blas, const MatmulFwdArgs& a, cudaStream_t stream) {
  LOOM_CHECK(a.out && a.inp && a.weight, "matmul_forward: out, inp and weight must be set");
  LOOM_CHECK(a.M > 0 && a.K > 0 && a.N > 0, "matmul_forward: bad sizes M={} K={} N={}", a.M, a.K, a.N);
  LOOM_CHECK(a.K % 8 == 0 && a.N % 8 == 0, "matmul_forward: K={} and N={} must be multiples of 8", a.K, a.N);
  LOOM_CHECK(!a.gelu || a.pre_gelu, "matmul_forward: the GELU epilogue needs pre_gelu");
  LOOM_CHECK(!(a.gelu && a.residual), "matmul_forward: a residual with the GELU epilogue");
  LtCall c;
  c.f16 = is_f16(a.dtype, "matmul_forward");
  c.ta = true;
  c.tb = false;
  c.m = a.N;
  c.n = a.M;
  c.k = a.K;
  c.A = a.weight;
  c.lda = a.K;
  c.B = a.inp;
  c.ldb = a.K;
  c.D = a.out;
  c.ldd = a.N;
  c.bias = a.bias;
  if (a.gelu) {
    c.epilogue = a.bias ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX;
    c.aux = a.pre_gelu;
    c.ld_aux = a.N;
  } else {
    c.epilogue = a.bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
  }
  if (a.residual) {  // D = W x + bias + residual: the residual read as the GEMM's C
    c.C = a.residual;
    c.beta = 1.f;
  }
  lt_matmul(blas, c, stream);
}

void matmul_backward(Blas& blas, const MatmulBwdArgs& a, cudaStream_t stream) {
  LOOM_CHECK(a.dout, "matmul_backward: dout must be set");
  const bool f16 = is_f16(a.dtype, "matmul_backward");
  LOOM_CHECK(a.K % 8 == 0 && a.N % 8 == 0, "matmul_backward: K={} and N={} must be multiples of 8", a.K, a.N);
  if (a.dinp) {
    LOOM_CHECK(a.weight, "matmul_backward: dinp needs weight");
    LtCall c;
    c.f16 = f16;
    c.m = a.K;
    c.n = a.M;
    c.k = a.N;
    c.A = a.weight;
    c.lda = a.K;
    c.B = a.dout;
    c.ldb = a.N;
    c.D = a.dinp;
    c.ldd = a.K;
    LOOM_CHECK(!(a.accumulate_dinp && a.dinp_gelu_pre), "matmul_backward: accumulate_dinp with dinp_gelu_pre");
    if (a.accumulate_dinp) c.beta = 1.f;
    if (a.dinp_gelu_pre) {
      c.epilogue = CUBLASLT_EPILOGUE_DGELU;
      c.aux = const_cast<void*>(a.dinp_gelu_pre);
      c.ld_aux = a.K;
    }
    lt_matmul(blas, c, stream);
  }
  if (a.dweight) {
    LOOM_CHECK(a.inp, "matmul_backward: dweight needs inp");
    LtCall c;
    c.f16 = f16;
    c.tb = true;
    c.m = a.K;
    c.n = a.N;
    c.k = a.M;
    c.A = a.inp;
    c.lda = a.K;
    c.B = a.dout;
    c.ldb = a.N;
    c.D = a.dweight;
    c.ldd = a.K;
    c.d_f32 = true;
    c.beta = 1.f;
    if (a.dbias && a.dbias_scratch && fused_bias_grad(blas, a, c, stream)) return;
    lt_matmul(blas, c, stream);
    if (a.dbias) bias_grad(a.dtype, a.dbias, a.dout, a.M, a.N, a.dbias_scratch, stream);
    return;
  }
  if (a.dbias) bias_grad(a.dtype, a.dbias, a.dout, a.M, a.N, a.dbias_scratch, stream);
}

template <class T>
void gemm(Blas& blas, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const T* A, int64_t lda,
          const T* B, int64_t ldb, float beta, void* C, int64_t ldc, bool c_f32, cudaStream_t stream) {
  LtCall c;
  c.f16 = std::is_same_v<T, f16>;
  c.ta = trans_b;
  c.tb = trans_a;
  c.m = N;
  c.n = M;
  c.k = K;
  c.A = B;
  c.lda = ldb;
  c.B = A;
  c.ldb = lda;
  c.D = C;
  c.ldd = ldc;
  c.d_f32 = c_f32;
  c.alpha = alpha;
  c.beta = beta;
  lt_matmul(blas, c, stream);
}

template void gemm<bf16>(Blas&, bool, bool, int64_t, int64_t, int64_t, float, const bf16*, int64_t, const bf16*,
                         int64_t, float, void*, int64_t, bool, cudaStream_t);
template void gemm<f16>(Blas&, bool, bool, int64_t, int64_t, int64_t, float, const f16*, int64_t, const f16*, int64_t,
                        float, void*, int64_t, bool, cudaStream_t);

namespace {

template <class T>
double measure_gemm_peak_of(Blas& blas, cudaStream_t stream, int64_t n, double seconds) {
  MemoryPool& pool = blas.pool();
  const size_t elems = size_t(n * n), bytes = elems * sizeof(T);
  std::vector<T> host(elems);
  for (size_t i = 0; i < elems; ++i)
    host[i] = from_f32<T>(float(int((i * 2654435761u) >> 7 & 255) - 128) / 128.f);  // exact in bf16 and f16
  // The buffers and events are released on every path, after the stream drained.
  struct Scratch {
    MemoryPool& pool;
    cudaStream_t stream;
    size_t bytes;
    T* buf[3] = {};
    cudaEvent_t ev[2] = {};
    ~Scratch() {
      cudaStreamSynchronize(stream);
      for (cudaEvent_t e : ev)
        if (e) cudaEventDestroy(e);
      for (T* p : buf)
        if (p) pool.deallocate(p, bytes, MemTag::workspace);
    }
  } s{pool, stream, bytes};
  for (T*& p : s.buf) p = static_cast<T*>(pool.allocate(bytes, MemTag::workspace));
  T *a = s.buf[0], *b = s.buf[1], *c = s.buf[2];
  LOOM_CUDA_CHECK(cudaMemcpyAsync(a, host.data(), bytes, cudaMemcpyHostToDevice, stream));
  LOOM_CUDA_CHECK(cudaMemcpyAsync(b, host.data(), bytes, cudaMemcpyHostToDevice, stream));
  LOOM_CUDA_CHECK(cudaEventCreate(&s.ev[0]));
  LOOM_CUDA_CHECK(cudaEventCreate(&s.ev[1]));
  auto run = [&] { gemm(blas, false, true, n, n, n, 1.f, a, n, b, n, 0.f, c, n, false, stream); };
  for (int i = 0; i < 3; ++i) run();
  LOOM_CUDA_CHECK(cudaStreamSynchronize(stream));
  int64_t iters = 0;
  float ms = 0;
  LOOM_CUDA_CHECK(cudaEventRecord(s.ev[0], stream));
  while (ms < seconds * 1e3) {
    for (int i = 0; i < 10; ++i) run();
    iters += 10;
    LOOM_CUDA_CHECK(cudaEventRecord(s.ev[1], stream));
    LOOM_CUDA_CHECK(cudaEventSynchronize(s.ev[1]));
    LOOM_CUDA_CHECK(cudaEventElapsedTime(&ms, s.ev[0], s.ev[1]));
  }
  return 2.0 * double(n) * double(n) * double(n) * double(iters) / (double(ms) * 1e-3);
}

}  // namespace

double measure_gemm_peak(Blas& blas, cudaStream_t stream, DType dtype, int64_t n, double seconds) {
  LOOM_CHECK(n > 0 && n <= 65536, "measure_gemm_peak: n = {} must be in [1, 65536]", n);
  LOOM_CHECK(seconds > 0 && std::isfinite(seconds), "measure_gemm_peak: seconds = {} must be positive", seconds);
  LOOM_CHECK(blas.pool().device() == Device::cuda, "measure_gemm_peak: pool '{}' is not a device pool",
             blas.pool().name().c_str());
  return is_f16(dtype, "measure_gemm_peak") ? measure_gemm_peak_of<f16>(blas, stream, n, seconds)
                                            : measure_gemm_peak_of<bf16>(blas, stream, n, seconds);
}

}  // namespace loom::cuda
