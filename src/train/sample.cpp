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

std::vector<int32_t> sample_recompute(model::GPT& gpt, const std::vector<int32_t>& prompt, const SampleOptions& opt) {
  LOOM_CHECK(!prompt.empty(), "sampling needs a prompt of at least one token");
  const auto& cfg = gpt.config();
  std::vector<int32_t> ctx = prompt, out;
  std::vector<float> full;  // the gathered row under tensor parallelism
  for (int64_t n = 0; n < opt.max_new_tokens; ++n) {
    int64_t T = std::min<int64_t>(int64_t(ctx.size()), cfg.block_size);
    Tensor tokens = Tensor::empty({1, T}, DType::i32, MemTag::workspace, gpt.pool());
    std::copy(ctx.end() - T, ctx.end(), tokens.i32());
    gpt.forward(tokens, Tensor());
    // Under tensor parallelism each rank holds its vocabulary columns of the logits: the last row's
    // parts, gathered over tp in rank order, are the whole padded row (every rank then draws the
    // same token).
    const model::ChainParallel& P = gpt.parallel();
    const int64_t Vr = P.vocab_rows(cfg);
    const float* row = gpt.logits().f32() + (T - 1) * Vr;
    if (comm::Comm* tp = P.tp_group()) {
      full.resize(size_t(Vr) * size_t(tp->size()));
      tp->all_gather(row, full.data(), int64_t(full.size()), DType::f32);
      row = full.data();
    }
    int32_t next = sample_logits(row, cfg.vocab_size, opt, uint64_t(ctx.size()));
    ctx.push_back(next);
    out.push_back(next);
    if (next == opt.stop_token) break;
  }
  gpt.release_activations();
  return out;
}

}  // namespace loom::train
