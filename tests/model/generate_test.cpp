// KV-cache decoding: the logits of prefill + one-token steps equal the full forward's at every
// position, and cached sampling draws exactly the tokens of train::sample_recompute.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <random>

#include "core/error.h"
#include "kernels/cpu/attention.h"
#include "model/gpt.h"
#include "model/kv_cache.h"
#include "train/sample.h"

using namespace loom;
using loom::model::CachedDecoder;
using loom::model::GPT;
using loom::model::GPTConfig;

namespace {

GPTConfig small_config(bool tied = true) {
  GPTConfig c = model::gpt_preset("gpt2-tiny");  // L=2, H=4, C=64, V=503, T=64
  c.tied_embeddings = tied;
  return c;
}

// Random values for every parameter (biases and LayerNorm too), so that each one shapes the logits.
void randomise(GPT& gpt, uint32_t seed) {
  std::mt19937 g(seed);
  std::normal_distribution<float> n(0.0f, 1.0f);
  for (auto* p : gpt.parameters()) {
    const bool ln_w = p->spec.init == model::Init::ones;
    const float std = p->spec.init == model::Init::normal ? 0.08f : 0.05f;
    float* v = p->value.f32();
    for (int64_t i = 0; i < p->spec.numel(); ++i) v[i] = (ln_w ? 1.0f : 0.0f) + std * n(g);
  }
}

std::vector<int32_t> random_tokens(int64_t n, int64_t V, uint32_t seed) {
  std::mt19937 g(seed);
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (auto& x : t) x = int32_t(g() % uint32_t(V));
  return t;
}

// ||a - b|| / ||b|| over the real vocabulary of one row.
double row_error(const float* a, const float* b, int64_t V) {
  double num = 0, den = 0;
  for (int64_t v = 0; v < V; ++v) {
    num += (double(a[v]) - b[v]) * (double(a[v]) - b[v]);
    den += double(b[v]) * b[v];
  }
  return std::sqrt(num / den);
}

}  // namespace

class CachedLogits : public ::testing::TestWithParam<bool> {};

TEST_P(CachedLogits, EqualFullForwardAtEveryPosition) {
  const GPTConfig c = small_config(GetParam());
  MemoryPool pool("cpu:0");
  GPT gpt(c, pool, 1);
  randomise(gpt, 11);
  const int64_t B = 3, T = c.block_size, Vp = c.padded_vocab();
  const std::vector<int32_t> toks = random_tokens(B * T, c.vocab_size, 5);  // i32 [B, T]
  Tensor tokens = Tensor::empty({B, T}, DType::i32, MemTag::workspace, pool);
  std::copy(toks.begin(), toks.end(), tokens.i32());
  gpt.forward(tokens, Tensor());
  const float* full = gpt.logits().f32();  // f32 [B, T, Vp]

  // Prefill 9 positions in one pass, then one token per step; and a run of uneven chunks.
  for (const std::vector<int64_t>& chunks : {std::vector<int64_t>{9}, std::vector<int64_t>{1, 4, 13, 2, 7}}) {
    CachedDecoder dec(gpt, B, T);
    int64_t pos = 0;
    double worst = 0;
    size_t ci = 0;
    while (pos < T) {
      const int64_t n = ci < chunks.size() ? std::min(chunks[ci++], T - pos) : 1;
      std::vector<int32_t> step(size_t(B * n));  // i32 [B, n]
      for (int64_t b = 0; b < B; ++b)
        for (int64_t t = 0; t < n; ++t) step[size_t(b * n + t)] = toks[size_t(b * T + pos + t)];
      const float* got = dec.forward(step.data(), n, /*all_logits=*/true).f32();  // f32 [B, n, Vp]
      for (int64_t b = 0; b < B; ++b)
        for (int64_t t = 0; t < n; ++t)
          worst = std::max(worst, row_error(got + (b * n + t) * Vp, full + (b * T + pos + t) * Vp, c.vocab_size));
      // The last-position logits are the same rows.
      pos += n;
      EXPECT_EQ(dec.length(), pos);
    }
    std::printf("chunks of %zu: worst per-position relative logit error %.3e\n", chunks.size(), worst);
    EXPECT_LE(worst, 1e-5);
    EXPECT_THROW(dec.forward(toks.data(), 1), Error);  // the cache is full
  }

  // Without all_logits, the rows are those of the last position of each sequence.
  CachedDecoder dec(gpt, B, T);
  std::vector<int32_t> prefix(size_t(B * 20));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < 20; ++t) prefix[size_t(b * 20 + t)] = toks[size_t(b * T + t)];
  const Tensor& last = dec.forward(prefix.data(), 20);
  ASSERT_EQ(last.size(0), B);
  for (int64_t b = 0; b < B; ++b)
    EXPECT_LE(row_error(last.f32() + b * Vp, full + (b * T + 19) * Vp, c.vocab_size), 1e-5);
}

INSTANTIATE_TEST_SUITE_P(Tying, CachedLogits, ::testing::Values(true, false));

TEST(Generate, CachedEqualsRecomputeSampler) {
  const GPTConfig c = small_config();
  MemoryPool pool("cpu:0");
  GPT gpt(c, pool, 1);
  randomise(gpt, 12);
  struct Case {
    int64_t prompt, tokens;
    float temperature;
    int64_t top_k;
    uint64_t seed;
  };
  // The last cases run past block_size (64): the window slides as in the recompute sampler.
  for (const Case& k : {Case{1, 30, 1.0f, 40, 1}, Case{7, 40, 0.7f, 0, 2}, Case{20, 20, 1.3f, 5, 3},
                        Case{10, 70, 1.0f, 0, 4}, Case{80, 6, 0.9f, 50, 5}}) {
    const std::vector<int32_t> prompt = random_tokens(k.prompt, c.vocab_size, uint32_t(k.seed));
    train::SampleOptions so;
    so.max_new_tokens = k.tokens;
    so.temperature = k.temperature;
    so.top_k = k.top_k;
    so.seed = k.seed;
    const std::vector<int32_t> want = train::sample_recompute(gpt, prompt, so);
    const std::vector<int32_t> got = model::generate_cached(
        gpt, prompt, k.tokens,
        [&](const float* logits, uint64_t index) { return train::sample_logits(logits, c.vocab_size, so, index); });
    EXPECT_EQ(got, want) << "prompt " << k.prompt << " tokens " << k.tokens << " seed " << k.seed;
    EXPECT_EQ(int64_t(got.size()), k.tokens);
  }
  // A stop token ends generation after it is emitted, as in the recompute sampler.
  const std::vector<int32_t> prompt = random_tokens(5, c.vocab_size, 9);
  train::SampleOptions so;
  so.max_new_tokens = 30;
  so.seed = 9;
  const std::vector<int32_t> free_run = train::sample_recompute(gpt, prompt, so);
  so.stop_token = free_run[6];
  const std::vector<int32_t> want = train::sample_recompute(gpt, prompt, so);
  const std::vector<int32_t> got = model::generate_cached(
      gpt, prompt, 30, [&](const float* l, uint64_t i) { return train::sample_logits(l, c.vocab_size, so, i); },
      so.stop_token);
  EXPECT_EQ(got, want);
  EXPECT_LE(got.size(), 7u);
  EXPECT_EQ(got.back(), so.stop_token);
}

// Top-k keeps every token tied with the k-th logit, as nanoGPT's and transformers' do (loom had
// kept exactly k, the lowest ids among the ties); top-k 1 stays the argmax (the lowest tied id).
TEST(Generate, TopKKeepsTheTokensTiedWithTheKth) {
  std::vector<float> logits(32, -5.0f);
  logits[3] = 2.0f;
  for (int id : {7, 11, 20, 29}) logits[size_t(id)] = 1.0f;  // four tied for second place
  train::SampleOptions so;
  so.top_k = 2;
  so.temperature = 1.0f;
  std::map<int32_t, int> seen;
  for (uint64_t i = 0; i < 4000; ++i) ++seen[train::sample_logits(logits.data(), 32, so, i)];
  EXPECT_EQ(seen.size(), 5u);  // the first and the four tied
  for (int id : {3, 7, 11, 20, 29}) EXPECT_GT(seen[id], 0) << id;
  // Each tied token is drawn e^-1 / (1 + 4 e^-1) of the time (0.2442); 4000 draws: within 5 sigma.
  const double p = std::exp(-1.0) / (1 + 4 * std::exp(-1.0)), sd = std::sqrt(4000 * p * (1 - p));
  for (int id : {7, 11, 20, 29}) EXPECT_NEAR(seen[id], 4000 * p, 5 * sd) << id;
  so.top_k = 1;
  logits[7] = 2.0f;  // tied with 3 for first place
  for (uint64_t i = 0; i < 50; ++i) EXPECT_EQ(train::sample_logits(logits.data(), 32, so, i), 3);
}

// The decoder takes its attention scratch once, sized for the largest call its cache allows: after
// the prefill and the first one-token step (which resize its other buffers) further tokens
// allocate nothing, and no call it can make needs more than attention_workspace_bytes.
TEST(Generate, DecoderAllocatesNothingPerToken) {
  const GPTConfig c = small_config();
  MemoryPool pool("cpu:0");
  GPT gpt(c, pool, 1);
  randomise(gpt, 13);
  const int64_t B = 2, T = c.block_size;
  const std::vector<int32_t> toks = random_tokens(B * T, c.vocab_size, 6);
  CachedDecoder dec(gpt, B, T);
  dec.forward(toks.data(), 5);
  dec.forward(toks.data() + 10, 1);
  const int64_t taken = pool.total_allocations();
  for (int64_t pos = 6; pos < T; ++pos) dec.forward(toks.data() + 2 * pos, 1);
  EXPECT_EQ(pool.total_allocations(), taken);
  EXPECT_EQ(dec.length(), T);

  const int64_t C = c.n_embd;
  for (int threads : {1, 2, 3, 8}) {
    const int64_t held = dec.attention_workspace_bytes(threads);
    for (int64_t pos = 0; pos < T; ++pos)
      for (int64_t n = 1; pos + n <= T; ++n) {
        cpu::AttnArgs a;
        a.B = 1, a.NH = c.n_head, a.HS = C / c.n_head, a.Tq = n, a.Tkv = pos + n;
        a.q_stride = 3 * C, a.kv_stride = C, a.o_stride = C, a.q_pos0 = pos;
        ASSERT_LE(cpu::attention_workspace_bytes(a, false, threads), held)
            << n << " tokens at position " << pos << ", " << threads << " threads";
      }
  }
}

TEST(Generate, RejectsBadArguments) {
  const GPTConfig c = small_config();
  MemoryPool pool("cpu:0");
  GPT gpt(c, pool, 1);
  auto first = [](const float*, uint64_t) { return int32_t(0); };
  EXPECT_THROW(model::generate_cached(gpt, {}, 3, first), Error);
  EXPECT_THROW(CachedDecoder(gpt, 1, c.block_size + 1), Error);
  EXPECT_THROW(CachedDecoder(gpt, 0, 8), Error);
  CachedDecoder dec(gpt, 1, 8);
  const int32_t bad = int32_t(c.vocab_size);
  EXPECT_THROW(dec.forward(&bad, 1), Error);  // token outside the vocabulary
  EXPECT_TRUE(model::generate_cached(gpt, {1, 2}, 0, first).empty());
}
