#include "train/sample.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/error.h"
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

std::vector<int32_t> sample_recompute(model::GPT& gpt, const std::vector<int32_t>& prompt, const SampleOptions& opt) {
  const auto& cfg = gpt.config();
  auto logits = [&](const std::vector<int32_t>& ctx) {
    const int64_t T = int64_t(ctx.size());
    Tensor tokens = Tensor::empty({1, T}, DType::i32, MemTag::workspace, gpt.pool());
    std::copy(ctx.begin(), ctx.end(), tokens.i32());
    gpt.forward(tokens, Tensor());
    // Under tensor parallelism each rank holds its vocabulary columns of the logits: the last
    // row's parts, gathered over tp in rank order, are the whole padded row (every rank then
    // draws the same token).
    const model::ChainParallel& P = gpt.parallel();
    const int64_t Vr = P.vocab_rows(cfg);
    const float* row = gpt.logits().f32() + (T - 1) * Vr;
    std::vector<float> full(size_t(Vr) * size_t(P.tp()));
    if (comm::Comm* tp = P.tp_group()) tp->all_gather(row, full.data(), int64_t(full.size()), DType::f32);
    else std::copy(row, row + Vr, full.begin());
    return full;
  };
  std::vector<int32_t> out = sample_with(logits, cfg.block_size, cfg.vocab_size, prompt, opt);
  gpt.release_activations();
  return out;
}

}  // namespace loom::train
