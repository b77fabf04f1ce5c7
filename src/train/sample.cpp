#include "train/sample.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/error.h"
#include "core/rng.h"

namespace loom::train {

int32_t sample_logits(const float* logits, int64_t V, const SampleOptions& opt, uint64_t index) {
  LOOM_CHECK(opt.temperature > 0, "sampling temperature must be positive, got {}", opt.temperature);
  if (opt.vocab_limit > 0) V = std::min(V, opt.vocab_limit);
  std::vector<int32_t> ids;
  if (opt.allowed) {
    for (int32_t id : *opt.allowed)
      if (id < V) ids.push_back(id);
    LOOM_CHECK(!ids.empty(), "sampling: none of the allowed tokens is in the vocabulary of {}", V);
  } else {
    ids.resize(static_cast<size_t>(V));
    std::iota(ids.begin(), ids.end(), 0);
  }
  const int64_t n = int64_t(ids.size());
  int64_t k = (opt.top_k > 0 && opt.top_k < n) ? opt.top_k : n;
  if (k < n) {
    const auto before = [&](int32_t a, int32_t b) {
      return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
    };
    std::partial_sort(ids.begin(), ids.begin() + k, ids.end(), before);
    // Every token tied with the k-th is kept, as nanoGPT's and transformers' top-k keep them (k =
    // 1 stays the argmax, the lowest id among ties: greedy decoding).
    if (k > 1) {
      const float kth = logits[ids[size_t(k - 1)]];
      auto tied = std::partition(ids.begin() + k, ids.end(), [&](int32_t id) { return logits[id] == kth; });
      std::sort(ids.begin() + k, tied);
      k = int64_t(tied - ids.begin());
    }
  }
  double mx = -INFINITY;
  for (int64_t i = 0; i < k; ++i) mx = std::max(mx, double(logits[ids[size_t(i)]]));
  std::vector<double> p(static_cast<size_t>(k));
  double sum = 0;
  for (int64_t i = 0; i < k; ++i) sum += p[size_t(i)] = std::exp((logits[ids[size_t(i)]] - mx) / opt.temperature);
  double u = uniform_double_at(opt.seed, stream_of("sample"), index) * sum, acc = 0;
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

Tensor padded_context(const std::vector<int32_t>& context, int64_t block_size, int64_t unit, int64_t* position) {
  int64_t T = int64_t(context.size());
  const int64_t room = block_size / unit * unit;   // the longest split length the model takes
  const int64_t skip = T > room ? T - room : 0;    // (only where block_size itself is not split)
  T -= skip;
  Tensor tokens = Tensor::zeros({1, (T + unit - 1) / unit * unit}, DType::i32, MemTag::workspace);
  std::copy(context.begin() + skip, context.end(), tokens.i32());
  *position = T - 1;
  return tokens;
}

std::vector<int32_t> sample_recompute(model::GPT& gpt, const std::vector<int32_t>& prompt, const SampleOptions& opt) {
  const auto& cfg = gpt.config();
  const model::ChainParallel& P = gpt.parallel();
  auto logits = [&](const std::vector<int32_t>& ctx) {
    int64_t position = 0;
    const Tensor tokens = padded_context(ctx, cfg.block_size, P.sequence_unit(), &position);
    gpt.forward(tokens, Tensor());
    return P.logits_row(gpt.logits().f32(), tokens.size(1), position, cfg);
  };
  std::vector<int32_t> out = sample_with(logits, cfg.block_size, cfg.vocab_size, prompt, opt);
  gpt.release_activations();
  return out;
}

}  // namespace loom::train
