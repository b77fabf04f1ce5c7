// Multi-tensor AdamW with global-norm clipping against a double reference of PyTorch's AdamW.
// Tolerance: parameters and moments 1e-5 relative (f32 arithmetic); the bf16 copy is exactly the
// rounded f32 parameter; the norm 1e-5.
#include <gtest/gtest.h>

#include <cmath>

#include "cuda_test_util.h"
#include "kernels/cuda/adamw.cuh"
#include "kernels/cuda/allocator.cuh"

using namespace loom;
using namespace loom::test;

TEST(AdamW, MultiTensorWithClipping) {
  LOOM_REQUIRE_GPU();
  const std::vector<int64_t> sizes{7, 300000, 65536, 1, 4099};
  const float wd[] = {0.1f, 0.1f, 0.f, 0.f, 0.05f};
  struct Host {
    std::vector<float> p, g, m, v;
  };
  std::vector<Host> h;
  std::vector<std::unique_ptr<DeviceBuffer<float>>> bufs;
  std::vector<std::unique_ptr<DeviceBuffer<dbf16>>> pbf;
  std::vector<cuda::AdamWTensor> ts;
  for (size_t i = 0; i < sizes.size(); ++i) {
    const size_t n = size_t(sizes[i]);
    Host x{random_f32(n, uint32_t(10 * i + 1)), random_f32(n, uint32_t(10 * i + 2), 0.3f),
           random_f32(n, uint32_t(10 * i + 3), 0.01f), random_f32(n, uint32_t(10 * i + 4), 0.01f)};
    for (auto& v : x.v) v = v * v;  // second moments are non-negative
    cuda::AdamWTensor t;
    for (auto* src : {&x.p, &x.g, &x.m, &x.v}) {
      bufs.push_back(std::make_unique<DeviceBuffer<float>>(n));
      bufs.back()->upload(*src);
    }
    const size_t k = bufs.size();
    t.param = bufs[k - 4]->get();
    t.grad = bufs[k - 3]->get();
    t.m = bufs[k - 2]->get();
    t.v = bufs[k - 1]->get();
    pbf.push_back(std::make_unique<DeviceBuffer<dbf16>>(n));
    pbf.back()->poison();
    t.param_bf16 = pbf.back()->get();
    t.n = sizes[i];
    t.weight_decay = wd[i];
    ts.push_back(t);
    h.push_back(std::move(x));
  }
  MemoryPool& pool = cuda::device_pool();
  const int64_t before = pool.current(MemTag::optimizer);
  {
    cuda::MultiTensorAdamW opt(ts, pool);
    EXPECT_GT(pool.current(MemTag::optimizer), before) << "tables are tagged as optimizer bytes";
    cuda::AdamWHyper hp;
    hp.lr = 1e-2f;
    hp.beta1 = 0.9f;
    hp.beta2 = 0.95f;
    hp.eps = 1e-8f;
    hp.step = 3;
    hp.max_norm = 1.0f;
    hp.grad_scale = 0.5f;
    opt.set_hyper(hp);
    opt.launch(nullptr);
    LOOM_CUDA_CHECK(cudaDeviceSynchronize());
    float stats[2];
    LOOM_CUDA_CHECK(cudaMemcpy(stats, opt.norm_and_scale(), sizeof(stats), cudaMemcpyDeviceToHost));

    double ss = 0;
    for (auto& x : h)
      for (float g : x.g) ss += double(g) * g;
    const double norm = std::sqrt(ss) * hp.grad_scale;
    const double scale = hp.grad_scale * std::min(1.0, hp.max_norm / (norm + 1e-6));
    EXPECT_NEAR(stats[0], norm, 1e-5 * norm);
    EXPECT_NEAR(stats[1], scale, 1e-5 * scale);
    ASSERT_LT(scale, hp.grad_scale) << "the test must exercise clipping";
    const double bc1 = 1 - std::pow(0.9, 3), bc2 = 1 - std::pow(0.95, 3);
    size_t k = 0;
    for (size_t i = 0; i < h.size(); ++i, k += 4) {
      std::vector<double> rp(h[i].p.size()), rm(rp.size()), rv(rp.size());
      for (size_t j = 0; j < rp.size(); ++j) {
        const double g = h[i].g[j] * scale;
        rm[j] = 0.9 * h[i].m[j] + 0.1 * g;
        rv[j] = 0.95 * h[i].v[j] + 0.05 * g * g;
        double p = h[i].p[j];
        p -= hp.lr * wd[i] * p;
        p -= hp.lr * (rm[j] / bc1) / (std::sqrt(rv[j] / bc2) + hp.eps);
        rp[j] = p;
      }
      auto p = bufs[k]->download();
      const double ep = rel_err(p, rp), em = rel_err(bufs[k + 2]->download(), rm), ev = rel_err(bufs[k + 3]->download(), rv);
      EXPECT_LE(ep, 1e-5) << "tensor " << i;
      EXPECT_LE(em, 1e-5) << "tensor " << i;
      EXPECT_LE(ev, 1e-5) << "tensor " << i;
      auto pb = download_bf16(*pbf[i]);
      int64_t mism = 0;
      for (size_t j = 0; j < p.size(); ++j) mism += pb[j] != round_bf16(p[j]);
      EXPECT_EQ(mism, 0) << "tensor " << i << ": bf16 copy";
      std::printf("adamw tensor %zu (n=%ld): param %.2e m %.2e v %.2e\n", i, long(sizes[i]), ep, em, ev);
    }
  }
  EXPECT_EQ(pool.current(MemTag::optimizer), before) << "tables are returned to the pool";
}

TEST(AdamW, RejectsBadHyperparameters) {
  LOOM_REQUIRE_GPU();
  cuda::MultiTensorAdamW opt({}, cuda::device_pool());
  cuda::AdamWHyper h;
  h.step = 0;
  EXPECT_THROW(opt.set_hyper(h), Error);
  h.step = 1;
  h.beta2 = 1.f;
  EXPECT_THROW(opt.set_hyper(h), Error);
  MemoryPool host("host");
  EXPECT_THROW(cuda::MultiTensorAdamW({}, host), Error);
}
