// Matrix multiply through cuBLASLt, PyTorch Linear layout (weight [out, in]), row-major: bf16 or f16
// inputs, f32 accumulation, bias and GELU fused into the GEMM's epilogue, weight gradients
// accumulated in f32.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>

#include "core/memory.h"
#include "kernels/cuda/common.cuh"

struct cublasContext;  // cublas_v2.h's cublasHandle_t is a cublasContext*

namespace loom::cuda {

// How matmul_backward computes a bias gradient together with a weight gradient: tuned (the
// default: both ways timed per problem on first use, with LOOM_GEMM_TUNE on; the epilogue when
// it is off), always the GEMM's BGRADB epilogue (where an algorithm takes it), or always a plain
// GEMM and bias_grad. For tests and benchmarks.
enum class BiasGradPath : uint8_t { tuned, epilogue, separate };

// The BLAS state of one backend instance, on the device that was current when it was made: the
// cuBLASLt handle and its 32 MiB workspace, the algorithm chosen (and timed) per problem, the
// bias-gradient path chosen per problem, and, made on first use, a cuBLAS handle with a workspace
// of its own (the GEMM attention's batched products). Workspaces come from `pool` (a device pool)
// under tag workspace. One instance serves one thread at a time; ranks that are threads each keep
// their own, so no handle, workspace or cache is shared between streams.
constexpr size_t kBlasCublasWorkspaceBytes = size_t(32) << 20;

class Blas {
 public:
  // tune: GEMM tuning for this instance (0 off, 1 on, 2 on and verbose; -1: LOOM_GEMM_TUNE).
  explicit Blas(MemoryPool& pool, int tune = -1);
  ~Blas();
  Blas(const Blas&) = delete;
  Blas& operator=(const Blas&) = delete;

  MemoryPool& pool() const { return pool_; }
  int device() const { return device_; }
  // The cuBLAS handle (created, with its workspace, on the first call: make it before capturing a
  // CUDA graph) and its workspace.
  cublasContext* cublas();
  void* cublas_workspace();
  // Applies to this instance's later calls.
  void set_bias_grad_path(BiasGradPath p);
  BiasGradPath bias_grad_path() const;
  // How many weight + bias gradients the epilogue has computed through this instance (for tests:
  // which way a call went).
  int64_t bias_grad_epilogue_runs() const;

  struct State;
  State& state() { return *s_; }

 private:
  MemoryPool& pool_;
  int device_ = 0;
  std::unique_ptr<State> s_;
};

// The 16-bit operands of the two structs below are `dtype`: bf16, or f16 under train.precision
// fp16 (pointers to either type convert to the fields).
struct MatmulFwdArgs {
  void* out = nullptr;           // [M, N]; with gelu: gelu(inp @ W^T + bias)
  void* pre_gelu = nullptr;      // [M, N], inp @ W^T + bias before GELU (written when gelu)
  const void* inp = nullptr;     // [M, K]
  const void* weight = nullptr;  // [N, K]
  const void* bias = nullptr;    // [N] or null
  int64_t M = 0, K = 0, N = 0;
  bool gelu = false;                 // tanh-form GELU epilogue (needs pre_gelu for the backward)
  const void* residual = nullptr;    // [M, N] added to the output in the epilogue (not with gelu)
  DType dtype = DType::bf16;         // bf16 or f16
};
void matmul_forward(Blas& blas, const MatmulFwdArgs& a, cudaStream_t stream);

struct MatmulBwdArgs {
  void* dinp = nullptr;          // [M, K] written = dout @ W (null to skip)
  float* dweight = nullptr;      // f32 [N, K] += dout^T @ inp (null to skip)
  float* dbias = nullptr;        // f32 [N] += column sums of dout (null to skip)
  const void* dout = nullptr;    // [M, N]
  const void* inp = nullptr;     // [M, K]
  const void* weight = nullptr;  // [N, K]
  // When set, dinp = (dout @ W) * gelu'(dinp_gelu_pre): the backward of a GELU that produced inp
  // from dinp_gelu_pre ([M, K]), fused into the GEMM's epilogue.
  const void* dinp_gelu_pre = nullptr;
  int64_t M = 0, K = 0, N = 0;
  float* dbias_scratch = nullptr;  // f32, at least matmul_dbias_scratch_floats(N) (when dbias)
  bool accumulate_dinp = false;    // dinp += dout @ W instead of = (not with dinp_gelu_pre)
  DType dtype = DType::bf16;       // bf16 or f16
};
int64_t matmul_dbias_scratch_floats(int64_t N);
void matmul_backward(Blas& blas, const MatmulBwdArgs& a, cudaStream_t stream);

// dbias f32 [N] += column sums of x (bf16 or f16 [M, N]); deterministic (fixed reduction order).
template <class T>
void bias_grad(float* dbias, const T* x, int64_t M, int64_t N, float* scratch, cudaStream_t stream);
void bias_grad(DType dtype, float* dbias, const void* x, int64_t M, int64_t N, float* scratch, cudaStream_t stream);

// Plain GEMM on row-major 16-bit operands (T: bf16 or f16) with f32 or T output:
// C[M, N] = alpha * op(A) @ op(B) + beta * C. A is [M, K] (or [K, M] when trans_a), B is [K, N]
// (or [N, K] when trans_b). C is f32 when c_f32, else T.
template <class T>
void gemm(Blas& blas, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const T* A, int64_t lda,
          const T* B, int64_t ldb, float beta, void* C, int64_t ldc, bool c_f32, cudaStream_t stream);

// The GEMM rate of this GPU for `dtype` (bf16 or f16) in FLOP/s, for model-FLOPs utilisation:
// n x n x n products through gemm (16-bit operands and output, f32 accumulation: the kernels the
// linear layers run), timed with events on `stream` over about `seconds` after a warm-up. The
// operands hold a fixed pattern of values in [-1, 1) (tensor cores draw less power on zeros,
// which would flatter the rate); their 3 n^2 elements come from blas.pool() under the workspace
// tag and are given back.
double measure_gemm_peak(Blas& blas, cudaStream_t stream, DType dtype = DType::bf16, int64_t n = 4096,
                         double seconds = 0.25);

}  // namespace loom::cuda
