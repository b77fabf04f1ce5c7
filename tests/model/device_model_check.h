// The one model on a device backend against the CPU's f32 model, shared by the CUDA test
// (gpt_cuda_backend_test.cu) and the emulated device's (emu_model_test.cpp).
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "comm/threads.h"
#include "core/backend.h"
#include "core/error.h"
#include "model/gpt.h"
#include "model/kv_cache.h"

namespace loom::test {

// The configurations the device checks run: a 2-layer GPT of `heads` heads of size 64 (the flash
// and cuDNN kernels take it; a vocabulary of 300 that tp splits into shards with padding), and the
// Llama family (RMSNorm, rotary embeddings, SwiGLU, no biases, untied
// head) with 4 query heads on `kv_heads` key/value heads of size 64.
inline model::GPTConfig device_check_gpt(int64_t heads) {
  model::GPTConfig cfg = model::gpt_preset("gpt2-tiny");
  cfg.n_layer = 2;
  cfg.n_head = heads;
  cfg.n_embd = 64 * heads;
  cfg.block_size = 64;
  cfg.vocab_size = 300;
  return cfg;
}
inline model::GPTConfig device_check_llama(int64_t kv_heads) {
  model::GPTConfig cfg = model::gpt_preset("llama-tiny");
  cfg.n_embd = 256;
  cfg.n_head = 4;
  cfg.n_kv_head = kv_heads;
  cfg.ffn_hidden = 352;  // (shards of 176 and 88 under tp 2 and 4: GEMM widths, multiples of 8)
  cfg.block_size = 64;
  cfg.vocab_size = 300;
  return cfg;
}

inline double rel_err(const std::vector<float>& a, const std::vector<float>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (!std::isfinite(a[i])) return INFINITY;
    num += (double(a[i]) - ref[i]) * (double(a[i]) - ref[i]);
    den += double(ref[i]) * ref[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

inline std::vector<float> download(Backend& be, const Tensor& t) {
  std::vector<float> v(size_t(t.numel()));
  be.download(v.data(), t.raw(), t.dtype(), t.numel());
  return v;
}

inline Tensor host_i32(const std::vector<int32_t>& v, int64_t B, int64_t T) {
  Tensor t = Tensor::empty({B, T}, DType::i32, MemTag::workspace);
  std::copy(v.begin(), v.end(), t.i32());
  return t;
}

// A batch of B = 2 sequences of T = 48 random ids (from `seed`, target `ignored` set to -1), and
// the CPU model's (f32, seed 11) loss and gradients on it.
struct CpuReference {
  static constexpr int64_t B = 2, T = 48;
  std::vector<int32_t> tokens, targets;
  Tensor tok, tgt;
  MemoryPool host{"cpu-model"};
  model::GPT ref;
  float loss = 0;
  CpuReference(const model::GPTConfig& cfg, uint32_t seed, size_t ignored)
      : tokens(size_t(B * T)), targets(size_t(B * T)), ref(cfg, host, 11) {
    std::mt19937 rng(seed);
    for (auto& x : tokens) x = int32_t(rng() % uint32_t(cfg.vocab_size));
    for (auto& x : targets) x = int32_t(rng() % uint32_t(cfg.vocab_size));
    targets[ignored] = -1;
    tok = host_i32(tokens, B, T);
    tgt = host_i32(targets, B, T);
    loss = ref.forward(tok, tgt, {.fuse_backward = true});
    ref.backward();
  }
};

// The same model on the CPU (f32) and on `device` (bf16) from one seed gives the same loss (5e-3
// relative) and gradients (5e-2, norm) with each of `kernels`; the KV-cache decoder on the device
// gives the full forward's logits (2e-2, norm: the same bf16 ops on other row counts).
inline void check_against_cpu(const model::GPTConfig& cfg, Device device, const std::vector<AttnKernel>& kernels) {
  const CpuReference c(cfg, 3, 5);
  const int64_t B = c.B, T = c.T;
  const std::vector<int32_t>& tokens = c.tokens;
  const Tensor &tok = c.tok, &tgt = c.tgt;
  const model::GPT& ref = c.ref;
  const float ref_loss = c.loss;

  for (AttnKernel k : kernels) {
    auto be = make_backend(device, {.attention = k});
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
  auto be = make_backend(device);
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

// Tensor (and sequence) and context parallelism on `device`: tp x cp ranks as threads of this
// process sharing it (tp the inner dimension), each a GPT over device communicators for its tp and
// cp groups (Backend::buffer_comm; on CUDA comm/nccl_comm.h's staged path, as the ranks share one
// GPU; the cp group's host communicator for the loss), against the CPU model in f32 from the same
// seed: every rank's loss
// within 5e-3 relative, and every rank's part of every parameter gradient (after the partial sums
// that data parallelism would add over tp and cp: sequence-parallel norms, replicated key/value
// heads, each cp rank's share of the sequence) within 5e-2 (norm) of the same elements of the CPU
// model's, the bf16 model's tolerances above.
inline void check_model_parallel(const model::GPTConfig& cfg, Device device, int tp, bool sp, int cp = 1) {
  const CpuReference c(cfg, 5, 7);
  const Tensor &tok = c.tok, &tgt = c.tgt;
  const model::GPT& ref = c.ref;
  const float ref_loss = c.loss;

  const std::string what = fmt::format("{} tp {}{} cp {}", cfg.name, tp, sp ? " + sp" : "", cp);
  comm::run_ranks(tp * cp, [&](comm::Comm& world) {
    const int r = world.rank();
    auto be = make_backend(device);
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

// A tp or cp group whose communicator takes host memory only is refused by name on `device`.
inline void check_host_groups_refused(Device device) {
  model::GPTConfig cfg = model::gpt_preset("gpt2-tiny");
  cfg.vocab_size = 300;
  comm::run_ranks(2, [&](comm::Comm& world) {
    auto be = make_backend(device);
    for (const char* group : {"tp", "cp"}) {
      try {
        model::ParallelGroups g;
        (std::string(group) == "tp" ? g.tp : g.cp) = &world;
        model::GPT gpt(cfg, *be, 11, {.groups = g});
        ADD_FAILURE() << "a host communicator was taken for a device's " << group << " group";
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("needs a device communicator"), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find(group), std::string::npos) << e.what();
      }
    }
  });
}

}  // namespace loom::test
