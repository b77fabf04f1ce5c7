// Matrix multiply through cuBLASLt, PyTorch Linear layout (weight [out, in]), row-major: bf16
// inputs, f32 accumulation, bias and GELU fused into the GEMM's epilogue, weight gradients
// accumulated in f32.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "core/memory.h"
#include "kernels/cuda/common.cuh"

namespace loom::cuda {

struct MatmulFwdArgs {
  bf16* out = nullptr;         // bf16 [M, N]; with gelu: gelu(inp @ W^T + bias)
  bf16* pre_gelu = nullptr;    // bf16 [M, N], inp @ W^T + bias before GELU (written when gelu)
  const bf16* inp = nullptr;   // bf16 [M, K]
  const bf16* weight = nullptr;  // bf16 [N, K]
  const bf16* bias = nullptr;  // bf16 [N] or null
  int64_t M = 0, K = 0, N = 0;
  bool gelu = false;           // tanh-form GELU epilogue (needs pre_gelu for the backward)
};
void matmul_forward(const MatmulFwdArgs& a, cudaStream_t stream);

struct MatmulBwdArgs {
  bf16* dinp = nullptr;          // bf16 [M, K] written = dout @ W (null to skip)
  float* dweight = nullptr;      // f32 [N, K] += dout^T @ inp (null to skip)
  float* dbias = nullptr;        // f32 [N] += column sums of dout (null to skip)
  const bf16* dout = nullptr;    // bf16 [M, N]
  const bf16* inp = nullptr;     // bf16 [M, K]
  const bf16* weight = nullptr;  // bf16 [N, K]
  // When set, dinp = (dout @ W) * gelu'(dinp_gelu_pre): the backward of a GELU that produced inp
  // from dinp_gelu_pre (bf16 [M, K]), fused into the GEMM's epilogue.
  const bf16* dinp_gelu_pre = nullptr;
  int64_t M = 0, K = 0, N = 0;
  float* dbias_scratch = nullptr;  // f32, at least matmul_dbias_scratch_floats(N) (when dbias)
};
int64_t matmul_dbias_scratch_floats(int64_t N);
void matmul_backward(const MatmulBwdArgs& a, cudaStream_t stream);

// How matmul_backward computes a bias gradient together with a weight gradient: tuned (the
// default: both ways timed per problem on first use, with LOOM_GEMM_TUNE on; the epilogue when
// it is off), always the GEMM's BGRADB epilogue (where an algorithm takes it), or always a plain
// GEMM and bias_grad. For tests and benchmarks; applies to every later call.
enum class BiasGradPath : uint8_t { tuned, epilogue, separate };
void set_bias_grad_path(BiasGradPath p);
// How many weight + bias gradients the epilogue has computed in this process (for tests: which
// way a call went).
int64_t bias_grad_epilogue_runs();

// dbias f32 [N] += column sums of x bf16 [M, N]; deterministic (fixed reduction order).
void bias_grad(float* dbias, const bf16* x, int64_t M, int64_t N, float* scratch, cudaStream_t stream);

// Plain GEMM on row-major bf16 operands with f32 or bf16 output:
// C[M, N] = alpha * op(A) @ op(B) + beta * C. A is [M, K] (or [K, M] when trans_a), B is [K, N]
// (or [N, K] when trans_b). C is f32 when c_f32, else bf16.
void gemm_bf16(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const bf16* A,
               int64_t lda, const bf16* B, int64_t ldb, float beta, void* C, int64_t ldc, bool c_f32,
               cudaStream_t stream);

// The bf16 GEMM rate of this GPU in FLOP/s, for model-FLOPs utilisation: n x n x n products
// through gemm_bf16 (bf16 operands and output, f32 accumulation: the kernels the linear layers
// run), timed with events on `stream` over about `seconds` after a warm-up. The operands hold a
// fixed pattern of values in [-1, 1) (tensor cores draw less power on zeros, which would flatter
// the rate); their 3 n^2 bf16 come from `pool` under the workspace tag and are given back.
double measure_gemm_peak_bf16(MemoryPool& pool, cudaStream_t stream, int64_t n = 4096, double seconds = 0.25);

// The cuBLASLt workspace (32 MiB, from the device pool under the workspace tag) is created at first
// use; call this before capturing a CUDA graph so nothing is allocated during capture.
void matmul_init();

}  // namespace loom::cuda
