// Fused softmax + cross-entropy against the CPU op (kernels/cpu/crossentropy.h, f32 on the same
// bf16 logits) and against double; outputs NaN-poisoned first. Tolerances: losses (f32) 1e-4
// relative per row; dlogits (bf16) 5e-3 in norm (one bf16 rounding, about 2e-3 relative), and
// every element against the CPU op within 8e-3 of its own magnitude (one bf16 rounding is at
// most 2^-8 = 3.9e-3 relative; the norm alone is dominated by the target columns); padding and
// ignored rows exactly zero.
#include <gtest/gtest.h>

#include <cmath>
#include <utility>
#include <vector>

#include "cuda_test_util.h"
#include "kernels/cuda/crossentropy.cuh"
#include "kernels/cpu/crossentropy.h"

using namespace loom;
using namespace loom::test;

namespace {

void run_case(int64_t N, int64_t V, int64_t Vp, bool in_place) {
  auto logits = random_bf16_values(size_t(N * Vp), uint32_t(N + V), 3.f);
  for (int64_t i = 0; i < N; ++i)
    for (int64_t j = V; j < Vp; ++j) logits[size_t(i * Vp + j)] = 100.f;  // padding must be masked, whatever it holds
  std::vector<int32_t> tgt(static_cast<size_t>(N));
  std::mt19937 g{uint32_t(N)};
  for (auto& t : tgt) t = int32_t(g() % uint32_t(V));
  tgt[size_t(N / 2)] = -1;  // ignored
  const float dloss = 1.f / float(N - 1);
  std::vector<double> ref_loss(static_cast<size_t>(N)), ref_d(size_t(N * Vp), 0.0);
  for (int64_t i = 0; i < N; ++i) {
    if (tgt[size_t(i)] < 0) continue;
    double m = -INFINITY, s = 0;
    for (int64_t j = 0; j < V; ++j) m = std::max(m, double(logits[size_t(i * Vp + j)]));
    for (int64_t j = 0; j < V; ++j) s += std::exp(double(logits[size_t(i * Vp + j)]) - m);
    ref_loss[size_t(i)] = m + std::log(s) - logits[size_t(i * Vp + tgt[size_t(i)])];
    for (int64_t j = 0; j < V; ++j)
      ref_d[size_t(i * Vp + j)] =
          dloss * (std::exp(double(logits[size_t(i * Vp + j)]) - m) / s - (j == tgt[size_t(i)] ? 1.0 : 0.0));
  }
  DeviceBuffer<dbf16> dl(logits.size()), dd(logits.size());
  DeviceBuffer<int32_t> dt(tgt.size());
  DeviceBuffer<float> losses{size_t(N)};
  upload_bf16(dl, logits);
  dt.upload(tgt);
  losses.poison();
  cuda::crossentropy_forward(losses.get(), dl.get(), dt.get(), N, V, Vp, nullptr);
  auto l1 = losses.download();
  losses.poison();
  dd.poison();
  cuda::crossentropy_forward_backward(losses.get(), in_place ? dl.get() : dd.get(), dl.get(), dt.get(), dloss, N, V, Vp,
                                      nullptr);
  auto l2 = losses.download();
  auto d = download_bf16(in_place ? dl : dd);
  double worst = 0;
  for (int64_t i = 0; i < N; ++i) {
    ASSERT_TRUE(std::isfinite(l1[size_t(i)]) && std::isfinite(l2[size_t(i)])) << "row " << i;
    EXPECT_EQ(l1[size_t(i)], l2[size_t(i)]) << "row " << i;
    const double e = std::fabs(l2[size_t(i)] - ref_loss[size_t(i)]) / std::max(1e-6, std::fabs(ref_loss[size_t(i)]));
    worst = std::max(worst, tgt[size_t(i)] < 0 ? std::fabs(double(l2[size_t(i)])) : e);
  }
  EXPECT_LE(worst, 1e-4);
  int64_t nonzero_pad = 0;
  for (int64_t i = 0; i < N; ++i)
    for (int64_t j = 0; j < Vp; ++j)
      if ((j >= V || tgt[size_t(i)] < 0) && d[size_t(i * Vp + j)] != 0.f) ++nonzero_pad;
  EXPECT_EQ(nonzero_pad, 0) << "padding columns and ignored rows must get zero gradient";
  const double ed = rel_err(d, ref_d);
  EXPECT_LE(ed, 5e-3);
  // The CPU op on the same logits.
  std::vector<float> c_loss(static_cast<size_t>(N)), c_d(logits.size());
  cpu::crossentropy_forward_backward(c_loss.data(), c_d.data(), logits.data(), tgt.data(), dloss, N, V, Vp);
  double c_worst_loss = 0, c_worst_elem = 0;
  for (int64_t i = 0; i < N; ++i) {
    c_worst_loss = std::max(c_worst_loss, std::fabs(double(l2[size_t(i)]) - c_loss[size_t(i)]) /
                                              std::max(1e-6, std::fabs(double(c_loss[size_t(i)]))));
    for (int64_t j = 0; j < Vp; ++j) {
      const double want = c_d[size_t(i * Vp + j)], got = d[size_t(i * Vp + j)];
      const double e = want == 0 ? std::fabs(got) : std::fabs(got - want) / std::fabs(want);
      c_worst_elem = std::max(c_worst_elem, e);
    }
  }
  const double cd = rel_err(d, c_d);
  EXPECT_LE(c_worst_loss, 1e-4);
  EXPECT_LE(cd, 5e-3);
  EXPECT_LE(c_worst_elem, 8e-3);
  std::printf("crossentropy N=%ld V=%ld Vp=%ld%s: loss worst rel %.2e dlogits %.2e | against the CPU op: loss %.2e "
              "dlogits %.2e, worst element %.2e\n",
              long(N), long(V), long(Vp), in_place ? " (in place)" : "", worst, ed, c_worst_loss, cd, c_worst_elem);
}

}  // namespace

TEST(CrossEntropy, SmallVocab) {
  LOOM_REQUIRE_GPU();
  run_case(33, 503, 512, false);
  run_case(33, 503, 512, true);
}

TEST(CrossEntropy, Gpt2Vocab) {
  LOOM_REQUIRE_GPU();
  run_case(64, 50257, 50304, false);
  run_case(64, 50257, 50304, true);
}

// A row too large for one block's shared memory (256,000 bf16 bytes; Hopper's limit is 227 KiB):
// the forward-backward reads the row twice from device memory instead of staging it.
TEST(CrossEntropy, VocabBeyondSharedMemory) {
  LOOM_REQUIRE_GPU();
  run_case(5, 127997, 128000, false);
  run_case(5, 127997, 128000, true);
}

// Targets outside [0, V) other than -1 give NaN losses and NaN gradients over the real columns
// (the model validates tokens on the host; NaN makes a miss loud); -1 gives 0 and zero gradients.
// Both kernels: the row staged in shared memory, and the one beyond it.
TEST(CrossEntropy, InvalidTargetsGiveNaN) {
  LOOM_REQUIRE_GPU();
  for (const auto& [V, Vp] : {std::pair<int64_t, int64_t>{503, 512}, {127997, 128000}}) {
    const int64_t N = 4;
    const std::vector<int32_t> tgt{0, int32_t(V), -2, -1};
    const auto logits = random_bf16_values(size_t(N * Vp), 5, 3.f);
    DeviceBuffer<dbf16> dl(logits.size()), dd(logits.size());
    DeviceBuffer<int32_t> dt(tgt.size());
    DeviceBuffer<float> losses{size_t(N)};
    upload_bf16(dl, logits);
    dt.upload(tgt);
    dd.poison();
    cuda::crossentropy_forward_backward(losses.get(), dd.get(), dl.get(), dt.get(), 0.25f, N, V, Vp, nullptr);
    const auto l = losses.download();
    const auto d = download_bf16(dd);
    EXPECT_TRUE(std::isfinite(l[0])) << "V " << V;
    EXPECT_TRUE(std::isnan(l[1]) && std::isnan(l[2])) << "V " << V << ": " << l[1] << " " << l[2];
    EXPECT_EQ(l[3], 0.f) << "V " << V;
    int64_t wrong = 0;
    for (int64_t i = 1; i < N; ++i)
      for (int64_t j = 0; j < Vp; ++j) {
        const float x = d[size_t(i * Vp + j)];
        const bool want_nan = i < 3 && j < V;
        if (want_nan ? !std::isnan(x) : x != 0.f) ++wrong;
      }
    EXPECT_EQ(wrong, 0) << "V " << V;
  }
}

TEST(CrossEntropy, RejectsBadPadding) {
  LOOM_REQUIRE_GPU();
  DeviceBuffer<float> l(4);
  EXPECT_THROW(cuda::crossentropy_forward<cuda::bf16>(l.get(), nullptr, nullptr, 4, 100, 99, nullptr), Error);
  EXPECT_THROW(cuda::crossentropy_forward<cuda::bf16>(l.get(), nullptr, nullptr, 4, 100, 101, nullptr), Error);
}
