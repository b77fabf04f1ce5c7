#include "train/sample.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/error.h"
#include "parallel/context/ring_attention.h"
#include "core/rng.h"

namespace loom::train {

int32_t sample_logits(const float* logits, int64_t V, const SampleOptions& opt, uint64_t index) {
  LOOM_CHECK(opt.temperature > 0, "sampling temperature must be positive, got {}", opt.temperature);
  std::vector<int32_t> ids(static_cast<size_t>(V));
  std::iota(ids.begin(), ids.end(), 0);
  int64_t k = (opt.top_k > 0 && opt.top_k < V) ? opt.top_k : V;
  if (k < V)
    std::partial_sort(ids.begin(), ids.begin() + k, ids.end(),
                      [&](int32_t a, int32_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); });
  double mx = -INFINITY;
  for (int64_t i = 0; i < k; ++i) mx = std::max(mx, double(logits[ids[size_t(i)]]));
  std::vector<double> p(static_cast<size_t>(k));
  double sum = 0;
  for (int64_t i = 0; i < k; ++i) sum += p[size_t(i)] = std::exp((logits[ids[size_t(i)]] - mx) / opt.temperature);
  double u = double(uniform_at(opt.seed, stream_of("sample"), index)) * sum, acc = 0;
  for (int64_t i = 0; i < k; ++i) {
    acc += p[size_t(i)];
    if (u < acc) return ids[size_t(i)];
  }
  return ids[size_t(k - 1)];
}

std::vector<int32_t> sample_with(const LastLogits& logits, int64_t block_size, int64_t vocab,
                                 const std::vector<int32_t>& prompt, const SampleOptions& opt) {
  LOOM_CHECK(!prompt.empty(), "sampling needs a prompt of at least one token");
  std::vector<int32_t> ctx = prompt, out;
  for (int64_t n = 0; n < opt.max_new_tokens; ++n) {
    const int64_t T = std::min<int64_t>(int64_t(ctx.size()), block_size);
    const std::vector<float> row = logits(std::vector<int32_t>(ctx.end() - T, ctx.end()));
    LOOM_CHECK(int64_t(row.size()) >= vocab, "sampling: a logits row of {} for a vocabulary of {}", row.size(), vocab);
    const int32_t next = sample_logits(row.data(), vocab, opt, uint64_t(ctx.size()));
    ctx.push_back(next);
    out.push_back(next);
    if (next == opt.stop_token) break;
  }
  return out;
}

std::vector<float> last_position_logits(const model::ChainParallel& P, const model::GPTConfig& cfg,
                                        const std::vector<int32_t>& context,
                                        const std::function<const float*(const Tensor& tokens)>& forward) {
  // Context and sequence parallelism split the positions: the context is padded on the right to a
  // length they divide. A causal model's logits at a position do not depend on later tokens, so
  // the padding changes nothing the sample reads.
  const int cp = P.cp();
  const int64_t unit = std::lcm<int64_t>(cp > 1 ? 2 * cp : 1, P.sp_active() ? P.tp() : 1);
  int64_t T = int64_t(context.size());
  const int64_t room = cfg.block_size / unit * unit;  // the longest split length the model takes
  const int64_t skip = T > room ? T - room : 0;       // (only where block_size itself is not split)
  T -= skip;
  const int64_t Tp = (T + unit - 1) / unit * unit;
  Tensor tokens = Tensor::zeros({1, Tp}, DType::i32, MemTag::workspace, default_cpu_pool());
  std::copy(context.begin() + skip, context.end(), tokens.i32());
  const float* logits = forward(tokens);
  const int64_t Vr = P.vocab_rows(cfg);
  // The row of position T - 1: on the cp rank that holds it, at its local index.
  std::vector<float> mine(static_cast<size_t>(Vr));
  int owner = 0;
  int64_t local = T - 1;
  if (cp > 1) {
    const int64_t Tl = Tp / cp;
    for (int r = 0; r < cp; ++r)
      for (int64_t t = 0; t < Tl; ++t)
        if (parallel::cp::global_position(t, Tp, cp, r) == T - 1) owner = r, local = t;
  }
  if (P.cp_rank() == owner) std::copy(logits + local * Vr, logits + (local + 1) * Vr, mine.begin());
  if (comm::Comm* g = P.cp_group()) g->broadcast(mine.data(), Vr, DType::f32, owner);
  // Each tp rank holds its vocabulary columns: gathered in rank order, the whole padded row.
  std::vector<float> full(size_t(Vr) * size_t(P.tp()));
  if (comm::Comm* tp = P.tp_group()) tp->all_gather(mine.data(), full.data(), int64_t(full.size()), DType::f32);
  else full = std::move(mine);
  return full;
}

std::vector<int32_t> sample_recompute(model::GPT& gpt, const std::vector<int32_t>& prompt, const SampleOptions& opt) {
  const auto& cfg = gpt.config();
  auto logits = [&](const std::vector<int32_t>& ctx) {
    return last_position_logits(gpt.parallel(), cfg, ctx, [&](const Tensor& tokens) {
      gpt.forward(tokens, Tensor());
      return gpt.logits().f32();
    });
  };
  std::vector<int32_t> out = sample_with(logits, cfg.block_size, cfg.vocab_size, prompt, opt);
  gpt.release_activations();
  return out;
}

}  // namespace loom::train
