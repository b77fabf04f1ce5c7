// The one GPT (model/gpt.h, the chain blocks over core/backend.h) on the CUDA backend: the same
// model code the CPU runs, here in bf16 with f32 master weights, against the PyTorch reference
// dump (tests/data/gpt2_tiny_reference.safetensors, written by scripts/torch_reference.py) and
// against itself through the KV-cache decoder. Host code only (compiled by the C++ compiler);
// skipped without a GPU. Tolerances are those of the bf16 model (bf16 activations compounded over
// the network): loss 5e-3 relative, logits 2e-2 (norm), every parameter gradient 5e-2 (norm), the
// global gradient norm 2e-2, AdamW step losses 2e-2 absolute; decoder logits against the full
// forward's 2e-2 (norm: the same bf16 ops on other row counts). Tensor / sequence parallel ranks
// sharing the GPU are held to the same bounds against the CPU model.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "comm/nccl_comm.h"
#include "comm/threads.h"
#include "core/backend.h"
#include "core/error.h"
#include "kernels/cuda/cudnn_attention.cuh"
#include "model/gpt.h"
#include "model/kv_cache.h"
#include "model/reference_util.h"

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

Tensor host_i32(const std::vector<int32_t>& v, int64_t B, int64_t T) {
  Tensor t = Tensor::empty({B, T}, DType::i32, MemTag::workspace);
  std::copy(v.begin(), v.end(), t.i32());
  return t;
}

}  // namespace

// The reference check the CPU model passes (model/reference_util.h), on CUDA with the bf16 model's
// tolerances (its AdamW steps through train::StepRunner, as CUDA graphs).
TEST(GPTOnCuda, MatchesPyTorchReference) {
  REQUIRE_CUDA_BACKEND();
  const std::string path = std::string(LOOM_SOURCE_DIR) + "/tests/data/gpt2_tiny_reference.safetensors";
  if (!std::filesystem::exists(path)) GTEST_SKIP() << path << " is missing (scripts/torch_reference.py writes it)";
  test::check_gpt_reference(
      path, {.loss_rel = 5e-3, .logits_rel = 2e-2, .grad_rel = 5e-2, .grad_norm_rel = 2e-2, .step_loss_abs = 2e-2},
      Device::cuda);
}

namespace {

// The same model on the CPU (f32) and on CUDA (bf16) from one seed gives the same loss and
// gradients within the bf16 tolerances, with each of `kernels`; the KV-cache decoder on CUDA gives
// the full forward's logits.
void check_against_cpu(const model::GPTConfig& cfg, const std::vector<AttnKernel>& kernels) {
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

  for (AttnKernel k : kernels) {
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

}  // namespace

// Head size 64 (the flash and cuDNN kernels), every attention kernel the CUDA backend has.
TEST(GPTOnCuda, MatchesTheCpuModelWithEveryAttentionKernel) {
  REQUIRE_CUDA_BACKEND();
  model::GPTConfig cfg = model::gpt_preset("gpt2-tiny");
  cfg.n_layer = 2;
  cfg.n_head = 2;
  cfg.n_embd = 128;
  cfg.block_size = 64;
  cfg.vocab_size = 300;
  check_against_cpu(cfg, {AttnKernel::automatic, AttnKernel::flash, AttnKernel::gemm});
}

// The Llama family (RMSNorm, rotary embeddings, SwiGLU, no biases, untied head) with grouped-query
// attention (4 query heads on 2 key/value heads, head size 64: cuDNN's graphs, which automatic
// picks where cuDNN is built in, and loom's flash kernels) and, separately, with multi-head
// attention on every kernel.
TEST(LlamaOnCuda, MatchesTheCpuModel) {
  REQUIRE_CUDA_BACKEND();
  model::GPTConfig cfg = model::gpt_preset("llama-tiny");
  cfg.n_embd = 256;
  cfg.n_head = 4;
  cfg.n_kv_head = 2;
  cfg.ffn_hidden = 352;  // (shards of 176 and 88 under tp 2 and 4: GEMM widths, multiples of 8)
  cfg.block_size = 64;
  cfg.vocab_size = 300;
  check_against_cpu(cfg, {AttnKernel::automatic, AttnKernel::flash});
  if (loom::cuda::cudnn_available()) check_against_cpu(cfg, {AttnKernel::cudnn});
  cfg.n_kv_head = 4;
  check_against_cpu(cfg, {AttnKernel::automatic, AttnKernel::flash, AttnKernel::gemm});
}

namespace {

// Tensor (and sequence) and context parallelism on CUDA: tp x cp ranks as threads of this process
// sharing the GPU (tp the inner dimension), each a GPT over device communicators for its tp and
// cp groups (comm/nccl_comm.h: the staged path, as the ranks share one GPU; the cp group's host
// communicator for the loss), against the CPU model in f32 from the same seed: every rank's loss
// within 5e-3 relative, and every rank's part of every parameter gradient (after the partial sums
// that data parallelism would add over tp and cp: sequence-parallel norms, replicated key/value
// heads, each cp rank's share of the sequence) within 5e-2 (norm) of the same elements of the CPU
// model's, the bf16 model's tolerances above.
void check_model_parallel(const model::GPTConfig& cfg, int tp, bool sp, int cp = 1) {
  const int64_t B = 2, T = 48;
  std::mt19937 rng(5);
  std::vector<int32_t> tokens(size_t(B * T)), targets(size_t(B * T));
  for (auto& x : tokens) x = int32_t(rng() % uint32_t(cfg.vocab_size));
  for (auto& x : targets) x = int32_t(rng() % uint32_t(cfg.vocab_size));
  targets[7] = -1;
  const Tensor tok = host_i32(tokens, B, T), tgt = host_i32(targets, B, T);

  MemoryPool host("cpu-model");
  model::GPT ref(cfg, host, 11);
  const float ref_loss = ref.forward(tok, tgt, {.fuse_backward = true});
  ref.backward();

  const std::string what = fmt::format("{} tp {}{} cp {}", cfg.name, tp, sp ? " + sp" : "", cp);
  comm::run_ranks(tp * cp, [&](comm::Comm& world) {
    const int r = world.rank();
    auto be = make_backend(Device::cuda);
    // The groups' collectives on the backend's stream, after the ops that wrote their buffers.
    auto tp_host = world.split(r / tp, r % tp), cp_host = world.split(r % tp, r / tp);
    auto tp_dev = tp > 1 ? be->buffer_comm(tp_host->split(0, tp_host->rank()), false) : nullptr;
    auto cp_dev = cp > 1 ? be->buffer_comm(cp_host->split(0, cp_host->rank()), false) : nullptr;
    for (const auto* g : {tp_dev.get(), cp_dev.get()}) ASSERT_TRUE(!g || g->device_buffers());
    model::GPT gpt(cfg, *be, 11,
                   {.groups = {.tp = tp_dev.get(), .cp = cp_dev.get(), .tp_host = tp > 1 ? tp_host.get() : nullptr,
                               .cp_host = cp > 1 ? cp_host.get() : nullptr},
                    .sp = sp});
    gpt.zero_grad();
    const float loss = gpt.forward(tok, tgt, {.fuse_backward = true});
    gpt.backward();
    EXPECT_LE(std::fabs(double(loss) - ref_loss) / ref_loss, 5e-3) << what << ", rank " << r;
    for (size_t i = 0; i < gpt.parameters().size(); ++i) {
      const model::Parameter* p = gpt.parameters()[i];
      p->sum_partial_gradients(0, p->spec.numel(), p->grad.f32(), tp_dev.get());
      if (cp_dev) cp_dev->all_reduce(p->grad.f32(), p->grad.numel(), DType::f32);
      const std::vector<float> mine = download(*be, p->grad);
      const Tensor& rg = ref.parameter(p->spec.name).grad;
      std::vector<float> got, want;
      for (const model::ShardSegment& s : p->segments()) {
        got.insert(got.end(), mine.begin() + s.local, mine.begin() + s.local + s.n);
        want.insert(want.end(), rg.f32() + s.global, rg.f32() + s.global + s.n);
      }
      EXPECT_LE(rel_err(got, want), 5e-2) << what << ", rank " << r << ": gradient of " << p->spec.name;
    }
  });
}

// GPT-2 with heads of 64 (cuDNN or flash attention) and a vocabulary that tp splits into shards
// with padding.
model::GPTConfig small_gpt() {
  model::GPTConfig cfg = model::gpt_preset("gpt2-tiny");
  cfg.n_layer = 2;
  cfg.n_head = 4;
  cfg.n_embd = 256;
  cfg.block_size = 64;
  cfg.vocab_size = 300;
  return cfg;
}

// The Llama family with 2 key/value heads of 64.
model::GPTConfig small_llama() {
  model::GPTConfig cfg = model::gpt_preset("llama-tiny");
  cfg.n_embd = 256;
  cfg.n_head = 4;
  cfg.n_kv_head = 2;
  cfg.ffn_hidden = 352;  // (shards of 176 and 88 under tp 2 and 4: GEMM widths, multiples of 8)
  cfg.block_size = 64;
  cfg.vocab_size = 300;
  return cfg;
}

}  // namespace

// tp 2 and 4, with and without sequence parallelism.
TEST(GPTOnCuda, TensorParallelRanksSharingTheGpuMatchTheCpuModel) {
  REQUIRE_CUDA_BACKEND();
  for (int tp : {2, 4})
    for (bool sp : {false, true}) check_model_parallel(small_gpt(), tp, sp);
}

// Key/value heads split over tp 2, replicated under tp 4.
TEST(LlamaOnCuda, TensorParallelRanksSharingTheGpuMatchTheCpuModel) {
  REQUIRE_CUDA_BACKEND();
  for (int tp : {2, 4})
    for (bool sp : {false, true}) check_model_parallel(small_llama(), tp, sp);
}

// Context parallelism (ring attention) on CUDA, alone, with tp + sp, over 4 ranks (T = 48: chunks
// of 6 positions), and for the Llama family (rotary positions of each rank's two chunks, GQA).
TEST(GPTOnCuda, ContextParallelRanksSharingTheGpuMatchTheCpuModel) {
  REQUIRE_CUDA_BACKEND();
  check_model_parallel(small_gpt(), 1, false, 2);
  check_model_parallel(small_gpt(), 1, false, 4);
  check_model_parallel(small_gpt(), 2, true, 2);
}

TEST(LlamaOnCuda, ContextParallelRanksSharingTheGpuMatchTheCpuModel) {
  REQUIRE_CUDA_BACKEND();
  check_model_parallel(small_llama(), 1, false, 2);
  check_model_parallel(small_llama(), 2, false, 2);
}

// A tp or cp group whose communicator takes host memory only is refused by name on the GPU.
TEST(GPTOnCuda, LayoutsWithoutDeviceCollectivesAreRefusedByName) {
  REQUIRE_CUDA_BACKEND();
  model::GPTConfig cfg = model::gpt_preset("gpt2-tiny");
  cfg.vocab_size = 300;
  comm::run_ranks(2, [&](comm::Comm& world) {
    auto be = make_backend(Device::cuda);
    for (const char* group : {"tp", "cp"}) {
      try {
        model::ParallelGroups g;
        (std::string(group) == "tp" ? g.tp : g.cp) = &world;
        model::GPT gpt(cfg, *be, 11, {.groups = g});
        ADD_FAILURE() << "a host communicator was taken for a GPU's " << group << " group";
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("needs a device communicator"), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find(group), std::string::npos) << e.what();
      }
    }
  });
}
