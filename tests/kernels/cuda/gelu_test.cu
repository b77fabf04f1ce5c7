// GELU (tanh form) on bf16 against the CPU op (kernels/cpu/gelu.h, f32 on the same bf16-rounded
// inputs) and against double; outputs NaN-poisoned first. Tolerance 5e-3 (||out - ref|| /
// ||ref||): one bf16 rounding of each output is about 2e-3 relative.
#include <gtest/gtest.h>

#include <cmath>

#include "cuda_test_util.h"
#include "kernels/cuda/gelu.cuh"
#include "kernels/cpu/gelu.h"

using namespace loom;
using namespace loom::test;

TEST(Gelu, ForwardBackward) {
  LOOM_REQUIRE_GPU();
  for (int64_t n : {int64_t(1), int64_t(13), int64_t(4096), int64_t(100003)}) {
    auto x = random_bf16_values(size_t(n), uint32_t(n), 2.f);
    auto g = random_bf16_values(size_t(n), uint32_t(n + 1));
    DeviceBuffer<dbf16> dx{size_t(n)}, dg{size_t(n)}, dout(static_cast<size_t>(n));
    upload_bf16(dx, x);
    upload_bf16(dg, g);
    std::vector<double> ref(static_cast<size_t>(n)), ref_b(static_cast<size_t>(n));
    for (size_t i = 0; i < size_t(n); ++i) {
      const double v = x[i], u = std::sqrt(2 / M_PI) * (v + 0.044715 * v * v * v), t = std::tanh(u);
      ref[i] = 0.5 * v * (1 + t);
      ref_b[i] = g[i] * (0.5 * (1 + t) + 0.5 * v * (1 - t * t) * std::sqrt(2 / M_PI) * (1 + 3 * 0.044715 * v * v));
    }
    std::vector<float> cpu_f(static_cast<size_t>(n)), cpu_b(static_cast<size_t>(n));
    cpu::gelu_forward(cpu_f.data(), x.data(), n);
    cpu::gelu_backward(cpu_b.data(), x.data(), g.data(), n);
    dout.poison();
    cuda::gelu_forward(dout.get(), dx.get(), n, nullptr);
    const auto got_f = download_bf16(dout);
    const double ef = rel_err(got_f, ref), cf = rel_err(got_f, cpu_f);
    dout.poison();
    cuda::gelu_backward(dout.get(), dx.get(), dg.get(), n, nullptr);
    const auto got_b = download_bf16(dout);
    const double eb = rel_err(got_b, ref_b), cb = rel_err(got_b, cpu_b);
    // In place: dinp aliases dout.
    cuda::gelu_backward(dg.get(), dx.get(), dg.get(), n, nullptr);
    const double eb_inplace = rel_err(download_bf16(dg), cpu_b);
    // Forward in place: out aliases inp.
    cuda::gelu_forward(dx.get(), dx.get(), n, nullptr);
    const double ef_inplace = rel_err(download_bf16(dx), cpu_f);
    EXPECT_LE(ef, 5e-3) << "n=" << n;
    EXPECT_LE(eb, 5e-3) << "n=" << n;
    EXPECT_LE(cf, 5e-3) << "n=" << n;
    EXPECT_LE(cb, 5e-3) << "n=" << n;
    EXPECT_LE(eb_inplace, 5e-3) << "n=" << n;
    EXPECT_LE(ef_inplace, 5e-3) << "n=" << n;
    std::printf("gelu n=%ld: fwd %.2e bwd %.2e | against the CPU op: fwd %.2e bwd %.2e, in place fwd %.2e bwd %.2e\n",
                long(n), ef, eb, cf, cb, ef_inplace, eb_inplace);
  }
}
