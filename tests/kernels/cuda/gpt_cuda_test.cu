// The GPU GPT-2 step: against the PyTorch reference dump (tests/data, written by
// scripts/torch_reference.py in float64/f32), flash vs GEMM and cuDNN attention, CUDA graph vs eager, the
// step profile, memory tags and input errors. The model computes in bf16 with f32 accumulation and f32 master weights,
// so tolerances are bf16-compounded over the whole network:
//   loss 5e-3 relative, logits 2e-2 (norm), every parameter gradient 5e-2 (norm), the global
//   gradient norm 2e-2, AdamW step losses 2e-2 absolute.
// The same model run as CUDA graphs and kernel by kernel (or profiled) launches the same kernels
// in the same order; only the f32 atomics of the token-embedding gradient may add in another order
// (last bits of a few gradients), so step losses agree within kGraphLossTol = 1e-3 absolute and
// parameters within 1e-4 relative after a dozen AdamW steps.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <memory>
#include <set>
#include <string>

#include "cuda_test_util.h"
#include "kernels/cuda/allocator.cuh"
#include "kernels/cuda/attention.cuh"
#include "kernels/cuda/attn_gemm.cuh"
#include "kernels/cuda/cudnn_attention.cuh"
#include "kernels/cuda/matmul.cuh"
#include "kernels/cuda/profile.cuh"
#include "model/gpt_cuda.cuh"
#include "train/safetensors.h"

using namespace loom;
using namespace loom::test;

namespace {

int64_t meta_int(const train::SafetensorsReader& r, const std::string& k) { return std::stoll(r.meta(k)); }
double meta_double(const train::SafetensorsReader& r, const std::string& k) { return std::stod(r.meta(k)); }

constexpr double kGraphLossTol = 1e-3;  // graph against kernel-by-kernel launches (see the top)

// gpt2-tiny (head size 16: the GEMM attention) on B x T, built twice from one seed: g replays
// CUDA graphs, e launches kernel by kernel.
struct GraphAndEager {
  model::GPTConfig cfg = model::gpt_preset("gpt2-tiny");
  model::GPTCudaOptions o;
  std::unique_ptr<model::GPTCuda> g, e;
  GraphAndEager(int64_t B, int64_t T, uint64_t seed) {
    o.B = B;
    o.T = T;
    o.attention = model::CudaAttention::gemm;
    o.lr = 3e-3f;
    o.cuda_graph = true;
    g = std::make_unique<model::GPTCuda>(cfg, o, cuda::device_pool(), seed);
    o.cuda_graph = false;
    e = std::make_unique<model::GPTCuda>(cfg, o, cuda::device_pool(), seed);
  }
};

}  // namespace

TEST(GPTCuda, MatchesPyTorchReference) {
  LOOM_REQUIRE_GPU();
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
  model::GPTCudaOptions opt;
  opt.B = B;
  opt.T = T;
  opt.attention = cuda::flash_head_size_supported(cfg.head_size()) ? model::CudaAttention::flash
                                                                   : model::CudaAttention::gemm;
  opt.lr = float(meta_double(r, "lr"));
  opt.beta1 = float(meta_double(r, "beta1"));
  opt.beta2 = float(meta_double(r, "beta2"));
  opt.eps = float(meta_double(r, "eps"));
  opt.weight_decay = float(meta_double(r, "weight_decay"));
  opt.grad_clip = float(meta_double(r, "max_norm"));
  model::GPTCuda gpt(cfg, opt, cuda::device_pool());
  for (const model::ParamSpec& s : gpt.specs()) gpt.set_parameter(s.name, r.read_f32("param." + s.name).data());
  std::vector<int32_t> tokens(size_t(B * T)), targets(size_t(B * T));
  r.read_into("tokens", tokens.data(), tokens.size() * 4, DType::i32, {B, T});
  r.read_into("targets", targets.data(), targets.size() * 4, DType::i32, {B, T});

  const float loss = gpt.forward(tokens.data(), targets.data());
  const float ref_loss = r.read_f32("loss").at(0);
  const double loss_err = std::fabs(double(loss) - ref_loss) / std::fabs(double(ref_loss));
  EXPECT_LE(loss_err, 5e-3) << "loss " << loss << " vs " << ref_loss;
  auto lp = gpt.logits();
  auto ref_logits = r.read_f32("logits");
  std::vector<float> logits(size_t(B * T * V));
  double pad = 0;
  for (int64_t i = 0; i < B * T; ++i) {
    for (int64_t j = 0; j < V; ++j) logits[size_t(i * V + j)] = lp[size_t(i * Vp + j)];
    for (int64_t j = V; j < Vp; ++j) pad = std::max(pad, double(std::fabs(lp[size_t(i * Vp + j)])));
  }
  EXPECT_EQ(pad, 0.0) << "padding logits";
  const double logits_err = rel_err(logits, ref_logits);
  EXPECT_LE(logits_err, 2e-2);

  const float loss2 = gpt.forward_backward(tokens.data(), targets.data());
  EXPECT_EQ(loss2, loss) << "the fused loss gradient must not change the loss";
  double worst = 0, ss = 0;
  std::string worst_name;
  for (const model::ParamSpec& s : gpt.specs()) {
    auto g = gpt.gradient(s.name);
    auto ref = r.read_f32("grad." + s.name);
    const double e = rel_err(g, ref);
    EXPECT_LE(e, 5e-2) << "gradient of " << s.name;
    if (e > worst) worst = e, worst_name = s.name;
    for (float x : g) ss += double(x) * x;
  }
  const double ref_norm = std::stod(r.meta("grad_norm"));
  const double norm_err = std::fabs(std::sqrt(ss) - ref_norm) / ref_norm;
  EXPECT_LE(norm_err, 2e-2);

  auto ref_steps = r.read_f32("step_losses");
  ASSERT_EQ(int64_t(ref_steps.size()), steps);
  double step_err = 0;
  std::string losses;
  for (int64_t s = 0; s < steps; ++s) {
    const float l = gpt.train_step(tokens.data(), targets.data(), opt.lr, s + 1);
    step_err = std::max(step_err, std::fabs(double(l) - ref_steps[size_t(s)]));
    losses += fmt::format(" {:.4f}/{:.4f}", l, ref_steps[size_t(s)]);
  }
  EXPECT_LE(step_err, 2e-2);
  std::printf("[gpu reference %s] loss rel %.2e, logits rel %.2e, worst grad rel %.2e (%s), grad norm rel %.2e, "
              "steps (loom/ref)%s, max abs %.2e\n",
              cfg.name.c_str(), loss_err, logits_err, worst, worst_name.c_str(), norm_err, losses.c_str(), step_err);
}

TEST(GPTCuda, FlashAttentionMatchesGemmAttention) {
  LOOM_REQUIRE_GPU();
  model::GPTConfig cfg = model::gpt_preset("gpt2-tiny");
  cfg.n_layer = 2;
  cfg.n_head = 2;
  cfg.n_embd = 128;  // head size 64
  cfg.block_size = 256;
  model::GPTCudaOptions o;
  o.B = 2;
  o.T = 192;
  auto tok = random_tokens(o.B * o.T, cfg.vocab_size, 1), tgt = random_tokens(o.B * o.T, cfg.vocab_size, 2);
  o.attention = model::CudaAttention::gemm;
  model::GPTCuda a(cfg, o, cuda::device_pool(), 7);
  o.attention = model::CudaAttention::flash;
  model::GPTCuda b(cfg, o, cuda::device_pool(), 7);
  const float la = a.forward_backward(tok.data(), tgt.data()), lb = b.forward_backward(tok.data(), tgt.data());
  EXPECT_LE(std::fabs(la - lb) / la, 5e-3);
  double worst = 0;
  for (const model::ParamSpec& s : a.specs()) {
    const double e = rel_err(b.gradient(s.name), a.gradient(s.name));
    EXPECT_LE(e, 5e-2) << s.name;
    worst = std::max(worst, e);
  }
  std::printf("flash vs gemm attention: loss %.6f vs %.6f, worst grad rel %.2e\n", lb, la, worst);
}

TEST(GPTCuda, CudnnAttentionMatchesFlashAttention) {
  LOOM_REQUIRE_CUDNN();
  model::GPTConfig cfg = model::gpt_preset("gpt2-tiny");
  cfg.n_layer = 2;
  cfg.n_head = 2;
  cfg.n_embd = 128;  // head size 64
  cfg.block_size = 256;
  model::GPTCudaOptions o;
  o.B = 2;
  o.T = 192;
  o.lr = 3e-3f;
  auto tok = random_tokens(o.B * o.T, cfg.vocab_size, 5), tgt = random_tokens(o.B * o.T, cfg.vocab_size, 6);
  o.attention = model::CudaAttention::flash;
  model::GPTCuda a(cfg, o, cuda::device_pool(), 7);
  o.attention = model::CudaAttention::cudnn;
  model::GPTCuda b(cfg, o, cuda::device_pool(), 7);
  const float la = a.forward_backward(tok.data(), tgt.data()), lb = b.forward_backward(tok.data(), tgt.data());
  EXPECT_LE(std::fabs(la - lb) / la, 5e-3);
  double worst = 0;
  for (const model::ParamSpec& s : a.specs()) {
    const double e = rel_err(b.gradient(s.name), a.gradient(s.name));
    EXPECT_LE(e, 5e-2) << s.name;
    worst = std::max(worst, e);
  }
  // Training steps replayed as a CUDA graph (cuDNN's plans captured with the rest of the step).
  double step_diff = 0;
  for (int s = 1; s <= 4; ++s) {
    const float sa = a.train_step(tok.data(), tgt.data(), o.lr, s), sb = b.train_step(tok.data(), tgt.data(), o.lr, s);
    EXPECT_TRUE(std::isfinite(sb)) << "step " << s;
    step_diff = std::max(step_diff, std::fabs(double(sa) - sb));
  }
  EXPECT_LE(step_diff, 2e-2);
  std::printf("cudnn vs flash attention: loss %.6f vs %.6f, worst grad rel %.2e, 4 graph steps max |loss diff| %.2e\n",
              lb, la, worst, step_diff);
}

TEST(GPTCuda, GraphReplayMatchesEagerAndTrains) {
  LOOM_REQUIRE_GPU();
  GraphAndEager m(4, 64, 11);
  const model::GPTCudaOptions& o = m.o;
  model::GPTCuda &g = *m.g, &e = *m.e;
  auto tok = random_tokens(o.B * o.T, m.cfg.vocab_size, 3), tgt = random_tokens(o.B * o.T, m.cfg.vocab_size, 4);
  std::vector<float> lg, le;
  for (int s = 1; s <= 12; ++s) {
    lg.push_back(g.train_step(tok.data(), tgt.data(), o.lr, s));
    le.push_back(e.train_step(tok.data(), tgt.data(), o.lr, s));
    EXPECT_NEAR(lg.back(), le.back(), kGraphLossTol) << "step " << s;
    EXPECT_TRUE(std::isfinite(g.last_grad_norm()));
  }
  EXPECT_LT(lg.back(), lg.front() - 0.2f) << "12 AdamW steps on one batch must lower its loss";
  std::printf("graph vs eager: first %.4f / %.4f, last %.4f / %.4f\n", lg.front(), le.front(), lg.back(), le.back());
}

// The loss's 1 / (counted targets) is a value the captured step bakes in: a batch with ignored
// targets (-1) changes it, so the graph is captured again, and a batch with every target counted
// changes it back. Graph and eager training agree over A, B (a quarter of the targets ignored), A, B.
TEST(GPTCuda, GraphRecapturesWhenTheCountedTargetsChange) {
  LOOM_REQUIRE_GPU();
  GraphAndEager m(2, 64, 13);
  const model::GPTCudaOptions& o = m.o;
  model::GPTCuda &g = *m.g, &e = *m.e;
  const int64_t V = m.cfg.vocab_size;
  auto tok_a = random_tokens(o.B * o.T, V, 21), tgt_a = random_tokens(o.B * o.T, V, 22);
  auto tok_b = random_tokens(o.B * o.T, V, 23), tgt_b = random_tokens(o.B * o.T, V, 24);
  for (size_t i = 0; i < tgt_b.size(); i += 4) tgt_b[i] = -1;
  const std::vector<int32_t>* toks[] = {&tok_a, &tok_b, &tok_a, &tok_b};
  const std::vector<int32_t>* tgts[] = {&tgt_a, &tgt_b, &tgt_a, &tgt_b};
  for (int s = 1; s <= 4; ++s) {
    const float lg = g.train_step(toks[s - 1]->data(), tgts[s - 1]->data(), o.lr, s);
    const float le = e.train_step(toks[s - 1]->data(), tgts[s - 1]->data(), o.lr, s);
    EXPECT_NEAR(lg, le, kGraphLossTol) << "step " << s;
  }
  for (const model::ParamSpec& sp : g.specs())
    EXPECT_LE(rel_err(g.parameter(sp.name), e.parameter(sp.name)), 1e-4) << sp.name;
}

// The step's parts, timed by events (kernels/cuda/profile.cuh): every part of the forward,
// backward and update is marked with a positive time, the marked FLOPs add up to the model's
// GEMM and attention FLOPs exactly, profiling runs the same math as eager launches, and the
// model goes back to graphs afterwards.
TEST(GPTCuda, StepProfileCoversTheStep) {
  LOOM_REQUIRE_GPU();
  GraphAndEager m(2, 64, 17);
  const model::GPTConfig& cfg = m.cfg;
  const model::GPTCudaOptions& o = m.o;
  model::GPTCuda &g = *m.g, &e = *m.e;
  auto tok = random_tokens(o.B * o.T, cfg.vocab_size, 31), tgt = random_tokens(o.B * o.T, cfg.vocab_size, 32);
  cuda::StepProfile prof(g.stream());
  g.set_profile(&prof);
  const int64_t launches = g.graph_launches();
  for (int s = 1; s <= 2; ++s) {
    prof.start();
    const float lg = g.train_step(tok.data(), tgt.data(), o.lr, s);
    prof.finish();
    EXPECT_NEAR(lg, e.train_step(tok.data(), tgt.data(), o.lr, s), kGraphLossTol) << "step " << s;
  }
  g.set_profile(nullptr);
  EXPECT_EQ(g.graph_launches(), launches) << "profiled steps run kernel by kernel";
  EXPECT_EQ(prof.steps(), 2);
  std::set<std::string> names;
  double flops = 0;
  for (const auto& p : prof.parts()) {
    names.insert(p.name);
    EXPECT_GT(p.ms, 0.0) << p.name;
    flops += p.flops;
  }
  for (const char* want : {"upload batch + zero grads", "fwd embedding + layernorm", "fwd qkv matmul", "fwd attention",
                           "fwd attn-proj matmul", "fwd residual + layernorm", "fwd fc matmul + gelu",
                           "fwd mlp-proj matmul", "fwd logits matmul", "fwd cross-entropy + dlogits",
                           "bwd logits matmul", "bwd layernorm", "bwd mlp-proj matmul + dgelu", "bwd fc matmul",
                           "bwd attn-proj matmul", "bwd attention", "bwd qkv matmul", "bwd embedding",
                           "adamw (norm, clip, update, bf16 copy)"})
    EXPECT_EQ(names.count(want), 1u) << want;
  EXPECT_EQ(names.size(), 19u);
  // Per step: GEMMs 2 FLOPs per multiply-add forward, twice that backward; attention 2 B T^2 C
  // forward (causal) and 2.5 times that backward, per layer.
  const double B = double(o.B), T = double(o.T), C = double(cfg.n_embd), L = double(cfg.n_layer);
  const double Vp = double(cfg.padded_vocab());
  const double want = 6.0 * B * T * (L * 12.0 * C * C + C * Vp) + L * 7.0 * B * T * T * C;
  EXPECT_NEAR(flops / 2.0, want, 1e-9 * want);
  EXPECT_GT(prof.total_ms(), 0.0);
  // Graphed again, still the eager twin's step.
  EXPECT_NEAR(g.train_step(tok.data(), tgt.data(), o.lr, 3), e.train_step(tok.data(), tgt.data(), o.lr, 3),
              kGraphLossTol);
  EXPECT_EQ(g.graph_launches(), launches + 1) << "the step after profiling is a graph replay";
}

TEST(GPTCuda, MemoryIsTaggedAndReturned) {
  LOOM_REQUIRE_GPU();
  MemoryPool& pool = cuda::device_pool();
  // The GEMM libraries' handles and workspaces are the model's own (its backend instance's): they
  // are taken with the model and given back with it.
  const MemStats before = pool.stats();
  model::GPTConfig cfg = model::gpt_preset("gpt2-tiny");
  {
    model::GPTCudaOptions o;
    o.B = 2;
    o.T = 32;
    o.attention = model::CudaAttention::gemm;
    model::GPTCuda m(cfg, o, pool);
    const int64_t n = m.num_parameters();
    EXPECT_GE(pool.current(MemTag::params) - before.current[int(MemTag::params)], n * 6);   // f32 master + bf16
    EXPECT_GE(pool.current(MemTag::grads) - before.current[int(MemTag::grads)], n * 4);
    EXPECT_GE(pool.current(MemTag::optimizer) - before.current[int(MemTag::optimizer)], n * 8);
    EXPECT_GT(pool.current(MemTag::activations), before.current[int(MemTag::activations)]);
    // cuBLASLt's and (GEMM attention) cuBLAS's workspaces, 32 MiB each.
    EXPECT_GE(pool.current(MemTag::workspace) - before.current[int(MemTag::workspace)], int64_t(64) << 20);
  }
  for (int t = 0; t < kNumMemTags; ++t) EXPECT_EQ(pool.current(MemTag(t)), before.current[t]) << mem_tag_name(MemTag(t));
}

TEST(GPTCuda, BadInputIsAnError) {
  LOOM_REQUIRE_GPU();
  model::GPTConfig cfg = model::gpt_preset("gpt2-tiny");
  model::GPTCudaOptions o;
  o.B = 1;
  o.T = cfg.block_size + 1;
  o.attention = model::CudaAttention::gemm;
  EXPECT_THROW(model::GPTCuda(cfg, o, cuda::device_pool()), Error);
  o.T = 16;
  o.attention = model::CudaAttention::flash;  // head size 16
  EXPECT_THROW(model::GPTCuda(cfg, o, cuda::device_pool()), Error);
  o.attention = model::CudaAttention::gemm;
  model::GPTCuda m(cfg, o, cuda::device_pool());
  std::vector<int32_t> tok(16, 1), tgt(16, 2);
  tok[3] = int32_t(cfg.vocab_size);
  EXPECT_THROW(m.forward(tok.data(), tgt.data()), Error);
  tok[3] = 0;
  tgt[5] = -2;
  EXPECT_THROW(m.forward(tok.data(), tgt.data()), Error);
  EXPECT_THROW(m.set_parameter("h.9.ln_1.weight", tok.data() ? std::vector<float>(64).data() : nullptr), Error);
  MemoryPool host("host");
  EXPECT_THROW(model::GPTCuda(cfg, o, host), Error);
}
