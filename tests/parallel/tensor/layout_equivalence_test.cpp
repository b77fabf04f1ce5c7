// Parallel equals single-device: tp in {1, 2, 4}, sp on and off, cp in {1, 2, 4}, with dp = 2
// (world up to 8, ranks as threads), data parallelism over dp x cp as the trainer runs it
// (parallel::DataParallel: ZeRO 0-3, optimizer offload). 20 AdamW steps of the tiny GPT
// (vocabulary 503: not divisible by tp), and of the tiny Llama (llama-tiny: RMSNorm, rotary
// positions, SwiGLU, 2 key/value heads for 4 query heads, no biases, untied head), must give
// per-step losses within 1e-5 relative of
// model::GPT and final parameters within ||p - p_ref|| / ||p_ref|| <= 1e-5, over all parameters
// and for each one. Every rank's peak bytes of parameters, gradients and optimizer state (device
// and host pools) equal the formulas of data_parallel.h.
#include <gtest/gtest.h>

#include <omp.h>

#include <cmath>
#include <tuple>
#include <map>
#include <memory>
#include <mutex>

#include "comm/threads.h"
#include "core/error.h"
#include "core/rng.h"
#include "model/gpt.h"
#include "optim/adamw.h"
#include "parallel/data/data_parallel.h"
#include "parallel/mesh.h"

using namespace loom;

namespace {

constexpr int kSteps = 20;

struct Layout {
  int dp = 1, cp = 1, tp = 1;
  bool sp = false;
  int64_t B = 4, T = 64;  // global batch per step
  int64_t vocab = 503;
  int zero = 0;  // ZeRO stage over dp x cp, 0-3
  bool offload = false;  // AdamW state and update in the host pool
  bool llama = false;    // llama-tiny instead of gpt2-tiny
};

std::string layout_name(const testing::TestParamInfo<Layout>& i) {
  const Layout& l = i.param;
  return fmt::format("{}dp{}_cp{}_tp{}{}_B{}_T{}_V{}{}{}", l.llama ? "llama_" : "", l.dp, l.cp, l.tp,
                     l.sp ? "_sp" : "", l.B, l.T, l.vocab, l.zero ? fmt::format("_zero{}", l.zero) : "",
                     l.offload ? "_offload" : "");
}

model::GPTConfig tiny(int64_t vocab, bool llama = false) {
  model::GPTConfig c = model::gpt_preset(llama ? "llama-tiny" : "gpt2-tiny");
  c.vocab_size = vocab;
  return c;
}

optim::AdamWConfig adam() {
  optim::AdamWConfig a;
  a.lr = 1e-3;
  a.max_norm = 1.0f;
  return a;
}

// Tokens and targets of step s, i32 [B, T] (the same data for every layout).
void batch(int step, int64_t B, int64_t T, int64_t V, Tensor& tok, Tensor& tgt) {
  for (int64_t i = 0; i < B * T; ++i) {
    tok.i32()[i] = int32_t(uniform_at(uint64_t(100 + step), 1, uint64_t(i)) * float(V));
    tgt.i32()[i] = int32_t(uniform_at(uint64_t(100 + step), 2, uint64_t(i)) * float(V));
  }
}

// Peak bytes of one rank during the steps, and the formulas' inputs.
struct RankMemory {
  int64_t params = 0, grads = 0, optimizer = 0;                 // the model's pool
  int64_t host_params = 0, host_grads = 0, host_optimizer = 0;  // the host pool (offload)
  int64_t n_pad = 0, shard = 0;  // N_pad and S
  int64_t bucket_peak = 0, max_use = 0;  // G and U
  int64_t alloc_sum = 0;         // sum over the rank's parameters of alloc_numel rounded up to 16
};

struct RunResult {
  std::vector<double> losses;
  std::vector<double> norms;  // the global gradient norm before clipping, per step
  std::map<std::string, std::vector<float>> params;  // full tensors by name
  std::vector<RankMemory> memory;                    // by world rank
};

// One OpenMP thread per rank (and for the reference): results do not depend on it, and the
// suite stays fast on a loaded machine (no OpenMP barriers spinning against other processes).
comm::RunOptions one_thread() {
  comm::RunOptions o;
  o.threads_per_rank = 1;
  return o;
}

RunResult reference(const Layout& l) {
  static std::map<std::tuple<int64_t, int64_t, int64_t, bool>, RunResult> cache;
  auto key = std::make_tuple(l.B, l.T, l.vocab, l.llama);
  if (auto it = cache.find(key); it != cache.end()) return it->second;
  omp_set_num_threads(1);
  MemoryPool pool("ref");
  model::GPT gpt(tiny(l.vocab, l.llama), pool);
  optim::AdamW opt(gpt.parameters(), adam(), pool);
  Tensor tok = Tensor::empty({l.B, l.T}, DType::i32, MemTag::workspace, pool);
  Tensor tgt = Tensor::empty({l.B, l.T}, DType::i32, MemTag::workspace, pool);
  RunResult r;
  for (int s = 0; s < kSteps; ++s) {
    batch(s, l.B, l.T, l.vocab, tok, tgt);
    gpt.zero_grad();
    r.losses.push_back(gpt.forward(tok, tgt, {.fuse_backward = true}));
    gpt.backward();
    r.norms.push_back(opt.step().grad_norm);
  }
  for (auto* p : gpt.parameters())
    r.params[p->spec.name] = std::vector<float>(p->value.f32(), p->value.f32() + p->spec.numel());
  cache[key] = r;
  return r;
}

RunResult parallel_run(const Layout& l) {
  const int world = l.dp * l.cp * l.tp;
  RunResult r;
  r.losses.assign(kSteps, 0.0);
  r.norms.assign(kSteps, 0.0);
  {
    model::GPT shapes(tiny(l.vocab, l.llama), default_cpu_pool());
    for (auto* p : shapes.parameters()) r.params[p->spec.name] = std::vector<float>(size_t(p->spec.numel()), NAN);
  }
  r.memory.assign(size_t(world), {});
  std::mutex mu;
  comm::run_ranks(world, [&](comm::Comm& c) {
    parallel::MeshComms mc(parallel::Mesh::standard(1, l.dp, l.cp, l.tp), c);
    MemoryPool pool("rank" + std::to_string(c.rank()));
    model::GPT m(tiny(l.vocab, l.llama), pool, 1337, {.groups = {&mc["tp"], &mc["cp"]}, .sp = l.sp});
    RankMemory& mem = r.memory[size_t(c.rank())];
    for (auto* p : m.parameters()) mem.alloc_sum += (p->spec.alloc_numel() + 15) / 16 * 16;
    // Reduced over dp x cp, as the trainer does (Megatron's distributed optimizer group): the cp
    // partial sums are added and the dp replicas averaged (each rank's loss scaled by 1 / dp);
    // whole over tp: counted in the norm on tp rank 0.
    MemoryPool host("host" + std::to_string(c.rank()));
    parallel::DataParallelOptions o;
    o.zero = l.zero;
    o.offload = l.offload;
    o.host_pool = &host;
    o.bucket_bytes = 64 << 10;  // several buckets
    o.norm_group = &mc["tp"];
    for (const model::Parameter* p : m.parameters()) o.in_norm.push_back(p->shard.split || mc.coord("tp") == 0);
    parallel::DataParallel ddp(m, mc.get({"dp", "cp"}), adam(), o);
    mem.n_pad = ddp.flat_elements();
    mem.shard = ddp.shard_elements();
    mem.bucket_peak = ddp.bucket_peak_elements();
    mem.max_use = ddp.max_block_use_elements();
    pool.reset_peaks();
    host.reset_peaks();
    const int64_t Bl = l.B / l.dp;
    const int dpr = mc.coord("dp");
    Tensor tok = Tensor::empty({l.B, l.T}, DType::i32, MemTag::workspace, pool);
    Tensor tgt = Tensor::empty({l.B, l.T}, DType::i32, MemTag::workspace, pool);
    for (int s = 0; s < kSteps; ++s) {
      batch(s, l.B, l.T, l.vocab, tok, tgt);
      ddp.zero_grad();
      float loss = m.forward(tok.slice0(dpr * Bl, Bl), tgt.slice0(dpr * Bl, Bl),
                             {.fuse_backward = true, .dloss_scale = 1.0f / float(l.dp)});
      m.backward();
      const double norm = ddp.step(-1.0).grad_norm;
      if (c.rank() == 0) r.norms[size_t(s)] = norm;
      comm::Comm& dp = mc["dp"];
      dp.all_reduce(&loss, 1, DType::f32);
      loss /= float(dp.size());
      if (c.rank() == 0) r.losses[size_t(s)] = loss;
    }
    mem.params = pool.peak(MemTag::params);
    mem.grads = pool.peak(MemTag::grads);
    mem.optimizer = pool.peak(MemTag::optimizer);
    mem.host_params = host.peak(MemTag::params);
    mem.host_grads = host.peak(MemTag::grads);
    mem.host_optimizer = host.peak(MemTag::optimizer);
    const parallel::DataParallel::FullState full = ddp.gather_full_state();  // collective over dp x cp
    if (mc.coord("dp") != 0 || mc.coord("cp") != 0) return;
    std::lock_guard lock(mu);
    const auto& ps = m.parameters();
    for (size_t i = 0; i < ps.size(); ++i) {
      const model::Parameter* p = ps[i];
      if (!p->shard.split && mc.coord("tp") != 0) continue;
      const Tensor v = ddp.param_view(full.params, i);
      auto& dst = r.params.at(p->spec.name);
      for (const auto& seg : p->segments()) std::copy_n(v.f32() + seg.local, seg.n, dst.begin() + seg.global);
    }
  }, one_thread());
  return r;
}

class ParallelEquivalence : public testing::TestWithParam<Layout> {};

TEST_P(ParallelEquivalence, LossesAndParametersMatchSingleDevice) {
  const Layout l = GetParam();
  const RunResult ref = reference(l), par = parallel_run(l);
  double worst_loss = 0;
  for (int s = 0; s < kSteps; ++s) {
    const double rel = std::abs(par.losses[size_t(s)] - ref.losses[size_t(s)]) / std::abs(ref.losses[size_t(s)]);
    worst_loss = std::max(worst_loss, rel);
    EXPECT_LE(rel, 1e-5) << "step " << s << ": " << par.losses[size_t(s)] << " vs " << ref.losses[size_t(s)];
    // The gradient norm counts every element once (replicas and tp-whole copies on one rank).
    EXPECT_LE(std::abs(par.norms[size_t(s)] - ref.norms[size_t(s)]) / ref.norms[size_t(s)], 1e-5)
        << "step " << s << ": gradient norm " << par.norms[size_t(s)] << " vs " << ref.norms[size_t(s)];
  }
  double d2 = 0, n2 = 0, worst_param = 0;
  std::string worst_name;
  for (const auto& [name, p_ref] : ref.params) {
    const auto& p = par.params.at(name);
    // The key bias adds q . b_k to every score of a query row, which softmax cancels: its
    // gradient is exactly zero and what the kernels compute is rounding noise that AdamW
    // normalises into full-size steps, different for any change of summation order. It counts
    // in the global norm below but is not compared on its own.
    const bool key_bias = name.ends_with("attn.c_attn.bias");
    const size_t C = p.size() / 3;
    double pd = 0, pn = 0;
    for (size_t i = 0; i < p.size(); ++i) {
      ASSERT_FALSE(std::isnan(p[i])) << name << "[" << i << "] was not written by any shard";
      const double d = double(p[i] - p_ref[i]) * double(p[i] - p_ref[i]), n = double(p_ref[i]) * double(p_ref[i]);
      d2 += d;
      n2 += n;
      if (key_bias && i >= C && i < 2 * C) continue;
      pd += d;
      pn += n;
    }
    const double rel = std::sqrt(pd / pn);
    if (rel > worst_param) worst_param = rel, worst_name = name;
    EXPECT_LE(rel, 1e-5) << name;
  }
  const double rel_all = std::sqrt(d2 / n2);
  EXPECT_LE(rel_all, 1e-5);
  // data_parallel.h over the d = dp cp ranks of the group, with N_pad = round_up(sum_i
  // round_up(alloc_i, 16), 16 d), S = N_pad / d, P_N = 4 N_pad, P_S = 4 S:
  //   stage 0: params P_N, grads P_N, optimizer 2 P_N      stage 1: P_N, P_N, 2 P_S
  //   stage 2: P_N, P_S + 4 G, 2 P_S                       stage 3: P_S + 4 U, P_S + 4 G, 2 P_S
  // and with offload the optimizer 2 P_opt, a master copy P_opt and a gradient copy P_opt in the
  // host pool instead (P_opt = P_N at stage 0, else P_S).
  const int64_t d = int64_t(l.dp) * l.cp;
  for (size_t w = 0; w < par.memory.size(); ++w) {
    const RankMemory& mem = par.memory[w];
    const int64_t n_pad = (mem.alloc_sum + 16 * d - 1) / (16 * d) * (16 * d), S = n_pad / d;
    const int64_t PN = 4 * n_pad, PS = 4 * S, Popt = l.zero == 0 ? PN : PS;
    EXPECT_EQ(mem.n_pad, n_pad) << "rank " << w;
    EXPECT_EQ(mem.shard, S) << "rank " << w;
    EXPECT_EQ(mem.params, l.zero == 3 ? PS + 8 * mem.max_use : PN) << "rank " << w;  // two gather buffers of U
    EXPECT_EQ(mem.grads, l.zero >= 2 ? PS + 4 * mem.bucket_peak : PN) << "rank " << w;
    EXPECT_EQ(mem.optimizer, l.offload ? 0 : 2 * Popt) << "rank " << w;
    EXPECT_EQ(mem.host_optimizer, l.offload ? 2 * Popt : 0) << "rank " << w;
    EXPECT_EQ(mem.host_params, l.offload ? Popt : 0) << "rank " << w;
    EXPECT_EQ(mem.host_grads, l.offload ? Popt : 0) << "rank " << w;
    if (w == 0)
      std::printf("  rank 0: params %lld, grads %lld, optimizer %lld (host %lld) bytes (N_pad %lld, S %lld)\n",
                  (long long)mem.params, (long long)mem.grads, (long long)mem.optimizer,
                  (long long)mem.host_optimizer, (long long)n_pad, (long long)S);
  }
  std::printf("  losses: max rel diff %.2e (final loss %.6f); params: ||p - p_ref|| / ||p_ref|| = %.2e, worst %s %.2e\n",
              worst_loss, ref.losses.back(), rel_all, worst_name.c_str(), worst_param);
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, ParallelEquivalence,
    testing::Values(Layout{1, 1, 1}, Layout{1, 1, 2}, Layout{1, 1, 4}, Layout{1, 1, 2, true}, Layout{1, 1, 4, true},
                    Layout{1, 2, 1}, Layout{1, 4, 1}, Layout{1, 2, 2, true}, Layout{2, 1, 2}, Layout{2, 1, 2, true},
                    Layout{2, 2, 1}, Layout{2, 2, 2, true}, Layout{2, 1, 4, true}, Layout{1, 2, 4, true},
                    Layout{2, 4, 1},
                    // Rows (B T / cp) that tp does not divide under sp; V = 130 over tp = 4:
                    // shards of 64 rows of the padded 256, the third holds 2 real rows, the
                    // fourth none.
                    Layout{1, 1, 4, true, 3, 62}, Layout{1, 2, 4, true, 3, 60, 130},
                    Layout{2, 2, 2, false, 2, 64, 130},
                    // ZeRO-1 over dp: tp, tp + sp, cp, and all three with V = 130.
                    Layout{.dp = 2, .tp = 2, .zero = 1}, Layout{.dp = 2, .tp = 2, .sp = true, .zero = 1},
                    Layout{.dp = 2, .cp = 2, .zero = 1},
                    Layout{.dp = 2, .cp = 2, .tp = 2, .sp = true, .vocab = 130, .zero = 1},
                    // ZeRO-2 and -3 and offload with tp, sp and cp.
                    Layout{.dp = 2, .tp = 2, .zero = 2}, Layout{.dp = 2, .tp = 2, .sp = true, .zero = 3},
                    Layout{.dp = 2, .cp = 2, .zero = 3}, Layout{.dp = 1, .cp = 2, .tp = 2, .zero = 2},
                    Layout{.dp = 2, .cp = 2, .tp = 2, .sp = true, .vocab = 130, .zero = 3},
                    Layout{.dp = 2, .tp = 2, .zero = 0, .offload = true},
                    Layout{.dp = 2, .tp = 2, .sp = true, .zero = 3, .offload = true},
                    Layout{.dp = 2, .cp = 2, .zero = 2, .offload = true},
                    // The Llama family (grouped-query attention: tp splits the 2 key/value heads).
                    Layout{.llama = true}, Layout{.tp = 2, .llama = true},
                    Layout{.tp = 2, .sp = true, .llama = true}, Layout{.cp = 2, .llama = true},
                    Layout{.dp = 2, .cp = 2, .tp = 2, .sp = true, .vocab = 130, .zero = 1, .llama = true},
                    Layout{.dp = 2, .tp = 2, .zero = 3, .llama = true},
                    Layout{.dp = 2, .cp = 2, .zero = 2, .offload = true, .llama = true},
                    // tp = 4 over 2 key/value heads: each is replicated on 2 ranks.
                    Layout{.tp = 4, .llama = true}, Layout{.tp = 4, .sp = true, .llama = true},
                    Layout{.cp = 2, .tp = 4, .sp = true, .llama = true},
                    Layout{.dp = 2, .tp = 4, .zero = 1, .llama = true},
                    Layout{.dp = 2, .tp = 4, .sp = true, .zero = 3, .llama = true},
                    Layout{.dp = 2, .tp = 4, .zero = 2, .offload = true, .llama = true}),
    layout_name);

TEST(TensorParallelGPT, RefusesHeadsNotDivisibleByTp) {
  EXPECT_THROW(
      {
        comm::run_ranks(3, [](comm::Comm& c) {
          MemoryPool pool;
          model::GPT m(tiny(503), pool, 1337, {.groups = {&c, nullptr}});  // 4 heads over tp = 3
        });
      },
      Error);
  try {
    comm::run_ranks(3, [](comm::Comm& c) {
      MemoryPool pool;
      model::GPT m(tiny(503), pool, 1337, {.groups = {&c, nullptr}});
    });
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("n_head = 4 is not divisible by tp = 3"), std::string::npos) << e.what();
  }
}

// Key/value heads that tp neither divides nor is a multiple of (6 query heads on 2 over tp = 3) are refused naming both; 8 query heads on 2 over tp = 4
// replicate each key/value head on two ranks.
TEST(TensorParallelGPT, RefusesKeyValueHeadsTpCannotSplitOrReplicate) {
  model::GPTConfig c = tiny(503, true);
  c.n_head = 6;
  c.n_embd = 96;
  c.n_kv_head = 2;
  c.ffn_hidden = 192;
  std::string msg;
  try {
    comm::run_ranks(3, [&](comm::Comm& comm) {
      MemoryPool pool;
      model::GPT m(c, pool, 1337, {.groups = {&comm, nullptr}});
    });
  } catch (const Error& e) {
    msg = e.what();
  }
  EXPECT_NE(msg.find("n_kv_head = 2 and tp = 3"), std::string::npos) << msg;
  c.n_head = 8;
  c.n_embd = 64;
  comm::run_ranks(4, [&](comm::Comm& comm) {
    MemoryPool pool;
    model::GPT m(c, pool, 1337, {.groups = {&comm, nullptr}});
    const model::Parameter& qkv = m.parameter("h.0.attn.c_attn.weight");
    ASSERT_EQ(qkv.shard.segments.size(), 3u);  // 2 query heads, 1 key head, 1 value head
    EXPECT_TRUE(qkv.shard.segments[1].shared);
    EXPECT_EQ(qkv.shard.segments[1].replica, comm.rank() % 2 == 1);
    EXPECT_EQ(qkv.shard.segments[1].global, (64 + (comm.rank() / 2) * 8) * 64);
    EXPECT_EQ(qkv.shard.shared_group->size(), 2);
  });
}

TEST(TensorParallelGPT, RefusesSequenceNotSplittableOverCp) {
  try {
    comm::run_ranks(2, [](comm::Comm& c) {
      MemoryPool pool;
      model::GPT m(tiny(503), pool, 1337, {.groups = {nullptr, &c}});
      Tensor tok = Tensor::zeros({1, 30}, DType::i32, MemTag::workspace, pool);  // 30 % 4 != 0
      m.forward(tok, tok);
    });
    ADD_FAILURE() << "expected loom::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("sequence length 30 must be a positive multiple of 2 * cp = 4"),
              std::string::npos)
        << e.what();
  }
}

TEST(TensorParallelGPT, ShardsCoverEveryParameterOnceAndPadTheVocabulary) {
  comm::run_ranks(4, [](comm::Comm& c) {
    MemoryPool pool;
    model::GPT m(tiny(503), pool, 1337, {.groups = {&c, nullptr}});
    EXPECT_EQ(m.parallel().vocab_rows(m.config()), 128);  // padded vocabulary 512 over 4
    auto& wte = m.parameter("wte.weight");
    const int64_t real = std::min<int64_t>(128, 503 - 128 * c.rank());
    ASSERT_EQ(wte.segments().size(), 1u);
    EXPECT_EQ(wte.segments()[0].n, real * 64);
    // Padding rows are zero.
    for (int64_t i = real * 64; i < 128 * 64; ++i) ASSERT_EQ(wte.value.f32()[i], 0.0f);
    auto& qkv = m.parameter("h.0.attn.c_attn.weight");
    EXPECT_EQ(qkv.spec.shape, (Shape{48, 64}));  // one head of q, k and v
    EXPECT_EQ(qkv.global().shape, (Shape{192, 64}));
    EXPECT_EQ(qkv.segments().size(), 3u);
    EXPECT_EQ(qkv.segments()[1].global, (64 + 16 * c.rank()) * 64);
  });
}

}  // namespace
