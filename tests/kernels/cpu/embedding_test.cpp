#include "kernels/cpu/embedding.h"

#include <gtest/gtest.h>

#include <vector>

#include "core/error.h"
#include "kernels/cpu/kernel_test_util.h"

using namespace loom;
using loom::test::all_close;
using loom::test::random_vec;
using loom::test::ScopedThreads;

namespace {

constexpr int64_t B = 3, T = 37, C = 67, V = 1000, maxT = 64, pos0 = 5;

// Tokens with many repeats (ids drawn from a small range) so scatter-adds collide.
std::vector<int32_t> make_tokens(uint64_t seed) {
  auto u = random_vec(B * T, seed, 0.f, 1.f);
  std::vector<int32_t> t(u.size());
  for (size_t i = 0; i < u.size(); ++i) t[i] = int32_t(u[i] * 20.f) * 37 % int32_t(V);
  t[0] = int32_t(V - 1);  // the last row of the table
  return t;
}

}  // namespace

TEST(Embedding, ForwardGathersAndAddsPositions) {
  auto tok = make_tokens(1);
  auto wte = random_vec(V * C, 2), wpe = random_vec(maxT * C, 3);
  std::vector<float> out(size_t(B * T * C));
  cpu::embedding_forward(out.data(), tok.data(), wte.data(), wpe.data(), B, T, C, V, pos0);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t c = 0; c < C; ++c) {
        const float want = wte[size_t(tok[size_t(b * T + t)] * C + c)] + wpe[size_t((pos0 + t) * C + c)];
        ASSERT_EQ(out[size_t((b * T + t) * C + c)], want) << b << "," << t << "," << c;  // one float add: exact
      }
  // Without a position table the rows are copies.
  cpu::embedding_forward(out.data(), tok.data(), wte.data(), nullptr, B, T, C, V);
  for (int64_t c = 0; c < C; ++c) EXPECT_EQ(out[size_t(C + c)], wte[size_t(tok[1] * C + c)]);
}

TEST(Embedding, BackwardMatchesDoubleReference) {
  auto tok = make_tokens(4);
  auto dout = random_vec(B * T * C, 5);
  auto dwte = random_vec(V * C, 6), dwpe = random_vec(maxT * C, 7);  // accumulate into non-zero
  std::vector<double> want_wte(dwte.begin(), dwte.end()), want_wpe(dwpe.begin(), dwpe.end());
  for (int64_t bt = 0; bt < B * T; ++bt)
    for (int64_t c = 0; c < C; ++c) {
      want_wte[size_t(tok[size_t(bt)] * C + c)] += dout[size_t(bt * C + c)];
      want_wpe[size_t((pos0 + bt % T) * C + c)] += dout[size_t(bt * C + c)];
    }
  cpu::embedding_backward(dwte.data(), dwpe.data(), dout.data(), tok.data(), B, T, C, V, pos0);
  // Up to B*T float additions of values in [-1, 1].
  EXPECT_TRUE(all_close(dwte, want_wte, 1e-5, 1e-6));
  EXPECT_TRUE(all_close(dwpe, want_wpe, 1e-5, 1e-6));
}

TEST(Embedding, BackwardIndependentOfThreadCount) {
  auto tok = make_tokens(8);
  auto dout = random_vec(B * T * C, 9);
  auto run = [&](int threads) {
    ScopedThreads st(threads);
    auto dwte = random_vec(V * C, 10), dwpe = random_vec(maxT * C, 11);
    cpu::embedding_backward(dwte.data(), dwpe.data(), dout.data(), tok.data(), B, T, C, V, pos0);
    return std::make_pair(dwte, dwpe);
  };
  const auto r1 = run(1);
  EXPECT_EQ(r1, run(2));
  EXPECT_EQ(r1, run(3));
  EXPECT_EQ(r1, run(8));
}

TEST(Embedding, TokenOutsideVocabularyThrows) {
  auto tok = make_tokens(12);
  auto wte = random_vec(V * C, 13), wpe = random_vec(maxT * C, 14);
  std::vector<float> out(size_t(B * T * C));
  tok[17] = int32_t(V);
  EXPECT_THROW(cpu::embedding_forward(out.data(), tok.data(), wte.data(), wpe.data(), B, T, C, V), Error);
  EXPECT_THROW(cpu::embedding_backward(wte.data(), nullptr, out.data(), tok.data(), B, T, C, V), Error);
  tok[17] = -3;
  try {
    cpu::embedding_forward(out.data(), tok.data(), wte.data(), wpe.data(), B, T, C, V);
    FAIL() << "expected loom::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("token id -3 at index 17"), std::string::npos) << e.what();
  }
}
