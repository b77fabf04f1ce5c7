// Matrix multiply with bias, PyTorch Linear layout (weight [out, in]).
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "core/backend.h"
#include "core/memory.h"

namespace loom::cpu {

// C[M, N] = alpha * op(A) @ op(B) + beta * C, row-major, op = transpose when trans_* is set.
// A is [M, K] (or [K, M] when trans_a), B is [K, N] (or [N, K] when trans_b). oneDNN's sgemm:
// the ISA (AVX2, AVX-512) is chosen at run time; threads = the calling thread's OpenMP team.
// Bitwise reproducible for a fixed team size (and, measured at GPT-2 shapes, for 1 vs 2 threads).
void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
          int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc);

// out f32 [M, N] = inp f32 [M, K] @ weight f32 [N, K]^T + bias f32 [N] (bias may be null).
// The bias is written into out first and the GEMM accumulates onto it (beta = 1).
void matmul_forward(float* out, const float* inp, const float* weight, const float* bias, int64_t M,
                    int64_t K, int64_t N);

// dinp [M, K] (= or += by accumulate_dinp) dout [M, N] @ weight [N, K];
// dweight [N, K] += dout^T @ inp; dbias [N] += column sums of dout. Any of dinp, dweight, dbias
// may be null to skip it. dbias sums columns in a fixed order (thread-count independent).
void matmul_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                     const float* weight, int64_t M, int64_t K, int64_t N, bool accumulate_dinp = false);

// The linear layers' GEMMs with bf16 inputs and f32 accumulation and outputs (mixed precision as
// autocast does it: f32 weights, activations and gradients, rounded to bf16 on their way into a
// product), through oneDNN's matmul primitive (its AVX512-BF16 / AMX kernels). Same contract as
// matmul_forward / matmul_backward. The products run over blocks of at most 4096 output features
// (a vocabulary head's 50304 in 13), so the bf16 copies hold the input, one block of the weight's
// rows and one of the output gradient's columns. Each instance keeps its primitives (one per
// shape), those copies and oneDNN's scratch (tag workspace of `pool`); one instance per rank
// thread. Refuses (loom::Error) a CPU without bf16 dot products (core/dtype.h: cpu_bf16_missing).
class Bf16Matmul {
 public:
  explicit Bf16Matmul(MemoryPool& pool);
  ~Bf16Matmul();
  Bf16Matmul(const Bf16Matmul&) = delete;
  Bf16Matmul& operator=(const Bf16Matmul&) = delete;

  void forward(float* out, const float* inp, const float* weight, const float* bias, int64_t M, int64_t K, int64_t N);
  void backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp, const float* weight,
                int64_t M, int64_t K, int64_t N, bool accumulate_dinp = false);
  // Bytes the instance keeps (tag workspace) once calls of these shapes were made (its primitives
  // for them are made now).
  int64_t workspace_bytes(const std::vector<LinearShape>& shapes) const;
  // Gives back the bf16 copies and the scratch (later calls take them again).
  void release();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Measured fp32 GEMM rate of this machine in GFLOP/s for the calling thread's team: the best
// sustained rate (over windows of 3 calls, for at least `seconds`) of C[M, N] = A[M, K] B[K, N].
double measure_gemm_gflops(int64_t M, int64_t N, int64_t K, double seconds = 1.0);
// The same for square n x n products, the peak of model-FLOPs utilisation.
double measure_gemm_peak_gflops(int64_t n = 1536, double seconds = 1.0);
// The bf16 matmuls' rate (Bf16Matmul::forward, its f32 -> bf16 rounding of the operands included)
// for square n x n products, measured the same way; needs cpu_bf16_missing() == "".
double measure_bf16_gemm_peak_gflops(int64_t n = 1536, double seconds = 1.0);

}  // namespace loom::cpu
