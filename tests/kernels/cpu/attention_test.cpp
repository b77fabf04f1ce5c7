// Tiled attention (forward and backward) against a naive double-precision reference with a full
// softmax, plus central finite differences, thread-count independence and argument checks.
//
// Tolerances (f32 kernel vs double reference): out, lse: |err| <= 1e-5 + 1e-5 |ref|; gradients:
// |err| <= 1e-5 max(1, max |ref|) + 1e-5 |ref|. Finite differences of the f32 forward (step 1e-2):
// |err| <= 2e-3 + 2e-3 |analytic|.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/memory.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/kernel_test_util.h"

namespace loom::test {
namespace {

using cpu::AttnArgs;

constexpr double kInf = std::numeric_limits<double>::infinity();

// Q f32 [B, Tq, q_stride], K and V f32 [B, Tkv, kv_stride] (separate buffers, or K/V inside one packed
// qkv buffer when packed), O f32 [B, Tq, o_stride]. The strides may exceed NH * HS (padding columns).
struct Problem {
  AttnArgs a;
  bool packed = false;  // q, k, v inside one qkv [B, T, 3C] buffer (needs Tq == Tkv and zero positions)
  std::vector<float> qbuf, kbuf, vbuf;
  const float* q() const { return qbuf.data(); }
  const float* k() const { return packed ? qbuf.data() + a.NH * a.HS : kbuf.data(); }
  const float* v() const { return packed ? qbuf.data() + 2 * a.NH * a.HS : vbuf.data(); }
  int64_t q_size() const { return a.B * a.Tq * a.q_stride; }
  int64_t kv_size() const { return a.B * a.Tkv * a.kv_stride; }
  int64_t o_size() const { return a.B * a.Tq * a.o_stride; }
  double scale() const { return a.scale != 0 ? double(a.scale) : 1.0 / std::sqrt(double(float(a.HS))); }
};

struct Shape {
  int64_t B, NH, HS, Tq, Tkv;
  int64_t q_pos0 = 0, kv_pos0 = 0;
  bool causal = true;
  bool packed = false;
  int64_t pad = 0;      // extra columns per row beyond NH * HS (unpacked only)
  float scale = 0.f;
  float qk_range = 2.f;  // q and k uniform in [-qk_range, qk_range) (larger: peakier softmax)
};

Problem make_problem(const Shape& s, uint64_t seed) {
  Problem p;
  AttnArgs& a = p.a;
  a.B = s.B, a.NH = s.NH, a.HS = s.HS, a.Tq = s.Tq, a.Tkv = s.Tkv;
  a.q_pos0 = s.q_pos0, a.kv_pos0 = s.kv_pos0, a.causal = s.causal, a.scale = s.scale;
  const int64_t C = s.NH * s.HS;
  p.packed = s.packed;
  if (s.packed) {
    a.q_stride = a.kv_stride = 3 * C;
    a.o_stride = C;
    p.qbuf = random_vec(a.B * a.Tq * 3 * C, seed, -s.qk_range, s.qk_range);
    // v is the last third of each row: draw it again in [-1, 1).
    const auto vv = random_vec(a.B * a.Tq * C, seed + 1);
    for (int64_t r = 0; r < a.B * a.Tq; ++r)
      std::copy(vv.begin() + r * C, vv.begin() + (r + 1) * C, p.qbuf.begin() + r * 3 * C + 2 * C);
  } else {
    a.q_stride = a.kv_stride = C + s.pad;
    a.o_stride = C + 2 * s.pad;
    p.qbuf = random_vec(p.q_size(), seed, -s.qk_range, s.qk_range);
    p.kbuf = random_vec(p.kv_size(), seed + 1, -s.qk_range, s.qk_range);
    p.vbuf = random_vec(p.kv_size(), seed + 2);
  }
  return p;
}

struct Ref {
  std::vector<double> out, lse;  // [B, Tq, o_stride] (padding 0), [B, NH, Tq]
  std::vector<double> dq, dk, dv;
};

// Full softmax per row in double; gradients from P directly (D = sum_j P dP, not from out).
Ref reference(const Problem& p, const std::vector<float>& dout) {
  const AttnArgs& a = p.a;
  const double scale = p.scale();
  Ref r;
  r.out.assign(size_t(p.o_size()), 0.0);
  r.lse.assign(size_t(a.B * a.NH * a.Tq), 0.0);
  r.dq.assign(size_t(p.q_size()), 0.0);
  r.dk.assign(size_t(p.kv_size()), 0.0);
  r.dv.assign(size_t(p.kv_size()), 0.0);
  auto Q = [&](int64_t b, int64_t t, int64_t h) { return p.q() + (b * a.Tq + t) * a.q_stride + h * a.HS; };
  auto K = [&](int64_t b, int64_t t, int64_t h) { return p.k() + (b * a.Tkv + t) * a.kv_stride + h * a.HS; };
  auto V = [&](int64_t b, int64_t t, int64_t h) { return p.v() + (b * a.Tkv + t) * a.kv_stride + h * a.HS; };
  std::vector<double> s(size_t(a.Tkv)), pr(size_t(a.Tkv)), dp(size_t(a.Tkv));
  for (int64_t b = 0; b < a.B; ++b)
    for (int64_t h = 0; h < a.NH; ++h)
      for (int64_t i = 0; i < a.Tq; ++i) {
        double mx = -kInf;
        for (int64_t j = 0; j < a.Tkv; ++j) {
          const bool vis = !a.causal || a.kv_pos0 + j <= a.q_pos0 + i;
          double dot = 0;
          for (int64_t d = 0; d < a.HS; ++d) dot += double(Q(b, i, h)[d]) * double(K(b, j, h)[d]);
          s[j] = vis ? dot * scale : -kInf;
          mx = std::max(mx, s[j]);
        }
        const int64_t orow = (b * a.Tq + i) * a.o_stride + h * a.HS;
        const int64_t qrow = (b * a.Tq + i) * a.q_stride + h * a.HS;
        if (mx == -kInf) {
          r.lse[(b * a.NH + h) * a.Tq + i] = -kInf;
          continue;  // out and all gradients of this row stay 0
        }
        double sum = 0;
        for (int64_t j = 0; j < a.Tkv; ++j) sum += (pr[j] = std::exp(s[j] - mx));
        for (int64_t j = 0; j < a.Tkv; ++j) pr[j] /= sum;
        r.lse[(b * a.NH + h) * a.Tq + i] = mx + std::log(sum);
        for (int64_t j = 0; j < a.Tkv; ++j)
          for (int64_t d = 0; d < a.HS; ++d) r.out[orow + d] += pr[j] * double(V(b, j, h)[d]);
        if (dout.empty()) continue;
        double D = 0;
        for (int64_t j = 0; j < a.Tkv; ++j) {
          dp[j] = 0;
          for (int64_t d = 0; d < a.HS; ++d) dp[j] += double(dout[orow + d]) * double(V(b, j, h)[d]);
          D += pr[j] * dp[j];
        }
        for (int64_t j = 0; j < a.Tkv; ++j) {
          const double ds = pr[j] * (dp[j] - D) * scale;
          const int64_t krow = (b * a.Tkv + j) * a.kv_stride + h * a.HS;
          for (int64_t d = 0; d < a.HS; ++d) {
            r.dq[qrow + d] += ds * double(K(b, j, h)[d]);
            r.dk[krow + d] += ds * double(Q(b, i, h)[d]);
            r.dv[krow + d] += pr[j] * double(dout[orow + d]);
          }
        }
      }
  return r;
}

struct Result {
  std::vector<float> out, lse, dq, dk, dv;
};

// Runs forward then backward. The gradient buffers start as NaN so that any element the kernel
// fails to write shows up; padding columns start as 0 and must stay untouched.
Result run(const Problem& p, const std::vector<float>& dout) {
  const AttnArgs& a = p.a;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  Result r;
  r.out.assign(size_t(p.o_size()), 0.f);
  r.lse.assign(size_t(a.B * a.NH * a.Tq), nan);
  // Padding columns of out stay 0: write only through the kernel.
  cpu::attention_forward(r.out.data(), r.lse.data(), p.q(), p.k(), p.v(), a);
  const int64_t C = a.NH * a.HS;
  // NaN in the NH * HS columns of every row, 0 in the padding columns.
  auto poisoned = [&](int64_t rows, int64_t stride) {
    std::vector<float> g(size_t(rows * stride), 0.f);
    for (int64_t t = 0; t < rows; ++t) std::fill(g.begin() + t * stride, g.begin() + t * stride + C, nan);
    return g;
  };
  r.dq = poisoned(a.B * a.Tq, a.q_stride);
  r.dk = poisoned(a.B * a.Tkv, a.kv_stride);
  r.dv = poisoned(a.B * a.Tkv, a.kv_stride);
  if (p.packed) {
    // dq, dk, dv inside one dqkv [B, T, 3C] buffer: each third is written by one of them.
    std::vector<float> dqkv(size_t(p.q_size()), nan);
    cpu::attention_backward(dqkv.data(), dqkv.data() + C, dqkv.data() + 2 * C, dout.data(), p.q(), p.k(), p.v(),
                            r.out.data(), r.lse.data(), a);
    r.dq = r.dk = r.dv = dqkv;
  } else {
    cpu::attention_backward(r.dq.data(), r.dk.data(), r.dv.data(), dout.data(), p.q(), p.k(), p.v(), r.out.data(),
                            r.lse.data(), a);
  }
  return r;
}

// Reference gradients in the layout of Result (for packed problems: one dqkv buffer).
void reference_grads(const Problem& p, const Ref& ref, std::vector<double>& dq, std::vector<double>& dk,
                     std::vector<double>& dv) {
  if (!p.packed) {
    dq = ref.dq, dk = ref.dk, dv = ref.dv;
    return;
  }
  // ref.dq/dk/dv are each [B, T, 3C] with their own third filled (strides are 3C for all three).
  const int64_t C = p.a.NH * p.a.HS;
  std::vector<double> all(ref.dq.size(), 0.0);
  for (int64_t r = 0; r < p.a.B * p.a.Tq; ++r)
    for (int64_t c = 0; c < C; ++c) {
      all[r * 3 * C + c] = ref.dq[r * 3 * C + c];
      all[r * 3 * C + C + c] = ref.dk[r * 3 * C + c];
      all[r * 3 * C + 2 * C + c] = ref.dv[r * 3 * C + c];
    }
  dq = dk = dv = all;
}

double max_abs(const std::vector<double>& v) {
  double m = 0;
  for (double x : v) m = std::max(m, std::fabs(x));
  return m;
}

::testing::AssertionResult lse_close(const std::vector<float>& got, const std::vector<double>& want) {
  for (size_t i = 0; i < want.size(); ++i) {
    if (want[i] == -kInf) {
      if (got[i] != -std::numeric_limits<float>::infinity())
        return ::testing::AssertionFailure() << "lse[" << i << "] = " << got[i] << ", want -inf";
      continue;
    }
    if (!(std::fabs(double(got[i]) - want[i]) <= 1e-5 + 1e-5 * std::fabs(want[i])))
      return ::testing::AssertionFailure() << "lse[" << i << "] = " << got[i] << ", want " << want[i];
  }
  return ::testing::AssertionSuccess();
}

void check_against_reference(const Shape& s, uint64_t seed) {
  SCOPED_TRACE(::testing::Message() << "B=" << s.B << " NH=" << s.NH << " HS=" << s.HS << " Tq=" << s.Tq
                                    << " Tkv=" << s.Tkv << " q_pos0=" << s.q_pos0 << " kv_pos0=" << s.kv_pos0
                                    << " causal=" << s.causal << " packed=" << s.packed);
  const Problem p = make_problem(s, seed);
  const std::vector<float> dout = random_vec(p.o_size(), seed + 7);
  const Ref ref = reference(p, dout);
  const Result got = run(p, dout);

  // Padding columns of out are never written, so 0 there matches the reference.
  EXPECT_TRUE(all_close(got.out, ref.out, 1e-5, 1e-5)) << "out";
  EXPECT_TRUE(lse_close(got.lse, ref.lse));

  std::vector<double> dq, dk, dv;
  reference_grads(p, ref, dq, dk, dv);
  EXPECT_TRUE(all_close(got.dq, dq, 1e-5 * std::max(1.0, max_abs(dq)), 1e-5)) << "dq";
  EXPECT_TRUE(all_close(got.dk, dk, 1e-5 * std::max(1.0, max_abs(dk)), 1e-5)) << "dk";
  EXPECT_TRUE(all_close(got.dv, dv, 1e-5 * std::max(1.0, max_abs(dv)), 1e-5)) << "dv";
}

TEST(Attention, CausalOddShapes) {
  ScopedThreads threads(2);
  uint64_t seed = 100;
  for (int64_t T : {1, 7, 33, 100})
    for (int64_t HS : {16, 64, 24})
      check_against_reference({.B = 2, .NH = 3, .HS = HS, .Tq = T, .Tkv = T}, seed++);
}

// GPT-2 head size over several full tiles, with enough (b, h) pairs that one unit sums all of dQ.
TEST(Attention, ManyHeadsFullTiles) {
  ScopedThreads threads(2);
  check_against_reference({.B = 3, .NH = 12, .HS = 64, .Tq = 192, .Tkv = 192, .packed = true}, 150);
}

TEST(Attention, PackedQkvAndPaddedStrides) {
  ScopedThreads threads(2);
  check_against_reference({.B = 2, .NH = 3, .HS = 24, .Tq = 33, .Tkv = 33, .packed = true}, 200);
  check_against_reference({.B = 1, .NH = 3, .HS = 20, .Tq = 100, .Tkv = 100, .pad = 5}, 201);
  check_against_reference({.B = 1, .NH = 2, .HS = 64, .Tq = 129, .Tkv = 129, .pad = 3}, 202);
}

TEST(Attention, NonCausal) {
  ScopedThreads threads(2);
  check_against_reference({.B = 2, .NH = 3, .HS = 16, .Tq = 100, .Tkv = 100, .causal = false}, 300);
  check_against_reference({.B = 1, .NH = 3, .HS = 24, .Tq = 7, .Tkv = 70, .causal = false}, 301);
  check_against_reference({.B = 1, .NH = 2, .HS = 64, .Tq = 65, .Tkv = 33, .causal = false}, 302);
}

TEST(Attention, PositionOffsets) {
  ScopedThreads threads(2);
  // Later queries against a longer key block starting at 0 (a context-parallel rank's diagonal).
  check_against_reference({.B = 1, .NH = 3, .HS = 24, .Tq = 33, .Tkv = 100, .q_pos0 = 67}, 400);
  // Some query rows see no key (positions 10..49 vs keys 30..99): out 0, lse -inf.
  check_against_reference({.B = 2, .NH = 3, .HS = 16, .Tq = 40, .Tkv = 70, .q_pos0 = 10, .kv_pos0 = 30}, 401);
  // A key block entirely in the past: every key visible.
  check_against_reference({.B = 1, .NH = 3, .HS = 64, .Tq = 130, .Tkv = 200, .q_pos0 = 300}, 402);
  // A key block entirely in the future: nothing visible.
  check_against_reference({.B = 1, .NH = 3, .HS = 16, .Tq = 5, .Tkv = 9, .kv_pos0 = 100}, 403);
  // Tq > Tkv with the diagonal crossing the middle of tiles.
  check_against_reference({.B = 1, .NH = 3, .HS = 24, .Tq = 150, .Tkv = 37, .q_pos0 = 5, .kv_pos0 = 50}, 404);
}

TEST(Attention, ScaleAndPeakySoftmax) {
  ScopedThreads threads(2);
  check_against_reference({.B = 1, .NH = 3, .HS = 24, .Tq = 100, .Tkv = 100, .scale = 0.3f}, 500);
  // Scores of tens: the online softmax must rescale without overflow.
  check_against_reference({.B = 1, .NH = 3, .HS = 16, .Tq = 100, .Tkv = 100, .qk_range = 4.f}, 501);
}

// Context parallelism splits the keys into blocks with their own kv_pos0: forward per block merged
// through the log-sum-exp, and backward per block with the merged out and lse (dq summed over them)
// must equal one call over all keys (f32 both ways: |err| <= 2e-6 + 1e-5 |full|).
TEST(Attention, KeyBlocksComposeLikeOneCall) {
  ScopedThreads threads(2);
  const int64_t NH = 3, HS = 24, C = NH * HS, Tq = 70, Tkv = 150, split = 83;
  AttnArgs full;
  full.B = 1, full.NH = NH, full.HS = HS, full.Tq = Tq, full.Tkv = Tkv;
  full.q_stride = full.kv_stride = full.o_stride = C;
  full.q_pos0 = 80;  // queries at 80..149 against keys 0..149
  const auto q = random_vec(Tq * C, 1100, -2.f, 2.f), k = random_vec(Tkv * C, 1101, -2.f, 2.f),
             v = random_vec(Tkv * C, 1102), dout = random_vec(Tq * C, 1103);

  std::vector<float> out(size_t(Tq * C)), lse(size_t(NH * Tq));
  std::vector<float> dq(size_t(Tq * C)), dk(size_t(Tkv * C)), dv(size_t(Tkv * C));
  cpu::attention_forward(out.data(), lse.data(), q.data(), k.data(), v.data(), full);
  cpu::attention_backward(dq.data(), dk.data(), dv.data(), dout.data(), q.data(), k.data(), v.data(), out.data(),
                          lse.data(), full);

  // Blocks [0, split) and [split, Tkv).
  AttnArgs blk[2] = {full, full};
  blk[0].Tkv = split;
  blk[1].Tkv = Tkv - split, blk[1].kv_pos0 = split;
  const int64_t k0[2] = {0, split};
  std::vector<float> bo[2], bl[2];
  for (int i = 0; i < 2; ++i) {
    bo[i].resize(out.size()), bl[i].resize(lse.size());
    cpu::attention_forward(bo[i].data(), bl[i].data(), q.data(), k.data() + k0[i] * C, v.data() + k0[i] * C, blk[i]);
  }
  std::vector<float> mo(out.size()), ml(lse.size());
  for (int64_t h = 0; h < NH; ++h)
    for (int64_t t = 0; t < Tq; ++t) {
      const float l0 = bl[0][size_t(h * Tq + t)], l1 = bl[1][size_t(h * Tq + t)];
      const float m = std::max(l0, l1);
      const float l = m + std::log(std::exp(l0 - m) + std::exp(l1 - m));
      ml[size_t(h * Tq + t)] = l;
      for (int64_t d = 0; d < HS; ++d) {
        const size_t i = size_t(t * C + h * HS + d);
        mo[i] = std::exp(l0 - l) * bo[0][i] + std::exp(l1 - l) * bo[1][i];
      }
    }
  EXPECT_TRUE(all_close(mo, to_double(out), 2e-6, 1e-5)) << "merged out";
  EXPECT_TRUE(all_close(ml, to_double(lse), 2e-6, 1e-5)) << "merged lse";

  std::vector<float> bdq(dq.size(), 0.f), bdk(dk.size()), bdv(dv.size()), part(dq.size());
  for (int i = 0; i < 2; ++i) {
    cpu::attention_backward(part.data(), bdk.data() + k0[i] * C, bdv.data() + k0[i] * C, dout.data(), q.data(),
                            k.data() + k0[i] * C, v.data() + k0[i] * C, mo.data(), ml.data(), blk[i]);
    for (size_t j = 0; j < part.size(); ++j) bdq[j] += part[j];
  }
  EXPECT_TRUE(all_close(bdq, to_double(dq), 2e-6, 1e-5)) << "dq";
  EXPECT_TRUE(all_close(bdk, to_double(dk), 2e-6, 1e-5)) << "dk";
  EXPECT_TRUE(all_close(bdv, to_double(dv), 2e-6, 1e-5)) << "dv";
}

TEST(Attention, EmptyKeyBlock) {
  const Problem p = make_problem({.B = 2, .NH = 3, .HS = 16, .Tq = 5, .Tkv = 0}, 700);
  const std::vector<float> dout = random_vec(p.o_size(), 701);
  const Result got = run(p, dout);
  for (float x : got.out) EXPECT_EQ(x, 0.f);
  for (float x : got.lse) EXPECT_EQ(x, -std::numeric_limits<float>::infinity());
  for (float x : got.dq) EXPECT_EQ(x, 0.f);
}

// Results are bitwise identical for 1, 2 and 3 threads, with few (b, h) pairs (dQ partials per key-tile
// group) and with many.
TEST(Attention, IndependentOfThreadCount) {
  for (const Shape& s : {Shape{.B = 1, .NH = 3, .HS = 24, .Tq = 200, .Tkv = 200},
                         Shape{.B = 3, .NH = 12, .HS = 16, .Tq = 90, .Tkv = 130, .q_pos0 = 40},
                         Shape{.B = 1, .NH = 2, .HS = 16, .Tq = 150, .Tkv = 150, .causal = false}}) {
    const Problem p = make_problem(s, 800);
    const std::vector<float> dout = random_vec(p.o_size(), 801);
    Result base;
    {
      ScopedThreads threads(1);
      base = run(p, dout);
    }
    for (int n : {2, 3}) {
      ScopedThreads threads(n);
      const Result r = run(p, dout);
      EXPECT_EQ(r.out, base.out) << n << " threads";
      EXPECT_EQ(r.lse, base.lse) << n << " threads";
      EXPECT_EQ(r.dq, base.dq) << n << " threads";
      EXPECT_EQ(r.dk, base.dk) << n << " threads";
      EXPECT_EQ(r.dv, base.dv) << n << " threads";
    }
  }
}

// Central finite differences of L = sum(out * W) through the f32 forward, for every input element of a
// tiny problem with an offset and a row that sees no key.
TEST(Attention, BackwardMatchesFiniteDifferences) {
  ScopedThreads threads(1);  // hundreds of tiny forward calls: no thread start-up per call
  Problem p = make_problem({.B = 1, .NH = 2, .HS = 5, .Tq = 4, .Tkv = 6, .q_pos0 = 2, .kv_pos0 = 3}, 900);
  const std::vector<float> w = random_vec(p.o_size(), 901);
  const Result an = run(p, w);

  auto loss = [&]() {
    std::vector<float> out(size_t(p.o_size())), lse(size_t(p.a.B * p.a.NH * p.a.Tq));
    cpu::attention_forward(out.data(), lse.data(), p.q(), p.k(), p.v(), p.a);
    double l = 0;
    for (size_t i = 0; i < out.size(); ++i) l += double(out[i]) * double(w[i]);
    return l;
  };
  const float eps = 1e-2f;
  auto check = [&](std::vector<float>& x, const std::vector<float>& grad, const char* name) {
    for (size_t i = 0; i < x.size(); ++i) {
      const float x0 = x[i];
      x[i] = x0 + eps;
      const double lp = loss();
      x[i] = x0 - eps;
      const double lm = loss();
      x[i] = x0;
      const double fd = (lp - lm) / (2.0 * double(eps));
      EXPECT_NEAR(grad[i], fd, 2e-3 + 2e-3 * std::fabs(fd)) << name << "[" << i << "]";
    }
  };
  check(p.qbuf, an.dq, "dq");
  check(p.kbuf, an.dk, "dk");
  check(p.vbuf, an.dv, "dv");
  // Query row 0 (position 2) sees no key (keys start at 3): zero output and zero gradient.
  for (int64_t h = 0; h < 2; ++h) {
    EXPECT_EQ(an.lse[size_t(h * 4)], -std::numeric_limits<float>::infinity());
    for (int64_t d = 0; d < 5; ++d) EXPECT_EQ(an.dq[size_t(h * 5 + d)], 0.f);
  }
}

// The scratch size written out from the formula in attention.h, independently of the kernel's plan.
int64_t documented_workspace_bytes(const AttnArgs& a, bool backward, int64_t threads) {
  auto ceil_div = [](int64_t x, int64_t y) { return (x + y - 1) / y; };
  auto pad = [](int64_t n) { return (n + 15) / 16 * 16; };
  if (a.B == 0 || (!backward && a.Tq == 0)) return 0;
  const int64_t HS = a.HS, HSp = (HS + 7) / 8 * 8, BNH = a.B * a.NH, Tq = a.Tq, Tkv = a.Tkv;
  if (!backward) {
    const int64_t chunks = std::clamp<int64_t>(ceil_div(4 * threads, BNH), 1, ceil_div(Tq, 64));
    const int64_t team = std::min(threads, BNH * chunks);
    return 4 * team * (pad(64 * HS) + 2 * pad(Tkv * HSp) + pad(64 * 64) + pad(64 * HSp));
  }
  const int64_t BNKV = a.B * (a.NKV > 0 ? a.NKV : a.NH);
  const int64_t G =
      BNKV >= 32 ? 1 : std::clamp<int64_t>(ceil_div(32, BNKV), 1, std::max<int64_t>(ceil_div(Tkv, 64), 1));
  const int64_t team = std::min(threads, BNKV * G);
  const int64_t per_thread = 2 * pad(64 * HS) + 3 * pad(64 * HSp) + (G == 1 ? 3 : 2) * pad(Tq * HSp) + pad(Tq) +
                             2 * pad(64 * 64);
  return 4 * (team * per_thread + (G > 1 ? pad(G * BNH * Tq * HSp) : 0));
}

// Grouped-query attention equals multi-head attention over K and V with each key/value head
// repeated for the query heads that read it, bit for bit: the same outputs and dQ, and dK, dV the
// repeated heads' gradients added in head order. Both backward paths (dQ by key-tile groups with
// few (b, kv head) pairs, whole with many), any thread count, and a workspace as documented.
TEST(Attention, GroupedQueryEqualsRepeatedKeyValueHeads) {
  for (const auto& [B, NH, NKV, T] : std::vector<std::array<int64_t, 4>>{{2, 6, 2, 130}, {4, 16, 8, 70}, {1, 4, 1, 65}}) {
    const int64_t HS = 12, Cq = NH * HS, Ckv = NKV * HS, group = NH / NKV;
    AttnArgs g;
    g.B = B, g.NH = NH, g.NKV = NKV, g.HS = HS, g.Tq = g.Tkv = T;
    g.q_stride = g.o_stride = Cq;
    g.kv_stride = Ckv;
    const auto q = random_vec(B * T * Cq, 71, -2.f, 2.f), k = random_vec(B * T * Ckv, 72, -2.f, 2.f);
    const auto v = random_vec(B * T * Ckv, 73), dout = random_vec(B * T * Cq, 74);
    // K and V with every head repeated `group` times: multi-head attention's inputs.
    std::vector<float> kr(size_t(B * T * Cq)), vr(size_t(B * T * Cq));
    for (int64_t r = 0; r < B * T; ++r)
      for (int64_t h = 0; h < NH; ++h)
        for (int64_t d = 0; d < HS; ++d) {
          kr[size_t(r * Cq + h * HS + d)] = k[size_t(r * Ckv + (h / group) * HS + d)];
          vr[size_t(r * Cq + h * HS + d)] = v[size_t(r * Ckv + (h / group) * HS + d)];
        }
    AttnArgs m = g;
    m.NKV = 0;
    m.kv_stride = Cq;
    auto call = [&](const AttnArgs& a, const float* kk, const float* vv, int64_t ckv, int threads) {
      ScopedThreads st(threads);
      std::vector<float> out(size_t(B * T * Cq)), lse(size_t(B * NH * T)), dq(size_t(B * T * Cq));
      std::vector<float> dk(size_t(B * T * ckv)), dv(size_t(B * T * ckv));
      cpu::attention_forward(out.data(), lse.data(), q.data(), kk, vv, a);
      cpu::attention_backward(dq.data(), dk.data(), dv.data(), dout.data(), q.data(), kk, vv, out.data(), lse.data(), a);
      return std::array<std::vector<float>, 5>{out, lse, dq, dk, dv};
    };
    const auto mha = call(m, kr.data(), vr.data(), Cq, 2);
    for (int threads : {1, 2, 3}) {
      const auto gqa = call(g, k.data(), v.data(), Ckv, threads);
      const std::string what = fmt::format("B={} NH={} NKV={} T={} threads={}", B, NH, NKV, T, threads);
      EXPECT_EQ(gqa[0], mha[0]) << what << ": out";
      EXPECT_EQ(gqa[1], mha[1]) << what << ": lse";
      EXPECT_EQ(gqa[2], mha[2]) << what << ": dq";
      for (int which : {3, 4}) {
        std::vector<float> want(size_t(B * T * Ckv), 0.f);
        for (int64_t r = 0; r < B * T; ++r)
          for (int64_t h = 0; h < NH; ++h)
            for (int64_t d = 0; d < HS; ++d) {
              float& w = want[size_t(r * Ckv + (h / group) * HS + d)];
              const float x = mha[size_t(which)][size_t(r * Cq + h * HS + d)];
              w = h % group == 0 ? x : w + x;
            }
        EXPECT_EQ(gqa[size_t(which)], want) << what << (which == 3 ? ": dk" : ": dv");
      }
    }
    for (int threads : {1, 3})
      EXPECT_EQ(cpu::attention_workspace_bytes(g, true, threads), documented_workspace_bytes(g, true, threads));
  }
  AttnArgs bad;
  bad.B = 1, bad.NH = 6, bad.NKV = 4, bad.HS = 8, bad.Tq = bad.Tkv = 4, bad.q_stride = bad.o_stride = 48,
  bad.kv_stride = 32;
  std::vector<float> buf(1024);
  EXPECT_THROW(cpu::attention_forward(buf.data(), buf.data(), buf.data(), buf.data(), buf.data(), bad), Error);
}

// Each call takes its scratch from AttnArgs.pool under tag workspace: the pool's peak during one forward or
// backward call is attention_workspace_bytes (which follows the formula in the header), and nothing stays
// allocated afterwards. Shapes: few (b, h) pairs (partial dq sums per key-tile group), many (none), a
// single (b, h) with one tile (a team smaller than the thread count) and a cross-attention offset.
TEST(Attention, ScratchComesFromThePoolAsDeclared) {
  for (const Shape& s : {Shape{.B = 2, .NH = 3, .HS = 20, .Tq = 150, .Tkv = 150, .packed = true},
                         Shape{.B = 4, .NH = 8, .HS = 16, .Tq = 70, .Tkv = 70, .packed = true},
                         Shape{.B = 1, .NH = 1, .HS = 8, .Tq = 10, .Tkv = 10},
                         Shape{.B = 1, .NH = 2, .HS = 12, .Tq = 5, .Tkv = 130, .q_pos0 = 125, .pad = 3}}) {
    for (int n : {1, 2}) {
      ScopedThreads threads(n);
      Problem p = make_problem(s, 950);
      MemoryPool pool("attention");
      p.a.pool = &pool;
      const std::vector<float> dout = random_vec(p.o_size(), 951);
      const int64_t fwd = cpu::attention_workspace_bytes(p.a, false, n);
      const int64_t bwd = cpu::attention_workspace_bytes(p.a, true, n);
      EXPECT_EQ(fwd, documented_workspace_bytes(p.a, false, n)) << s.Tq << " queries, " << n << " threads";
      EXPECT_EQ(bwd, documented_workspace_bytes(p.a, true, n)) << s.Tq << " queries, " << n << " threads";
      EXPECT_GT(fwd, 0);
      EXPECT_GT(bwd, fwd);

      std::vector<float> out(size_t(p.o_size()), 0.f), lse(size_t(s.B * s.NH * s.Tq));
      cpu::attention_forward(out.data(), lse.data(), p.q(), p.k(), p.v(), p.a);
      EXPECT_EQ(pool.peak(MemTag::workspace), fwd) << s.Tq << " queries, " << n << " threads";
      EXPECT_EQ(pool.total_peak(), fwd);
      EXPECT_EQ(pool.total_current(), 0);

      pool.reset_peaks();
      std::vector<float> dq(size_t(p.q_size())), dk(size_t(p.kv_size())), dv(size_t(p.kv_size()));
      cpu::attention_backward(dq.data(), dk.data(), dv.data(), dout.data(), p.q(), p.k(), p.v(), out.data(),
                              lse.data(), p.a);
      EXPECT_EQ(pool.peak(MemTag::workspace), bwd) << s.Tq << " queries, " << n << " threads";
      EXPECT_EQ(pool.total_peak(), bwd);
      EXPECT_EQ(pool.total_current(), 0);

      // The same call without a pool uses the default CPU pool, with the same results.
      MemoryPool& dflt = default_cpu_pool();
      const int64_t before = dflt.current(MemTag::workspace);
      dflt.reset_peaks();
      p.a.pool = nullptr;
      std::vector<float> out2(out.size(), 0.f), lse2(lse.size());
      cpu::attention_forward(out2.data(), lse2.data(), p.q(), p.k(), p.v(), p.a);
      EXPECT_EQ(dflt.peak(MemTag::workspace) - before, fwd);
      EXPECT_EQ(dflt.current(MemTag::workspace), before);
      EXPECT_EQ(out2, out);
      EXPECT_EQ(lse2, lse);
    }
  }
  // Nothing to compute, nothing allocated.
  AttnArgs empty = make_problem({.B = 1, .NH = 2, .HS = 8, .Tq = 4, .Tkv = 4}, 952).a;
  empty.Tq = 0;
  EXPECT_EQ(cpu::attention_workspace_bytes(empty, false, 2), 0);
  empty.B = 0;
  EXPECT_EQ(cpu::attention_workspace_bytes(empty, true, 2), 0);
}

// A pool whose memory is not host memory (as a CUDA pool's) is refused by name.
class NotHostAllocator final : public Allocator {
 public:
  void* allocate(size_t) override { throw Error("NotHostAllocator: allocate must not be called"); }
  void deallocate(void*, size_t) override {}
  Device device() const override { return Device::cuda; }
};

TEST(Attention, RejectsBadArguments) {
  const Problem p = make_problem({.B = 1, .NH = 2, .HS = 8, .Tq = 4, .Tkv = 4}, 1000);
  std::vector<float> out(size_t(p.o_size())), lse(8);
  auto expect_error = [&](AttnArgs a, const std::string& field) {
    try {
      cpu::attention_forward(out.data(), lse.data(), p.q(), p.k(), p.v(), a);
      ADD_FAILURE() << "no error for " << field;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(field), std::string::npos) << e.what();
    }
  };
  AttnArgs a = p.a;
  a.q_stride = 15;
  expect_error(a, "q_stride");
  a = p.a;
  a.kv_stride = 0;
  expect_error(a, "kv_stride");
  a = p.a;
  a.o_stride = 7;
  expect_error(a, "o_stride");
  a = p.a;
  a.HS = 0;
  expect_error(a, "HS");
  a = p.a;
  a.Tq = -1;
  expect_error(a, "Tq");
  a = p.a;
  a.scale = std::numeric_limits<float>::infinity();
  expect_error(a, "scale");
  EXPECT_THROW(cpu::attention_forward(out.data(), lse.data(), p.q(), nullptr, p.v(), p.a), Error);
  NotHostAllocator device_memory;
  MemoryPool device_pool("device", &device_memory);
  a = p.a;
  a.pool = &device_pool;
  expect_error(a, "AttnArgs.pool");
  try {
    cpu::attention_workspace_bytes(p.a, true, 0);
    ADD_FAILURE() << "no error for threads = 0";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("threads"), std::string::npos) << e.what();
  }
  std::vector<float> g(size_t(p.q_size()));
  EXPECT_THROW(cpu::attention_backward(g.data(), nullptr, g.data(), out.data(), p.q(), p.k(), p.v(), out.data(),
                                       lse.data(), p.a),
               Error);
}

// A caller's scratch (AttnArgs.scratch, here an AttnWorkspace kept across calls): repeated
// forward and backward calls take nothing from any pool (AttnArgs.pool is a pool that cannot give
// host memory, so a call that tried would fail) and give bitwise the results of calls that take
// their own scratch.
TEST(Attention, CallerScratchIsReusedAcrossCalls) {
  for (const Shape& s : {Shape{.B = 2, .NH = 3, .HS = 20, .Tq = 150, .Tkv = 150, .packed = true},
                         Shape{.B = 4, .NH = 8, .HS = 16, .Tq = 70, .Tkv = 70, .packed = true},
                         Shape{.B = 1, .NH = 2, .HS = 12, .Tq = 5, .Tkv = 130, .q_pos0 = 125, .pad = 3}}) {
    for (int n : {1, 2}) {
      ScopedThreads threads(n);
      Problem p = make_problem(s, 960);
      const std::vector<float> dout = random_vec(p.o_size(), 961);
      const Result ref = run(p, dout);

      MemoryPool pool("caller");
      cpu::AttnWorkspace ws(pool);
      const int64_t need =
          std::max(cpu::attention_workspace_bytes(p.a, false, n), cpu::attention_workspace_bytes(p.a, true, n));
      ws.reserve(need);
      EXPECT_EQ(ws.bytes(), need);
      EXPECT_EQ(pool.current(MemTag::workspace), need);
      NotHostAllocator device_memory;
      MemoryPool device_pool("device", &device_memory);
      p.a.pool = &device_pool;
      p.a = ws.args(p.a);
      for (int rep = 0; rep < 3; ++rep) {
        const Result r = run(p, dout);
        EXPECT_EQ(r.out, ref.out) << s.Tq << " queries, " << n << " threads, call " << rep;
        EXPECT_EQ(r.lse, ref.lse);
        EXPECT_EQ(r.dq, ref.dq);
        EXPECT_EQ(r.dk, ref.dk);
        EXPECT_EQ(r.dv, ref.dv);
      }
      EXPECT_EQ(pool.total_allocations(), 1);
      EXPECT_EQ(device_pool.total_allocations(), 0);
    }
  }
}

// An AttnWorkspace only grows, and gives its block back before taking a larger one (the pool never
// holds both); use() grows it to a call's size; args() before any reservation is refused.
TEST(Attention, WorkspaceGrowsOnlyWhenAskedForMore) {
  MemoryPool pool("ws");
  cpu::AttnWorkspace ws(pool);
  const AttnArgs a = make_problem({.B = 1, .NH = 2, .HS = 8, .Tq = 70, .Tkv = 70}, 965).a;
  try {
    ws.args(a);
    ADD_FAILURE() << "args() of an empty workspace accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("nothing reserved"), std::string::npos) << e.what();
  }
  ws.reserve(4096);
  ws.reserve(1024);
  EXPECT_EQ(ws.bytes(), 4096);
  EXPECT_EQ(pool.allocations(MemTag::workspace), 1);
  ws.reserve(8192);
  EXPECT_EQ(ws.bytes(), 8192);
  EXPECT_EQ(pool.allocations(MemTag::workspace), 2);
  EXPECT_EQ(pool.current(MemTag::workspace), 8192);
  EXPECT_EQ(pool.peak(MemTag::workspace), 8192);
  ws.release();
  EXPECT_EQ(pool.current(MemTag::workspace), 0);
  ScopedThreads threads(2);
  const AttnArgs b = ws.use(a, true);
  EXPECT_EQ(ws.bytes(), cpu::attention_workspace_bytes(a, true, 2));
  EXPECT_EQ(b.scratch_bytes, ws.bytes());
  EXPECT_NE(b.scratch, nullptr);
  ws.use(a, false);  // the forward call needs less: nothing new
  EXPECT_EQ(pool.allocations(MemTag::workspace), 3);
}

// A caller's scratch smaller than the call needs is refused with both sizes in the message; the
// exact size is enough. Scratch bytes without a pointer are refused by field name.
TEST(Attention, RefusesTooSmallScratchNamingTheSizes) {
  const Problem p = make_problem({.B = 2, .NH = 3, .HS = 20, .Tq = 150, .Tkv = 150, .packed = true}, 970);
  const std::vector<float> dout = random_vec(p.o_size(), 971);
  for (int n : {1, 2}) {
    ScopedThreads threads(n);
    const int64_t fwd = cpu::attention_workspace_bytes(p.a, false, n);
    const int64_t bwd = cpu::attention_workspace_bytes(p.a, true, n);
    ASSERT_LT(fwd, bwd);
    std::vector<float> buf(size_t(bwd) / sizeof(float));
    std::vector<float> out(size_t(p.o_size())), lse(size_t(p.a.B * p.a.NH * p.a.Tq));
    std::vector<float> dqkv(size_t(p.q_size()));
    const int64_t C = p.a.NH * p.a.HS;
    auto expect_refusal = [&](const AttnArgs& a, bool backward, int64_t given, int64_t need) {
      try {
        if (backward)
          cpu::attention_backward(dqkv.data(), dqkv.data() + C, dqkv.data() + 2 * C, dout.data(), p.q(), p.k(), p.v(),
                                  out.data(), lse.data(), a);
        else
          cpu::attention_forward(out.data(), lse.data(), p.q(), p.k(), p.v(), a);
        ADD_FAILURE() << given << " bytes of scratch accepted for a call needing " << need;
      } catch (const Error& e) {
        const std::string m = e.what();
        EXPECT_NE(m.find("AttnArgs.scratch_bytes = " + std::to_string(given)), std::string::npos) << m;
        EXPECT_NE(m.find(std::to_string(need) + " bytes"), std::string::npos) << m;
      }
    };
    AttnArgs a = p.a;
    a.scratch = buf.data();
    a.scratch_bytes = fwd - 4;
    expect_refusal(a, false, fwd - 4, fwd);
    a.scratch_bytes = fwd;  // exactly enough for forward, too small for backward
    EXPECT_NO_THROW(cpu::attention_forward(out.data(), lse.data(), p.q(), p.k(), p.v(), a));
    expect_refusal(a, true, fwd, bwd);
    a.scratch_bytes = bwd;
    EXPECT_NO_THROW(cpu::attention_backward(dqkv.data(), dqkv.data() + C, dqkv.data() + 2 * C, dout.data(), p.q(),
                                            p.k(), p.v(), out.data(), lse.data(), a));
    a.scratch = nullptr;
    try {
      cpu::attention_forward(out.data(), lse.data(), p.q(), p.k(), p.v(), a);
      ADD_FAILURE() << "scratch_bytes without scratch accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("AttnArgs.scratch is null"), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace loom::test
