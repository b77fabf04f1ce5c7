// Multi-tensor AdamW with global-norm clipping against the CPU op (kernels/cpu/adamw.h:
// sum_squares, clip_scale, adamw_update; PyTorch's AdamW) and a double reference. Tolerances:
// parameters and moments 1e-5 relative (f32 arithmetic); the update itself (new minus old
// parameter) 1e-4: it is about lr = 1e-2 of a parameter, so the parameter bound checks it only to
// about 1e-3, while f32 parameters of magnitude about 1 carry it to about 6e-6; the bf16 copy is
// exactly the rounded f32 parameter; the norm 1e-5.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

#include "cuda_test_util.h"
#include "kernels/cuda/adamw.cuh"
#include "kernels/cuda/allocator.cuh"
#include "kernels/cpu/adamw.h"

using namespace loom;
using namespace loom::test;

namespace {

// Random optimizer states of the given sizes (seeded by seed + 10 i + 1..4; second moments
// non-negative) on the host and the device, as MultiTensorAdamW's tensor list; with_bf16 adds a
// NaN-poisoned bf16 copy to each tensor.
struct States {
  struct Host {
    std::vector<float> p, g, m, v;
  };
  std::vector<Host> h;
  std::vector<std::unique_ptr<DeviceBuffer<float>>> bufs;  // p, g, m, v of each tensor
  std::vector<std::unique_ptr<DeviceBuffer<dbf16>>> pbf;
  std::vector<cuda::AdamWTensor> ts;

  States(const std::vector<int64_t>& sizes, const std::vector<float>& wd, uint32_t seed, bool with_bf16) {
    for (size_t i = 0; i < sizes.size(); ++i) {
      const size_t n = size_t(sizes[i]);
      const uint32_t s = seed + uint32_t(10 * i);
      Host x{random_f32(n, s + 1), random_f32(n, s + 2, 0.3f), random_f32(n, s + 3, 0.01f),
             random_f32(n, s + 4, 0.01f)};
      for (auto& v : x.v) v = v * v;
      for (auto* src : {&x.p, &x.g, &x.m, &x.v}) {
        bufs.push_back(std::make_unique<DeviceBuffer<float>>(n));
        bufs.back()->upload(*src);
      }
      const size_t k = bufs.size();
      cuda::AdamWTensor t;
      t.param = bufs[k - 4]->get();
      t.grad = bufs[k - 3]->get();
      t.m = bufs[k - 2]->get();
      t.v = bufs[k - 1]->get();
      if (with_bf16) {
        pbf.push_back(std::make_unique<DeviceBuffer<dbf16>>(n));
        pbf.back()->poison();
        t.param_bf16 = pbf.back()->get();
      }
      t.n = sizes[i];
      t.weight_decay = wd[i];
      ts.push_back(t);
      h.push_back(std::move(x));
    }
  }
};

// One launch with hyperparameters hp; returns the norm and the scale it applied.
std::array<float, 2> launch(cuda::MultiTensorAdamW& opt, const cuda::AdamWHyper& hp) {
  opt.set_hyper(hp);
  opt.launch(nullptr);
  LOOM_CUDA_CHECK(cudaDeviceSynchronize());
  std::array<float, 2> stats{};
  LOOM_CUDA_CHECK(cudaMemcpy(stats.data(), opt.norm_and_scale(), sizeof(stats), cudaMemcpyDeviceToHost));
  return stats;
}

// The CPU op's arguments for the GPU's hyperparameters hp, weight decay wd and the gradient scale
// the GPU applied (clipping included).
cpu::AdamWArgs cpu_args(const cuda::AdamWHyper& hp, float wd, float scale) {
  cpu::AdamWArgs a;
  a.lr = hp.lr;
  a.beta1 = hp.beta1;
  a.beta2 = hp.beta2;
  a.eps = hp.eps;
  a.weight_decay = wd;
  a.step = hp.step;
  a.grad_scale = scale;
  return a;
}

}  // namespace

// The update's two paths (four elements at a time where a chunk's arrays are 16-byte aligned and
// its 16-bit copy 8-byte aligned, one at a time elsewhere and for a chunk's last elements) give the
// same bits. One set of values, over more than one chunk with a part-filled last one, as tensors
// that take the four-wide path (f32 arrays and copy aligned) and the one-wide path (the f32 arrays
// a float past alignment; or aligned, with the copy 2 bytes past), with a bf16 copy and with an
// f16 copy: every array and copy equal to the aligned tensor's with the same copy.
TEST(AdamW, AlignedAndUnalignedTensorsAgreeBitForBit) {
  LOOM_REQUIRE_GPU();
  const int64_t n = 2 * cuda::MultiTensorAdamW::kChunk + 1027;
  const std::vector<float> p = random_f32(size_t(n), 51), g = random_f32(size_t(n), 52, 0.3f),
                           m = random_f32(size_t(n), 53, 0.01f);
  std::vector<float> v = random_f32(size_t(n), 54, 0.01f);
  for (auto& x : v) x = x * x;
  struct Case {
    int f32_off, copy_off;
    bool f16;
  };
  // [0], [3]: four-wide; [1], [2], [4], [5]: one-wide.
  const Case cases[] = {{0, 0, false}, {1, 1, false}, {0, 1, false}, {0, 0, true}, {1, 1, true}, {0, 1, true}};
  const std::vector<float>* arrays[4] = {&p, &g, &m, &v};
  std::vector<std::unique_ptr<DeviceBuffer<float>>> f32;       // 4 per case
  std::vector<std::unique_ptr<DeviceBuffer<uint16_t>>> copies;  // 1 per case
  std::vector<cuda::AdamWTensor> ts;
  for (const Case& c : cases) {
    float* ptr[4];
    for (int k = 0; k < 4; ++k) {
      std::vector<float> host(size_t(n + c.f32_off), 0.f);
      std::copy(arrays[k]->begin(), arrays[k]->end(), host.begin() + c.f32_off);
      f32.push_back(std::make_unique<DeviceBuffer<float>>(host.size()));
      f32.back()->upload(host);
      ptr[k] = f32.back()->get() + c.f32_off;
    }
    copies.push_back(std::make_unique<DeviceBuffer<uint16_t>>(size_t(n + c.copy_off)));
    copies.back()->poison();
    cuda::AdamWTensor t;
    t.param = ptr[0];
    t.grad = ptr[1];
    t.m = ptr[2];
    t.v = ptr[3];
    if (c.f16) t.param_f16 = reinterpret_cast<cuda::f16*>(copies.back()->get() + c.copy_off);
    else t.param_bf16 = reinterpret_cast<cuda::bf16*>(copies.back()->get() + c.copy_off);
    t.n = n;
    t.weight_decay = 0.1f;
    ts.push_back(t);
  }
  cuda::MultiTensorAdamW opt(ts, cuda::device_pool());
  cuda::AdamWHyper hp;
  hp.lr = 1e-2f;
  hp.step = 5;
  hp.max_norm = 1.0f;
  launch(opt, hp);
  const auto arrays_of = [&](size_t i, int k) {
    const auto all = f32[4 * i + size_t(k)]->download();
    return std::vector<float>(all.begin() + cases[i].f32_off, all.end());
  };
  const auto copy_of = [&](size_t i) {
    const auto all = copies[i]->download();
    return std::vector<uint16_t>(all.begin() + cases[i].copy_off, all.end());
  };
  for (size_t i = 0; i < std::size(cases); ++i) {
    const size_t ref = cases[i].f16 ? 3 : 0;
    if (i == ref) continue;
    for (int k = 0; k < 4; ++k)  // p, g (unchanged), m, v
      EXPECT_EQ(std::memcmp(arrays_of(i, k).data(), arrays_of(ref, k).data(), sizeof(float) * size_t(n)), 0)
          << "case " << i << ", array " << k << " (p, g, m, v)";
    EXPECT_EQ(copy_of(i), copy_of(ref)) << "case " << i << ": the 16-bit copy";
  }
  EXPECT_NE(std::memcmp(arrays_of(0, 0).data(), p.data(), sizeof(float) * size_t(n)), 0) << "the update ran";
  // The copies are the rounded parameters (no element left poisoned).
  const std::vector<float> pf = arrays_of(0, 0);
  const std::vector<uint16_t> cb = copy_of(0);
  int64_t wrong = 0;
  for (int64_t i = 0; i < n; ++i) wrong += cb[size_t(i)] != bf16_bits(pf[size_t(i)]);
  EXPECT_EQ(wrong, 0) << "bf16 copy";
}

TEST(AdamW, MultiTensorWithClipping) {
  LOOM_REQUIRE_GPU();
  const std::vector<int64_t> sizes{7, 300000, 65536, 1, 4099};
  const std::vector<float> wd{0.1f, 0.1f, 0.f, 0.f, 0.05f};
  States st(sizes, wd, 0, true);
  const auto& h = st.h;
  const auto& bufs = st.bufs;
  const auto& pbf = st.pbf;
  const auto& ts = st.ts;
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
    const std::array<float, 2> stats = launch(opt, hp);

    double ss = 0, cpu_ss = 0;
    for (auto& x : h) {
      for (float g : x.g) ss += double(g) * g;
      cpu_ss += cpu::sum_squares(x.g.data(), int64_t(x.g.size()));
    }
    const double norm = std::sqrt(ss) * hp.grad_scale;
    const double scale = hp.grad_scale * std::min(1.0, hp.max_norm / (norm + 1e-6));
    EXPECT_NEAR(stats[0], norm, 1e-5 * norm);
    EXPECT_NEAR(stats[1], scale, 1e-5 * scale);
    // The CPU op's norm and clip scale.
    const double cpu_norm = std::sqrt(cpu_ss) * hp.grad_scale;
    const float cpu_scale = hp.grad_scale * cpu::clip_scale(cpu_norm, hp.max_norm);
    EXPECT_NEAR(stats[0], cpu_norm, 1e-5 * cpu_norm);
    EXPECT_NEAR(stats[1], cpu_scale, 1e-5 * cpu_scale);
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
      const auto gm = bufs[k + 2]->download(), gv = bufs[k + 3]->download();
      const double ep = rel_err(p, rp), em = rel_err(gm, rm), ev = rel_err(gv, rv);
      EXPECT_LE(ep, 1e-5) << "tensor " << i;
      EXPECT_LE(em, 1e-5) << "tensor " << i;
      EXPECT_LE(ev, 1e-5) << "tensor " << i;
      // The CPU op from the same state.
      std::vector<float> cp = h[i].p, cm = h[i].m, cv = h[i].v;
      cpu::adamw_update(cp.data(), h[i].g.data(), cm.data(), cv.data(), int64_t(cp.size()),
                        cpu_args(hp, wd[i], cpu_scale));
      std::vector<double> du(p.size()), cu(p.size());
      for (size_t j = 0; j < p.size(); ++j) {
        du[j] = double(p[j]) - h[i].p[j];
        cu[j] = double(cp[j]) - h[i].p[j];
      }
      const double cep = rel_err(p, cp), cem = rel_err(gm, cm), cev = rel_err(gv, cv), ceu = rel_err(du, cu);
      EXPECT_LE(cep, 1e-5) << "tensor " << i;
      EXPECT_LE(cem, 1e-5) << "tensor " << i;
      EXPECT_LE(cev, 1e-5) << "tensor " << i;
      EXPECT_LE(ceu, 1e-4) << "tensor " << i << ": the update";
      auto pb = download_bf16(*pbf[i]);
      int64_t mism = 0;
      for (size_t j = 0; j < p.size(); ++j) mism += pb[j] != round_bf16(p[j]);
      EXPECT_EQ(mism, 0) << "tensor " << i << ": bf16 copy";
      std::printf("adamw tensor %zu (n=%ld): param %.2e m %.2e v %.2e | against the CPU op: param %.2e m %.2e v "
                  "%.2e update %.2e\n",
                  i, long(sizes[i]), ep, em, ev, cep, cem, cev, ceu);
    }
  }
  EXPECT_EQ(pool.current(MemTag::optimizer), before) << "tables are returned to the pool";
}

// Without clipping (max_norm 0) and without a bf16 copy, two launches with new hyperparameters
// each time (as a replayed graph runs them), against the CPU op applied twice.
TEST(AdamW, TwoLaunchesWithoutClippingOrCopy) {
  LOOM_REQUIRE_GPU();
  const std::vector<int64_t> sizes{70001, 5};
  States st(sizes, {0.1f, 0.f}, 40, false);
  const auto& bufs = st.bufs;
  const auto& ts = st.ts;
  std::vector<std::vector<float>> p, g, m, v;
  for (const auto& x : st.h) {
    p.push_back(x.p);
    g.push_back(x.g);
    m.push_back(x.m);
    v.push_back(x.v);
  }
  cuda::MultiTensorAdamW opt(ts, cuda::device_pool());
  auto cp = p, cm = m, cv = v;
  const float lrs[] = {1e-2f, 5e-3f};
  for (int call = 0; call < 2; ++call) {
    cuda::AdamWHyper hp;
    hp.lr = lrs[call];
    hp.step = 7 + call;
    hp.max_norm = 0.f;
    hp.grad_scale = 0.25f;
    const std::array<float, 2> stats = launch(opt, hp);
    EXPECT_EQ(stats[1], hp.grad_scale) << "no clipping with max_norm 0";
    for (size_t i = 0; i < sizes.size(); ++i) {
      cpu::adamw_update(cp[i].data(), g[i].data(), cm[i].data(), cv[i].data(), sizes[i],
                        cpu_args(hp, ts[i].weight_decay, hp.grad_scale));
    }
  }
  for (size_t i = 0; i < sizes.size(); ++i) {
    const auto gp = bufs[4 * i]->download();
    std::vector<double> du(gp.size()), cu(gp.size());
    for (size_t j = 0; j < gp.size(); ++j) {
      du[j] = double(gp[j]) - p[i][j];
      cu[j] = double(cp[i][j]) - p[i][j];
    }
    const double ep = rel_err(gp, cp[i]), em = rel_err(bufs[4 * i + 2]->download(), cm[i]),
                 ev = rel_err(bufs[4 * i + 3]->download(), cv[i]), eu = rel_err(du, cu);
    EXPECT_LE(ep, 1e-5) << "tensor " << i;
    EXPECT_LE(em, 1e-5) << "tensor " << i;
    EXPECT_LE(ev, 1e-5) << "tensor " << i;
    EXPECT_LE(eu, 1e-4) << "tensor " << i << ": the updates";
    std::printf("adamw two launches, tensor %zu (n=%ld): param %.2e m %.2e v %.2e updates %.2e\n", i,
                long(sizes[i]), ep, em, ev, eu);
  }
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
