// What the step runner does on CUDA only (host code only: compiled by the C++ compiler; skipped
// without a GPU): graph replays against op-by-op launches, a new capture when the counted targets
// change, the step's breakdown by op (kernels/cuda/profile.cuh as the backend's observer, op by op
// and inside the graph), and the
// memory of the model, the runner and the backend instance, tagged and given back.
// The same model run as CUDA graphs and op by op launches the same kernels in the same order (GEMM
// tuning off in both instances, so both run cuBLASLt's first choice); only the f32 atomics of the
// token-embedding gradient may add in another order (last bits of a few gradients), so step losses
// agree within kGraphLossTol = 1e-3 absolute, and the parameters within 1e-4 relative: tensor by
// tensor after five AdamW steps, all together after a dozen (AdamW turns the rounding noise of a
// gradient that is zero but for rounding, the key bias's, into updates of up to lr, which a dozen
// steps add up in that one tensor).
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "kernels/cuda/allocator.cuh"
#include "kernels/cuda/backend.cuh"
#include "kernels/cuda/profile.cuh"
#include "model/gpt.h"
#include "train/step_runner.h"

using namespace loom;

namespace {

constexpr double kGraphLossTol = 1e-3;

#define REQUIRE_CUDA_BACKEND()                                                                  \
  do {                                                                                          \
    std::string why_;                                                                           \
    if (!backend_available(Device::cuda, &why_)) GTEST_SKIP() << "cuda backend: " << why_;      \
  } while (0)

std::vector<int32_t> random_ids(int64_t n, int64_t V, uint32_t seed) {
  std::mt19937 g(seed);
  std::vector<int32_t> v(static_cast<size_t>(n));
  for (auto& x : v) x = int32_t(g() % uint32_t(V));
  return v;
}

// ||a - ref|| / ||ref|| over every parameter of two models at once.
double params_err(train::StepRunner& a, train::StepRunner& ref) {
  double num = 0, den = 0;
  for (const model::Parameter* p : a.model().parameters()) {
    const std::vector<float> x = a.parameter(p->spec.name), r = ref.parameter(p->spec.name);
    for (size_t i = 0; i < r.size(); ++i) {
      if (!std::isfinite(x[i])) return INFINITY;
      num += (double(x[i]) - r[i]) * (double(x[i]) - r[i]);
      den += double(r[i]) * r[i];
    }
  }
  return std::sqrt(num / den);
}

// gpt2-tiny (head size 16: the GEMM attention) on B x T, built twice from one seed, each on a
// backend instance of its own: g replays CUDA graphs, e launches op by op.
struct GraphAndEager {
  model::GPTConfig cfg = model::gpt_preset("gpt2-tiny");
  int64_t B, T;
  double lr = 3e-3;
  std::unique_ptr<cuda::CudaBackend> bg, beg;
  std::unique_ptr<model::GPT> mg, me;
  std::unique_ptr<train::StepRunner> g, e;
  GraphAndEager(int64_t B_, int64_t T_, uint64_t seed) : B(B_), T(T_) {
    BackendOptions o;
    o.gemm_tune = 0;
    bg = std::make_unique<cuda::CudaBackend>(o);
    beg = std::make_unique<cuda::CudaBackend>(o);
    mg = std::make_unique<model::GPT>(cfg, *bg, seed);
    me = std::make_unique<model::GPT>(cfg, *beg, seed);
    g = std::make_unique<train::StepRunner>(*mg, train::StepOptions{.B = B, .T = T, .graphs = true});
    e = std::make_unique<train::StepRunner>(*me, train::StepOptions{.B = B, .T = T, .graphs = false});
  }
};

// Two profiled steps of m's graphed runner: every kind of op of the forward, backward and update
// shows with a positive time, and the reported FLOPs add up to the model's GEMM and attention
// FLOPs exactly (per step: GEMMs 2 FLOPs per multiply-add forward, twice that backward; attention
// 2 B T^2 C forward (causal) and 2.5 times that backward, per layer).
void expect_parts_cover_the_step(const cuda::StepProfile& prof, const GraphAndEager& m) {
  std::set<std::string> names;
  double flops = 0;
  for (const auto& p : prof.parts()) {
    names.insert(p.name);
    EXPECT_GT(p.ms, 0.0) << p.name;
    flops += p.flops;
  }
  for (const char* want : {"(before the step)", "fill zero", "embedding forward", "layernorm forward",
                           "linear forward", "attention forward", "residual + layernorm forward",
                           "linear forward + gelu", "cross-entropy + dlogits", "sum", "linear backward",
                           "layernorm backward", "linear backward + dgelu", "attention backward", "embedding backward",
                           "adamw"})
    EXPECT_EQ(names.count(want), 1u) << want;
  EXPECT_EQ(names.size(), 16u) << "(the block's last residual add is the MLP projection's GEMM epilogue)";
  const double B = double(m.B), T = double(m.T), C = double(m.cfg.n_embd), L = double(m.cfg.n_layer);
  const double want = 6.0 * B * T * (L * 12.0 * C * C + C * double(m.cfg.padded_vocab())) + L * 7.0 * B * T * T * C;
  EXPECT_NEAR(flops / double(prof.steps()), want, 1e-9 * want);
}

}  // namespace

TEST(StepRunnerGraph, ReplayMatchesEagerAndTrains) {
  REQUIRE_CUDA_BACKEND();
  GraphAndEager m(4, 64, 11);
  auto tok = random_ids(m.B * m.T, m.cfg.vocab_size, 3), tgt = random_ids(m.B * m.T, m.cfg.vocab_size, 4);
  std::vector<float> lg, le;
  for (int s = 1; s <= 12; ++s) {
    lg.push_back(m.g->train_step(tok.data(), tgt.data(), m.lr, s));
    le.push_back(m.e->train_step(tok.data(), tgt.data(), m.lr, s));
    EXPECT_NEAR(lg.back(), le.back(), kGraphLossTol) << "step " << s;
    EXPECT_TRUE(std::isfinite(m.g->last_grad_norm()));
  }
  EXPECT_EQ(m.g->graph_launches(), 11);
  EXPECT_EQ(m.e->graph_launches(), 0);
  EXPECT_LT(lg.back(), lg.front() - 0.2f) << "12 AdamW steps on one batch must lower its loss";
  EXPECT_LE(params_err(*m.g, *m.e), 1e-4);
}

// The loss's 1 / (counted targets) is a value the captured step bakes in: a batch with ignored
// targets (-1) changes it, so the graph is captured again, and a batch with every target counted
// changes it back. Graph and eager training agree over A, B (a quarter of the targets ignored), A, B.
TEST(StepRunnerGraph, RecapturesWhenTheCountedTargetsChange) {
  REQUIRE_CUDA_BACKEND();
  GraphAndEager m(2, 64, 13);
  const int64_t V = m.cfg.vocab_size, n = m.B * m.T;
  auto tok_a = random_ids(n, V, 21), tgt_a = random_ids(n, V, 22), tok_b = random_ids(n, V, 23), tgt_b = random_ids(n, V, 24);
  for (size_t i = 0; i < tgt_b.size(); i += 4) tgt_b[i] = -1;
  const std::vector<int32_t>* toks[] = {&tok_a, &tok_b, &tok_a, &tok_b, &tok_b};
  const std::vector<int32_t>* tgts[] = {&tgt_a, &tgt_b, &tgt_a, &tgt_b, &tgt_b};
  for (int s = 1; s <= 5; ++s) {
    const float lg = m.g->train_step(toks[s - 1]->data(), tgts[s - 1]->data(), m.lr, s);
    const float le = m.e->train_step(toks[s - 1]->data(), tgts[s - 1]->data(), m.lr, s);
    EXPECT_NEAR(lg, le, kGraphLossTol) << "step " << s;
  }
  EXPECT_EQ(m.g->graph_launches(), 4);
  // After five steps tensor by tensor, as the per-device model's test was (the noise AdamW makes of
  // the key bias's gradient stays small over so few steps).
  for (const model::Parameter* p : m.mg->parameters()) {
    const std::vector<float> a = m.g->parameter(p->spec.name), b = m.e->parameter(p->spec.name);
    double num = 0, den = 0;
    for (size_t i = 0; i < b.size(); ++i) num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]), den += double(b[i]) * b[i];
    EXPECT_LE(std::sqrt(num / den), 1e-4) << p->spec.name;
  }
}

// The step's breakdown by op (the backend reports every op to a cuda::StepProfile): every kind of
// op of the forward, backward and update shows with a positive time, the reported FLOPs add up to
// the model's GEMM and attention FLOPs exactly, profiling runs the same math as op-by-op
// launches, and the runner goes back to graphs afterwards.
TEST(StepRunnerGraph, ProfileCoversTheStep) {
  REQUIRE_CUDA_BACKEND();
  GraphAndEager m(2, 64, 17);
  const model::GPTConfig& cfg = m.cfg;
  auto tok = random_ids(m.B * m.T, cfg.vocab_size, 31), tgt = random_ids(m.B * m.T, cfg.vocab_size, 32);
  cuda::StepProfile prof(m.bg->stream());
  m.bg->set_observer(&prof);
  for (int s = 1; s <= 2; ++s) {
    prof.start();
    const float lg = m.g->train_step(tok.data(), tgt.data(), m.lr, s);
    prof.finish();
    EXPECT_NEAR(lg, m.e->train_step(tok.data(), tgt.data(), m.lr, s), kGraphLossTol) << "step " << s;
  }
  m.bg->set_observer(nullptr);
  EXPECT_EQ(m.g->graph_launches(), 0) << "profiled steps run op by op";
  EXPECT_EQ(prof.steps(), 2);
  expect_parts_cover_the_step(prof, m);
  // Graphed again (the first graphed call captures), still the eager twin's step.
  for (int s = 3; s <= 4; ++s)
    EXPECT_NEAR(m.g->train_step(tok.data(), tgt.data(), m.lr, s), m.e->train_step(tok.data(), tgt.data(), m.lr, s),
                kGraphLossTol);
  EXPECT_EQ(m.g->graph_launches(), 2) << "the steps after profiling are graph replays";
}

// The breakdown inside the graph (StepProfile in_graph: the marks captured as event nodes): the
// first profiled step captures the graph again and is not counted, the replays after it are, with
// every kind of op and the same FLOPs as op by op; the steps stay the eager twin's; afterwards the
// graph is captured once more without the event nodes.
TEST(StepRunnerGraph, ProfileInTheGraph) {
  REQUIRE_CUDA_BACKEND();
  GraphAndEager m(2, 64, 17);
  auto tok = random_ids(m.B * m.T, m.cfg.vocab_size, 31), tgt = random_ids(m.B * m.T, m.cfg.vocab_size, 32);
  int s = 1;
  for (; s <= 2; ++s)  // warmed and graphed
    EXPECT_NEAR(m.g->train_step(tok.data(), tgt.data(), m.lr, s), m.e->train_step(tok.data(), tgt.data(), m.lr, s),
                kGraphLossTol);
  const int64_t launches = m.g->graph_launches();
  EXPECT_EQ(launches, 1);
  cuda::StepProfile prof(m.bg->stream(), /*in_graph=*/true);
  m.bg->set_observer(&prof);
  for (; s <= 5; ++s) {
    prof.start();
    const float lg = m.g->train_step(tok.data(), tgt.data(), m.lr, s);
    prof.finish();
    EXPECT_NEAR(lg, m.e->train_step(tok.data(), tgt.data(), m.lr, s), kGraphLossTol) << "step " << s;
  }
  m.bg->set_observer(nullptr);
  EXPECT_EQ(m.g->graph_launches(), launches + 3) << "profiled in the graph: the steps are replays";
  EXPECT_EQ(prof.steps(), 2) << "the step that captured is not counted";
  expect_parts_cover_the_step(prof, m);
  EXPECT_NEAR(m.g->train_step(tok.data(), tgt.data(), m.lr, s), m.e->train_step(tok.data(), tgt.data(), m.lr, s),
              kGraphLossTol);
  EXPECT_EQ(m.g->graph_launches(), launches + 4);
  ++s;
  // Gradient accumulation: the micro-batch's graph replays, and the optimizer step runs outside it:
  // such steps are not counted (their marks mix the graph's events with ops run op by op).
  cuda::StepProfile acc(m.bg->stream(), /*in_graph=*/true);
  m.bg->set_observer(&acc);
  for (int i = 0; i < 3; ++i, ++s) {
    acc.start();
    m.g->zero_grad();
    m.g->accumulate(tok.data(), tgt.data());
    m.g->optimizer_step(m.lr, s);
    acc.finish();
  }
  EXPECT_EQ(acc.steps(), 0);
  // A capture while no step is open would make a graph without events: refused.
  EXPECT_THROW(m.g->train_step(tok.data(), tgt.data(), m.lr, s), Error);
  m.bg->set_observer(nullptr);
}

// Everything the model, its runner and its backend instance take from the device pool is tagged
// (master weights and compute copies under params, gradients, moments, activations, the BLAS
// handles' workspaces) and given back when they go.
TEST(StepRunnerGraph, MemoryIsTaggedAndReturned) {
  REQUIRE_CUDA_BACKEND();
  MemoryPool& pool = cuda::device_pool();
  const MemStats before = pool.stats();
  model::GPTConfig cfg = model::gpt_preset("gpt2-tiny");
  {
    cuda::CudaBackend be({.pool = &pool, .attention = AttnKernel::gemm});
    model::GPT gpt(cfg, be, 1);
    train::StepRunner run(gpt, {.B = 2, .T = 32});
    auto tok = random_ids(64, cfg.vocab_size, 1), tgt = random_ids(64, cfg.vocab_size, 2);
    run.train_step(tok.data(), tgt.data(), 1e-3, 1);
    const int64_t n = gpt.num_parameters();
    auto grew = [&](MemTag t) { return pool.current(t) - before.current[int(t)]; };
    EXPECT_GE(grew(MemTag::params), n * 6);  // f32 master + bf16 compute copy
    EXPECT_GE(grew(MemTag::grads), n * 4);
    EXPECT_GE(grew(MemTag::optimizer), n * 8);
    EXPECT_GE(grew(MemTag::activations), gpt.saved_activation_bytes(2, 32));
    EXPECT_GE(grew(MemTag::workspace), int64_t(64) << 20);  // cuBLASLt's and (GEMM attention) cuBLAS's
  }
  for (int t = 0; t < kNumMemTags; ++t) EXPECT_EQ(pool.current(MemTag(t)), before.current[t]) << mem_tag_name(MemTag(t));
}
