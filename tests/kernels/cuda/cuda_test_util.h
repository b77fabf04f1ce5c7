// Helpers for the CUDA op tests: skip without a device, device buffers that are poisoned (NaN
// bytes) before each op so unwritten outputs show, bf16 rounding on the host and error norms in
// double.
#pragma once
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "core/dtype.h"
#include "kernels/cuda/allocator.cuh"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/matmul.cuh"
#include "kernels/cuda/cudnn_attention.cuh"

namespace loom::test {

inline int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

inline bool have_cuda_device() { return cuda_device_count() > 0; }

// The BLAS state the op tests run their GEMMs with: one per test thread, over the device pool,
// made on first use and kept (with its workspace) for the thread's life.
inline cuda::Blas& test_blas() {
  thread_local std::unique_ptr<cuda::Blas> b;
  if (!b) b = std::make_unique<cuda::Blas>(cuda::device_pool());
  return *b;
}

// n token ids in [0, V) from seed.
inline std::vector<int32_t> random_tokens(int64_t n, int64_t V, uint32_t seed) {
  std::mt19937 g(seed);
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (auto& x : t) x = int32_t(g() % uint32_t(V));
  return t;
}

#define LOOM_REQUIRE_GPU()                                                      \
  do {                                                                          \
    if (!::loom::test::have_cuda_device()) GTEST_SKIP() << "no CUDA device: skipped"; \
  } while (0)

// A GPU and loom's cuDNN path: a build with cuDNN, and at run time a cuDNN it takes (9.16 or
// later; older ones are refused by CudnnAttention's constructor).
#define LOOM_REQUIRE_CUDNN()                                                                          \
  do {                                                                                                \
    LOOM_REQUIRE_GPU();                                                                               \
    if (!::loom::cuda::cudnn_available()) GTEST_SKIP() << "loom built without cuDNN: skipped";        \
    if (::loom::cuda::cudnn_runtime_version() < 91600)                                                \
      GTEST_SKIP() << "cuDNN " << ::loom::cuda::cudnn_runtime_version()                               \
                   << " at run time: loom's cuDNN path needs 9.16 (91600) or later";                  \
  } while (0)

template <class T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t n) : n_(n) {
    LOOM_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&p_), std::max<size_t>(n, 1) * sizeof(T)));
  }
  ~DeviceBuffer() { cudaFree(p_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  T* get() const { return p_; }
  size_t size() const { return n_; }
  void upload(const std::vector<T>& h) {
    EXPECT_EQ(h.size(), n_);
    LOOM_CUDA_CHECK(cudaMemcpy(p_, h.data(), n_ * sizeof(T), cudaMemcpyHostToDevice));
  }
  std::vector<T> download() const {
    std::vector<T> h(n_);
    LOOM_CUDA_CHECK(cudaDeviceSynchronize());
    LOOM_CUDA_CHECK(cudaMemcpy(h.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }
  // All bytes 0xFF: NaN as f32 and as bf16.
  void poison() { LOOM_CUDA_CHECK(cudaMemset(p_, 0xFF, n_ * sizeof(T))); }

 private:
  T* p_ = nullptr;
  size_t n_;
};

using dbf16 = cuda::bf16;

inline float round_bf16(float x) { return bf16_to_f32(f32_to_bf16(x)); }

inline uint16_t bf16_bits(float x) { return f32_to_bf16(x).bits; }

// Random values N(mean, std) already rounded to bf16 (so host and device see the same numbers).
inline std::vector<float> random_bf16_values(size_t n, uint32_t seed, float std = 1.f, float mean = 0.f) {
  std::mt19937 g(seed);
  std::normal_distribution<float> d(mean, std);
  std::vector<float> v(n);
  for (auto& x : v) x = round_bf16(d(g));
  return v;
}

inline std::vector<float> random_f32(size_t n, uint32_t seed, float std = 1.f, float mean = 0.f) {
  std::mt19937 g(seed);
  std::normal_distribution<float> d(mean, std);
  std::vector<float> v(n);
  for (auto& x : v) x = d(g);
  return v;
}

inline std::vector<dbf16> to_device_bf16(const std::vector<float>& v) {
  std::vector<dbf16> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    uint16_t b = bf16_bits(v[i]);
    std::memcpy(static_cast<void*>(&out[i]), &b, 2);
  }
  return out;
}

inline std::vector<float> from_device_bf16(const std::vector<dbf16>& v) {
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    uint16_t b;
    std::memcpy(&b, &v[i], 2);
    out[i] = bf16_to_f32(bf16{b});
  }
  return out;
}

// Uploads host floats as bf16 into a new device buffer.
inline void upload_bf16(DeviceBuffer<dbf16>& d, const std::vector<float>& v) { d.upload(to_device_bf16(v)); }
inline std::vector<float> download_bf16(const DeviceBuffer<dbf16>& d) { return from_device_bf16(d.download()); }

// ||a - ref|| / ||ref|| in double; infinite when any a is NaN or Inf (an unwritten output).
template <class A, class R>
double rel_err(const std::vector<A>& a, const std::vector<R>& ref) {
  EXPECT_EQ(a.size(), ref.size());
  double d = 0, s = 0;
  for (size_t i = 0; i < a.size() && i < ref.size(); ++i) {
    if (!std::isfinite(double(a[i]))) return INFINITY;
    const double x = double(a[i]) - double(ref[i]);
    d += x * x;
    s += double(ref[i]) * double(ref[i]);
  }
  return s > 0 ? std::sqrt(d / s) : std::sqrt(d);
}

template <class A>
bool all_finite(const std::vector<A>& a) {
  for (const auto& x : a)
    if (!std::isfinite(double(x))) return false;
  return true;
}

}  // namespace loom::test
