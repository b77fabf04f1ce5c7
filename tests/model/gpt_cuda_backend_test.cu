// The one GPT (model/gpt.h, the chain blocks over core/backend.h) on the CUDA backend: the same
// model code the CPU runs, here in bf16 with f32 master weights, against the PyTorch reference
// dump (tests/data/gpt2_tiny_reference.safetensors, written by scripts/torch_reference.py) and
// against itself through the KV-cache decoder. Host code only (compiled by the C++ compiler);
// skipped without a GPU. Tolerances are those of the bf16 model (bf16 activations compounded over
// the network): loss 5e-3 relative, logits 2e-2 (norm), every parameter gradient 5e-2 (norm), the
// global gradient norm 2e-2, AdamW step losses 2e-2 absolute; decoder logits against the full
// forward's 2e-2 (norm: the same bf16 ops on other row counts).
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/backend.h"
#include "model/gpt.h"
#include "model/kv_cache.h"
#include "train/safetensors.h"

using namespace loom;

namespace {

#define REQUIRE_CUDA_BACKEND()                                                    \
  do {                                                                            \
    std::string why_;                                                             \
    if (!backend_available(Device::cuda, &why_)) GTEST_SKIP() << "cuda backend: " << why_; \
  } while (0)

double rel_err(const std::vector<float>& a, const std::vector<float>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (!std::isfinite(a[i])) return INFINITY;
    num += (double(a[i]) - ref[i]) * (double(a[i]) - ref[i]);
    den += double(ref[i]) * ref[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

std::vector<float> download(Backend& be, const Tensor& t) {
  std::vector<float> v(size_t(t.numel()));
  be.download(v.data(), t.raw(), t.dtype(), t.numel());
  return v;
}

int64_t meta_int(const train::SafetensorsReader& r, const std::string& k) { return std::stoll(r.meta(k)); }
double meta_double(const train::SafetensorsReader& r, const std::string& k) { return std::stod(r.meta(k)); }

Tensor host_i32(const std::vector<int32_t>& v, int64_t B, int64_t T) {
  Tensor t = Tensor::empty({B, T}, DType::i32, MemTag::workspace);
  std::copy(v.begin(), v.end(), t.i32());
  return t;
}

}  // namespace

TEST(GPTOnCuda, MatchesPyTorchReference) {
  REQUIRE_CUDA_BACKEND();
  const std::string path = std::string(LOOM_SOURCE_DIR) + "/tests/data/gpt2_tiny_reference.safetensors";
  if (!std::filesystem::exists(path)) GTEST_SKIP() << path << " is missing (scripts/torch_reference.py writes it)";
  train::SafetensorsReader r(path);
  model::GPTConfig cfg;
  cfg.name = r.meta("model");
  cfg.n_layer = meta_int(r, "n_layer");
  cfg.n_head = meta_int(r, "n_head");
  cfg.n_embd = meta_int(r, "n_embd");
  cfg.vocab_size = meta_int(r, "vocab_size");
  cfg.block_size = meta_int(r, "block_size");
  const int64_t B = meta_int(r, "batch"), T = meta_int(r, "seq"), steps = meta_int(r, "steps");
  const int64_t V = cfg.vocab_size, Vp = cfg.padded_vocab();

  auto be = make_backend(Device::cuda);
  model::GPT gpt(cfg, *be);
  for (model::Parameter* p : gpt.parameters()) {
    const std::vector<float> v = r.read_f32("param." + p->spec.name);
    ASSERT_EQ(int64_t(v.size()), p->spec.numel()) << p->spec.name;
    be->upload(p->value.raw(), DType::f32, v.data(), p->spec.numel());
  }
  gpt.refresh_compute();
  std::vector<int32_t> tokens(size_t(B * T)), targets(size_t(B * T));
  r.read_into("tokens", tokens.data(), tokens.size() * 4, DType::i32, {B, T});
  r.read_into("targets", targets.data(), targets.size() * 4, DType::i32, {B, T});
  const Tensor tok = host_i32(tokens, B, T), tgt = host_i32(targets, B, T);

  const float loss = gpt.forward(tok, tgt);
  const float ref_loss = r.read_f32("loss").at(0);
  const double loss_err = std::fabs(double(loss) - ref_loss) / std::fabs(double(ref_loss));
  EXPECT_LE(loss_err, 5e-3) << "loss " << loss << " vs " << ref_loss;
  EXPECT_EQ(gpt.logits().dtype(), DType::bf16);
  const std::vector<float> lp = download(*be, gpt.logits());
  const std::vector<float> ref_logits = r.read_f32("logits");
  std::vector<float> logits(size_t(B * T * V));
  double pad = 0;
  for (int64_t i = 0; i < B * T; ++i) {
    for (int64_t j = 0; j < V; ++j) logits[size_t(i * V + j)] = lp[size_t(i * Vp + j)];
    for (int64_t j = V; j < Vp; ++j) pad = std::max(pad, double(std::fabs(lp[size_t(i * Vp + j)])));
  }
  EXPECT_EQ(pad, 0.0) << "padding logits";
  const double logits_err = rel_err(logits, ref_logits);
  EXPECT_LE(logits_err, 2e-2);

  gpt.zero_grad();
  const float loss2 = gpt.forward(tok, tgt, {.fuse_backward = true});
  EXPECT_EQ(loss2, loss) << "the fused loss gradient must not change the loss";
  gpt.backward();
  double worst = 0, ss = 0;
  std::string worst_name;
  for (model::Parameter* p : gpt.parameters()) {
    const std::vector<float> g = download(*be, p->grad);
    const double e = rel_err(g, r.read_f32("grad." + p->spec.name));
    EXPECT_LE(e, 5e-2) << "gradient of " << p->spec.name;
    if (e > worst) worst = e, worst_name = p->spec.name;
    for (float x : g) ss += double(x) * x;
  }
  const double ref_norm = std::stod(r.meta("grad_norm"));
  const double norm_err = std::fabs(std::sqrt(ss) - ref_norm) / ref_norm;
  EXPECT_LE(norm_err, 2e-2);

  // AdamW steps through the backend's multi-tensor plan (moments on the device, the compute copies
  // refreshed by the update), against the reference's losses.
  std::vector<Tensor> moments;
  std::vector<AdamWTensor> ts;
  const float wd = float(meta_double(r, "weight_decay"));
  for (model::Parameter* p : gpt.parameters()) {
    for (int k = 0; k < 2; ++k) {
      moments.push_back(be->empty(p->value_full.shape(), DType::f32, MemTag::optimizer));
      be->fill_zero(moments.back().raw(), int64_t(moments.back().nbytes()));
    }
    ts.push_back({.param = p->value_full.f32(), .compute = p->compute_full.raw(), .grad = p->grad_full.f32(),
                  .m = moments[moments.size() - 2].f32(), .v = moments.back().f32(), .n = p->value_full.numel(),
                  .weight_decay = p->spec.decay() ? wd : 0.f});
  }
  auto opt = be->plan_adamw(ts);
  const std::vector<float> ref_steps = r.read_f32("step_losses");
  ASSERT_EQ(int64_t(ref_steps.size()), steps);
  double step_err = 0;
  for (int64_t s = 0; s < steps; ++s) {
    gpt.zero_grad();
    const float l = gpt.forward(tok, tgt, {.fuse_backward = true});
    gpt.backward();
    opt->step({.lr = meta_double(r, "lr"), .beta1 = meta_double(r, "beta1"), .beta2 = meta_double(r, "beta2"),
               .eps = meta_double(r, "eps"), .step = s + 1, .max_norm = float(meta_double(r, "max_norm"))});
    step_err = std::max(step_err, std::fabs(double(l) - ref_steps[size_t(s)]));
  }
  EXPECT_LE(step_err, 2e-2);
  std::printf("[one GPT on %s] attention %s: loss rel %.2e, logits rel %.2e, worst grad rel %.2e (%s), grad norm rel "
              "%.2e, AdamW step losses max abs %.2e\n",
              be->name().c_str(), std::string(attn_kernel_name(be->attention_kernel(
                                      static_cast<model::TransformerBlock*>(gpt.chain()[1])->attention_shape(B, T))))
                                      .c_str(),
              loss_err, logits_err, worst, worst_name.c_str(), norm_err, step_err);
}

// Head size 64 (the flash and cuDNN kernels): the same model on the CPU (f32) and on CUDA (bf16)
// from one seed gives the same loss and gradients within the bf16 tolerances, with every attention
// kernel the CUDA backend has; the KV-cache decoder on CUDA gives the full forward's logits.
TEST(GPTOnCuda, MatchesTheCpuModelWithEveryAttentionKernel) {
  REQUIRE_CUDA_BACKEND();
  model::GPTConfig cfg = model::gpt_preset("gpt2-tiny");
  cfg.n_layer = 2;
  cfg.n_head = 2;
  cfg.n_embd = 128;
  cfg.block_size = 64;
  cfg.vocab_size = 300;
  const int64_t B = 2, T = 48;
  std::mt19937 rng(3);
  std::vector<int32_t> tokens(size_t(B * T)), targets(size_t(B * T));
  for (auto& x : tokens) x = int32_t(rng() % uint32_t(cfg.vocab_size));
  for (auto& x : targets) x = int32_t(rng() % uint32_t(cfg.vocab_size));
  targets[5] = -1;
  const Tensor tok = host_i32(tokens, B, T), tgt = host_i32(targets, B, T);

  MemoryPool host("cpu-model");
  model::GPT ref(cfg, host, 11);
  const float ref_loss = ref.forward(tok, tgt, {.fuse_backward = true});
  ref.backward();

  for (AttnKernel k : {AttnKernel::automatic, AttnKernel::flash, AttnKernel::gemm}) {
    auto be = make_backend(Device::cuda, {.attention = k});
    model::GPT gpt(cfg, *be, 11);
    gpt.zero_grad();
    const float loss = gpt.forward(tok, tgt, {.fuse_backward = true});
    gpt.backward();
    const std::string kname(attn_kernel_name(
        be->attention_kernel(static_cast<model::TransformerBlock*>(gpt.chain()[1])->attention_shape(B, T))));
    EXPECT_LE(std::fabs(double(loss) - ref_loss) / ref_loss, 5e-3) << kname;
    for (size_t i = 0; i < gpt.parameters().size(); ++i) {
      const model::Parameter* p = gpt.parameters()[i];
      const Tensor& rg = ref.parameters()[i]->grad;
      const std::vector<float> want(rg.f32(), rg.f32() + rg.numel());
      EXPECT_LE(rel_err(download(*be, p->grad), want), 5e-2) << kname << ": gradient of " << p->spec.name;
    }
  }

  // Decoding: a prefill of 40 tokens, then 8 one-token steps, against the full forward of the 48.
  auto be = make_backend(Device::cuda);
  model::GPT gpt(cfg, *be, 11);
  const Tensor one = host_i32(std::vector<int32_t>(tokens.begin(), tokens.begin() + T), 1, T);
  gpt.forward(one, Tensor());
  const std::vector<float> full = download(*be, gpt.logits());
  model::CachedDecoder dec(gpt, 1, T);
  const int64_t Vp = cfg.padded_vocab();
  std::vector<float> got, want;
  const Tensor& pre = dec.forward(tokens.data(), 40);
  got.insert(got.end(), pre.f32(), pre.f32() + Vp);
  want.insert(want.end(), full.begin() + 39 * Vp, full.begin() + 40 * Vp);
  for (int64_t t = 40; t < T; ++t) {
    const Tensor& l = dec.forward(tokens.data() + t, 1);
    got.insert(got.end(), l.f32(), l.f32() + Vp);
    want.insert(want.end(), full.begin() + t * Vp, full.begin() + (t + 1) * Vp);
  }
  EXPECT_LE(rel_err(got, want), 2e-2) << "decoder logits against the full forward";
}
