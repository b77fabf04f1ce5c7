// Times loom's flash attention (forward, and backward including its D preprocessing and dq
// conversion) and loom's cuDNN fused-attention path (kernels/cuda/cudnn_attention.cuh, the same
// arguments) on the shapes of the FlashAttention-2 paper's benchmark: 16k tokens per batch
// (B, T) in {(16, 1024), (4, 4096), (1, 16384)}, hidden size 2048 (HS 64 -> 32 heads, HS 128 -> 16
// heads), bf16, causal, q/k/v/out as separate [B, T, NH, HS] tensors.
// FLOP convention (FlashAttention-2's): forward 4 * B * NH * T^2 * HS, halved when causal;
// backward 2.5x forward. Times are CUDA-event medians over --reps runs after --warmup runs.
//   bench_flash [--reps N] [--warmup N] [--hs 64,128] [--causal 0|1] [--cudnn 0|1]
// Prints one line per shape and path: "loom_flash hs=.. B=.. T=.. NH=.. causal=.. fwd_ms=..
// fwd_tflops=.. bwd_ms=.. bwd_tflops=..", then the same with "loom_cudnn" (unless --cudnn 0 or
// loom was built without cuDNN) and a "# loom_cudnn ..." line with the engines cuDNN chose and the
// largest differences of its out, lse, dq, dk, dv from loom's flash kernels on the same inputs
// (relative to the largest flash value). A shape cuDNN refuses gets a "# loom_cudnn ...
// unavailable: <why>" line instead.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "core/error.h"
#include "kernels/cuda/attention.cuh"
#include "kernels/cuda/cudnn_attention.cuh"

namespace {

using loom::cuda::bf16;

// Uniform values in [lo, hi) from a hash of the index (fresh per seed, never all zeros).
__global__ void fill_random(bf16* x, int64_t n, uint32_t seed, float lo, float hi) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 0x9E3779B1u ^ (uint32_t(i >> 32) + seed) * 0x85EBCA77u;
    h ^= h >> 15;
    h *= 0x2C1B3C6Du;
    h ^= h >> 12;
    h *= 0x297A2D39u;
    h ^= h >> 15;
    x[i] = __float2bfloat16(lo + (hi - lo) * float(h >> 8) * (1.f / 16777216.f));
  }
}

// out[0] = max |a - b| and out[1] = max |b| over n elements, as float bits (non-negative floats
// order like their bits; out zeroed by the caller).
template <class T>
__global__ void max_abs_diff(const T* a, const T* b, int64_t n, unsigned* out) {
  float d = 0.f, m = 0.f;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float x = float(a[i]), y = float(b[i]);
    d = fmaxf(d, (isfinite(x) && isfinite(y)) || x == y ? fabsf(x - y) : INFINITY);
    m = fmaxf(m, fabsf(y));
  }
  atomicMax(out, __float_as_uint(d));
  atomicMax(out + 1, __float_as_uint(m));
}

#define CHECK(expr)                                                                               \
  do {                                                                                            \
    cudaError_t e_ = (expr);                                                                      \
    if (e_ != cudaSuccess) {                                                                      \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #expr, cudaGetErrorString(e_)); \
      std::exit(1);                                                                               \
    }                                                                                             \
  } while (0)

template <class F>
float median_ms(F&& fn, int warmup, int reps) {
  for (int i = 0; i < warmup; ++i) fn();
  CHECK(cudaDeviceSynchronize());
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  std::vector<float> ms(static_cast<size_t>(reps));
  for (int i = 0; i < reps; ++i) {
    CHECK(cudaEventRecord(a));
    fn();
    CHECK(cudaEventRecord(b));
    CHECK(cudaEventSynchronize(b));
    float t = 0.f;
    CHECK(cudaEventElapsedTime(&t, a, b));
    ms[size_t(i)] = t;
  }
  CHECK(cudaEventDestroy(a));
  CHECK(cudaEventDestroy(b));
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  int reps = 30, warmup = 5, causal = 1, use_cudnn = loom::cuda::cudnn_available();
  std::vector<int> head_sizes = {64, 128};
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto next = [&]() -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "bench_flash: %s needs a value\n", arg.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (arg == "--reps") {
      reps = std::max(1, std::atoi(next()));
    } else if (arg == "--warmup") {
      warmup = std::max(0, std::atoi(next()));
    } else if (arg == "--causal") {
      causal = std::atoi(next()) != 0;
    } else if (arg == "--cudnn") {
      use_cudnn = std::atoi(next()) != 0;
    } else if (arg == "--hs") {
      head_sizes.clear();
      std::string s = next();
      for (size_t p = 0; p < s.size();) {
        const size_t q = s.find(',', p);
        head_sizes.push_back(std::atoi(s.substr(p, q - p).c_str()));
        p = q == std::string::npos ? s.size() : q + 1;
      }
    } else {
      std::fprintf(stderr, "usage: bench_flash [--reps N] [--warmup N] [--hs 64,128] [--causal 0|1] [--cudnn 0|1]\n");
      return 2;
    }
  }
  int dev = 0;
  cudaDeviceProp prop{};
  CHECK(cudaGetDevice(&dev));
  CHECK(cudaGetDeviceProperties(&prop, dev));
  std::printf("# device: %s, %d SMs; reps %d, warmup %d; cuDNN %lld\n", prop.name, prop.multiProcessorCount, reps,
              warmup, (long long)loom::cuda::cudnn_runtime_version());
  unsigned* diff = nullptr;  // [2]: max |a - b|, max |b| (float bits)
  CHECK(cudaMalloc(&diff, 2 * sizeof(unsigned)));
  // Largest |a - b| relative to the largest |b| (b: loom flash's result).
  auto rel_diff = [&](auto* a, auto* b, int64_t n) {
    CHECK(cudaMemset(diff, 0, 2 * sizeof(unsigned)));
    max_abs_diff<<<1024, 256>>>(a, b, n, diff);
    CHECK(cudaGetLastError());
    unsigned h[2];
    CHECK(cudaMemcpy(h, diff, sizeof h, cudaMemcpyDeviceToHost));
    float d, m;
    std::memcpy(&d, &h[0], 4);
    std::memcpy(&m, &h[1], 4);
    return m > 0 ? d / m : d;
  };

  const int64_t hidden = 2048, tokens = 16384;
  const int64_t seqs[] = {1024, 4096, 16384};
  for (int hs : head_sizes) {
    for (int64_t T : seqs) {
      const int64_t B = tokens / T, NH = hidden / hs;
      const int64_t n = B * T * hidden;
      bf16 *q, *k, *v, *o, *dout, *dq, *dk, *dv;
      float* lse;
      void* ws;
      loom::cuda::AttnArgs a;
      a.B = B, a.NH = NH, a.HS = hs, a.Tq = a.Tkv = T;
      a.q_stride = a.kv_stride = a.o_stride = hidden;
      a.causal = causal != 0;
      const size_t ws_bytes = loom::cuda::attention_backward_workspace_bytes(a);
      for (bf16** p : {&q, &k, &v, &o, &dout, &dq, &dk, &dv}) CHECK(cudaMalloc(p, size_t(n) * sizeof(bf16)));
      CHECK(cudaMalloc(&lse, size_t(B * NH * T) * sizeof(float)));
      CHECK(cudaMalloc(&ws, ws_bytes));
      uint32_t seed = 1234;
      for (bf16* p : {q, k, v, dout}) {
        fill_random<<<1024, 256>>>(p, n, seed++, -1.f, 1.f);
        CHECK(cudaGetLastError());
      }
      auto fwd = [&]() { loom::cuda::attention_forward(o, lse, q, k, v, a, nullptr); };
      auto bwd = [&]() { loom::cuda::attention_backward(dq, dk, dv, dout, q, k, v, o, lse, a, ws, nullptr); };
      const float fwd_ms = median_ms(fwd, warmup, reps);
      const float bwd_ms = median_ms(bwd, warmup, reps);
      CHECK(cudaDeviceSynchronize());
      const double fwd_flop = 4.0 * double(B) * double(NH) * double(T) * double(T) * hs / (causal ? 2.0 : 1.0);
      const double bwd_flop = 2.5 * fwd_flop;
      std::printf("loom_flash hs=%d B=%lld T=%lld NH=%lld causal=%d fwd_ms=%.4f fwd_tflops=%.1f bwd_ms=%.4f "
                  "bwd_tflops=%.1f\n",
                  hs, (long long)B, (long long)T, (long long)NH, causal, fwd_ms, fwd_flop / (fwd_ms * 1e9),
                  bwd_ms, bwd_flop / (bwd_ms * 1e9));
      std::fflush(stdout);
      if (use_cudnn) {
        // o, lse, dq, dk, dv now hold loom flash's results on these inputs.
        bf16 *o2, *dq2, *dk2, *dv2;
        float* lse2;
        void* ws2 = nullptr;
        for (bf16** p : {&o2, &dq2, &dk2, &dv2}) CHECK(cudaMalloc(p, size_t(n) * sizeof(bf16)));
        CHECK(cudaMalloc(&lse2, size_t(B * NH * T) * sizeof(float)));
        try {
          loom::cuda::CudnnAttention att(a);
          const size_t ws2_bytes = std::max(att.forward_workspace_bytes(), att.backward_workspace_bytes());
          CHECK(cudaMalloc(&ws2, std::max<size_t>(ws2_bytes, 1)));
          auto cfwd = [&]() { att.forward(o2, lse2, q, k, v, ws2, nullptr); };
          auto cbwd = [&]() { att.backward(dq2, dk2, dv2, dout, q, k, v, o2, lse2, ws2, nullptr); };
          cfwd();
          cbwd();
          CHECK(cudaDeviceSynchronize());
          std::printf("# loom_cudnn hs=%d T=%lld: %s; max|cudnn - flash| / max|flash|: out %.2e lse %.2e dq %.2e "
                      "dk %.2e dv %.2e\n",
                      hs, (long long)T, att.describe().c_str(), rel_diff(o2, o, n), rel_diff(lse2, lse, B * NH * T),
                      rel_diff(dq2, dq, n), rel_diff(dk2, dk, n), rel_diff(dv2, dv, n));
          const float cfwd_ms = median_ms(cfwd, warmup, reps);
          const float cbwd_ms = median_ms(cbwd, warmup, reps);
          std::printf("loom_cudnn hs=%d B=%lld T=%lld NH=%lld causal=%d fwd_ms=%.4f fwd_tflops=%.1f bwd_ms=%.4f "
                      "bwd_tflops=%.1f\n",
                      hs, (long long)B, (long long)T, (long long)NH, causal, cfwd_ms, fwd_flop / (cfwd_ms * 1e9),
                      cbwd_ms, bwd_flop / (cbwd_ms * 1e9));
        } catch (const loom::Error& e) {
          std::printf("# loom_cudnn hs=%d B=%lld T=%lld unavailable: %s\n", hs, (long long)B, (long long)T, e.what());
        }
        std::fflush(stdout);
        CHECK(cudaDeviceSynchronize());
        for (void* p : {(void*)o2, (void*)dq2, (void*)dk2, (void*)dv2, (void*)lse2, ws2}) CHECK(cudaFree(p));
      }
      for (void* p : {(void*)q, (void*)k, (void*)v, (void*)o, (void*)dout, (void*)dq, (void*)dk, (void*)dv,
                      (void*)lse, ws})
        CHECK(cudaFree(p));
    }
  }
  CHECK(cudaFree(diff));
  return 0;
}
