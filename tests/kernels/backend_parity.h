// Op parity of a backend (core/backend.h) against double-precision references written here from
// each op's definition: the same suite for every backend, instantiated per device by
// backend_parity_test.cpp (cpu, and the emulated device in bf16 and f32) and cuda/backend_parity_test.cu (cuda;
// skipped without a GPU).
//
// Inputs are random values rounded to bf16, so a bf16 backend reads exactly the values the
// reference uses. Outputs are poisoned (NaN) before each op, so an unwritten element fails.
// Tolerances, ||got - ref|| / ||ref||:
//   f32 backend (CPU): 1e-5 everywhere (f32 arithmetic on exact inputs, another summation order);
//   bf16 backend (CUDA): 1e-2 for outputs stored in bf16 (one bf16 rounding is about 2e-3, and
//   the attention backward recomputes probabilities in bf16), 1e-3 for f32 outputs (parameter
//   gradients, statistics, log-sum-exp, losses: f32 accumulation of exact bf16 products);
//   f16 backend (CUDA, train.precision fp16): the bf16 backend's tolerances (f16 rounds to 11
//   significant bits where bf16 rounds to 8, and the inputs, all within f16's range, are exact in
//   both), so the same bounds hold with a margin.
#pragma once
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdint>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/backend.h"
#include "core/dtype.h"
#include "core/error.h"

namespace loom::test {

inline std::vector<float> bf16_random(int64_t n, uint32_t seed, float scale = 1.f) {
  std::mt19937 g(seed);
  std::uniform_real_distribution<float> u(-scale, scale);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = bf16_to_f32(f32_to_bf16(u(g)));
  return v;
}

inline double rel_norm_err(const std::vector<float>& got, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (!std::isfinite(got[i])) return std::numeric_limits<double>::infinity();
    num += (double(got[i]) - ref[i]) * (double(got[i]) - ref[i]);
    den += ref[i] * ref[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

inline double gelu_d(double x) { return 0.5 * x * (1 + std::tanh(std::sqrt(2 / M_PI) * (x + 0.044715 * x * x * x))); }
inline double gelu_grad_d(double x) {
  const double k = std::sqrt(2 / M_PI), u = k * (x + 0.044715 * x * x * x), t = std::tanh(u);
  return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * k * (1 + 3 * 0.044715 * x * x);
}

// A buffer of the backend's memory: uploaded from f32 values (converted to dtype), downloaded as
// f32, poisoned with NaN.
struct DevBuf {
  Backend* be = nullptr;
  Tensor t;
  DType dtype = DType::f32;
  int64_t n = 0;
  DevBuf(Backend& b, int64_t n_, DType dt) : be(&b), dtype(dt), n(n_) {
    t = b.empty({std::max<int64_t>(n_, 1)}, dt, MemTag::workspace);
  }
  DevBuf(Backend& b, const std::vector<float>& v, DType dt) : DevBuf(b, int64_t(v.size()), dt) { set(v); }
  void set(const std::vector<float>& v) { be->upload(t.raw(), dtype, v.data(), int64_t(v.size())); }
  void poison() { set(std::vector<float>(static_cast<size_t>(n), std::numeric_limits<float>::quiet_NaN())); }
  std::vector<float> get() const {
    std::vector<float> v(static_cast<size_t>(n));
    be->download(v.data(), t.raw(), dtype, n);
    return v;
  }
  void* p() const { return t.raw(); }
  template <class T>
  T* as() const {
    return static_cast<T*>(t.raw());
  }
};

// One instance of the suite: a device and the compute dtype its backend is made with (the CPU
// computes in f32 whatever BackendOptions::compute says).
struct ParityCase {
  Device device = Device::cpu;
  DType compute = DType::bf16;
};

inline std::string parity_case_name(const ::testing::TestParamInfo<ParityCase>& info) {
  return std::string(device_name(info.param.device)) + "_" + std::string(dtype_name(info.param.compute));
}

class BackendParity : public ::testing::TestWithParam<ParityCase> {
 protected:
  void SetUp() override {
    std::string why;
    if (!backend_available(GetParam().device, &why))
      GTEST_SKIP() << device_name(GetParam().device) << " backend: " << why;
    be_ = make_backend(GetParam().device, {.compute = GetParam().compute});
    dt_ = be_->compute_dtype();
    half_ = dt_ == DType::bf16 || dt_ == DType::f16;
  }
  Backend& be() { return *be_; }
  double tol_out() const { return half_ ? 1e-2 : 1e-5; }
  double tol_f32() const { return half_ ? 1e-3 : 1e-5; }
  std::unique_ptr<Backend> be_;
  DType dt_ = DType::f32;
  bool half_ = false;  // a 16-bit compute dtype (bf16 or f16)
};

inline std::vector<double> linear_ref(const std::vector<float>& x, const std::vector<float>& w, const float* bias,
                                      int64_t M, int64_t K, int64_t N) {
  std::vector<double> o(static_cast<size_t>(M * N));
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      double s = bias ? bias[j] : 0.0;
      for (int64_t k = 0; k < K; ++k) s += double(x[size_t(i * K + k)]) * w[size_t(j * K + k)];
      o[size_t(i * N + j)] = s;
    }
  return o;
}

TEST_P(BackendParity, LinearForward) {
  const int64_t M = 48, K = 64, N = 40;
  auto x = bf16_random(M * K, 1), w = bf16_random(N * K, 2, 0.2f), b = bf16_random(N, 3, 0.5f);
  DevBuf dx(be(), x, dt_), dw(be(), w, dt_), db(be(), b, dt_), out(be(), M * N, dt_), pre(be(), M * N, dt_);
  const auto ref = linear_ref(x, w, b.data(), M, K, N);
  for (bool with_bias : {true, false}) {
    out.poison();
    be().linear_forward({.dtype = dt_, .out = out.p(), .inp = dx.p(), .weight = dw.p(),
                         .bias = with_bias ? db.p() : nullptr, .M = M, .K = K, .N = N});
    auto r = with_bias ? ref : linear_ref(x, w, nullptr, M, K, N);
    EXPECT_LE(rel_norm_err(out.get(), r), tol_out()) << "bias " << with_bias;
  }
  out.poison();
  pre.poison();
  be().linear_forward({.dtype = dt_, .out = out.p(), .pre_gelu = pre.p(), .inp = dx.p(), .weight = dw.p(),
                       .bias = db.p(), .M = M, .K = K, .N = N, .gelu = true});
  std::vector<double> g(ref.size());
  for (size_t i = 0; i < g.size(); ++i) g[i] = gelu_d(ref[i]);
  EXPECT_LE(rel_norm_err(pre.get(), ref), tol_out()) << "pre_gelu";
  EXPECT_LE(rel_norm_err(out.get(), g), tol_out()) << "gelu output";
}

TEST_P(BackendParity, LinearBackward) {
  const int64_t M = 64, K = 48, N = 32;
  auto x = bf16_random(M * K, 4), w = bf16_random(N * K, 5, 0.2f), dy = bf16_random(M * N, 6);
  auto pre = bf16_random(M * K, 7, 2.f), dw0 = bf16_random(N * K, 8), db0 = bf16_random(N, 9), dx0 = bf16_random(M * K, 10);
  DevBuf dx(be(), x, dt_), dw(be(), w, dt_), ddy(be(), dy, dt_), dpre(be(), pre, dt_);
  DevBuf din(be(), M * K, dt_), gw(be(), dw0, DType::f32), gb(be(), db0, DType::f32);
  // references: dinp = dy @ W; dW = dw0 + dy^T x; db = db0 + colsum(dy)
  std::vector<double> rdin(static_cast<size_t>(M * K)), rdw(static_cast<size_t>(N * K)), rdb(static_cast<size_t>(N));
  for (int64_t i = 0; i < M; ++i)
    for (int64_t k = 0; k < K; ++k) {
      double s = 0;
      for (int64_t j = 0; j < N; ++j) s += double(dy[size_t(i * N + j)]) * w[size_t(j * K + k)];
      rdin[size_t(i * K + k)] = s;
    }
  for (int64_t j = 0; j < N; ++j) {
    double sb = db0[size_t(j)];
    for (int64_t i = 0; i < M; ++i) sb += dy[size_t(i * N + j)];
    rdb[size_t(j)] = sb;
    for (int64_t k = 0; k < K; ++k) {
      double s = dw0[size_t(j * K + k)];
      for (int64_t i = 0; i < M; ++i) s += double(dy[size_t(i * N + j)]) * x[size_t(i * K + k)];
      rdw[size_t(j * K + k)] = s;
    }
  }
  din.poison();
  be().linear_backward({.dtype = dt_, .dinp = din.p(), .dweight = gw.as<float>(), .dbias = gb.as<float>(),
                        .dout = ddy.p(), .inp = dx.p(), .weight = dw.p(), .M = M, .K = K, .N = N});
  EXPECT_LE(rel_norm_err(din.get(), rdin), tol_out()) << "dinp";
  EXPECT_LE(rel_norm_err(gw.get(), rdw), tol_f32()) << "dweight";
  EXPECT_LE(rel_norm_err(gb.get(), rdb), tol_f32()) << "dbias";

  // dinp accumulated onto dx0, and through the GELU that made inp from pre.
  din.set(dx0);
  be().linear_backward({.dtype = dt_, .dinp = din.p(), .accumulate_dinp = true, .dout = ddy.p(), .weight = dw.p(),
                        .M = M, .K = K, .N = N});
  std::vector<double> acc(rdin.size()), through(rdin.size());
  for (size_t i = 0; i < acc.size(); ++i) {
    acc[i] = rdin[i] + dx0[i];
    through[i] = rdin[i] * gelu_grad_d(pre[i]);
  }
  EXPECT_LE(rel_norm_err(din.get(), acc), tol_out()) << "accumulated dinp";
  din.poison();
  be().linear_backward({.dtype = dt_, .dinp = din.p(), .dout = ddy.p(), .weight = dw.p(), .gelu_pre = dpre.p(),
                        .M = M, .K = K, .N = N});
  EXPECT_LE(rel_norm_err(din.get(), through), tol_out()) << "dinp through the GELU";
}

TEST_P(BackendParity, LayerNormWithResidual) {
  const int64_t N = 37, C = 64;
  auto a = bf16_random(N * C, 11, 2.f), b = bf16_random(N * C, 12), w = bf16_random(C, 13), bias = bf16_random(C, 14);
  auto dy = bf16_random(N * C, 15), dx0 = bf16_random(N * C, 16);
  DevBuf da(be(), a, dt_), dbb(be(), b, dt_), dw(be(), w, dt_), dbias(be(), bias, dt_), out(be(), N * C, dt_),
      res(be(), N * C, dt_), mean(be(), N, DType::f32), rstd(be(), N, DType::f32), ddy(be(), dy, dt_),
      din(be(), dx0, dt_), gw(be(), C, DType::f32), gb(be(), C, DType::f32);
  gw.set(std::vector<float>(static_cast<size_t>(C), 0.f));
  gb.set(std::vector<float>(static_cast<size_t>(C), 0.f));
  for (bool residual : {false, true}) {
    out.poison();
    res.poison();
    mean.poison();
    rstd.poison();
    be().layernorm_forward({.dtype = dt_, .out = out.p(), .mean = mean.as<float>(), .rstd = rstd.as<float>(),
                            .inp = da.p(), .residual_b = residual ? dbb.p() : nullptr,
                            .residual_out = residual ? res.p() : nullptr, .weight = dw.p(), .bias = dbias.p(), .N = N,
                            .C = C});
    // The reference normalises the residual sum as the backend stored it (rounded to its dtype).
    std::vector<float> xin = a;
    if (residual) {
      std::vector<double> rs(static_cast<size_t>(N * C));
      for (size_t i = 0; i < rs.size(); ++i) rs[i] = double(a[i]) + b[i];
      auto got = res.get();
      EXPECT_LE(rel_norm_err(got, rs), tol_out()) << "residual sum";
      xin = got;
    }
    std::vector<double> ro(static_cast<size_t>(N * C)), rm(static_cast<size_t>(N)), rr(static_cast<size_t>(N));
    for (int64_t i = 0; i < N; ++i) {
      double m = 0, v = 0;
      for (int64_t c = 0; c < C; ++c) m += xin[size_t(i * C + c)];
      m /= double(C);
      for (int64_t c = 0; c < C; ++c) v += (xin[size_t(i * C + c)] - m) * (xin[size_t(i * C + c)] - m);
      const double r = 1.0 / std::sqrt(v / double(C) + 1e-5);
      rm[size_t(i)] = m;
      rr[size_t(i)] = r;
      for (int64_t c = 0; c < C; ++c) ro[size_t(i * C + c)] = (xin[size_t(i * C + c)] - m) * r * w[size_t(c)] + bias[size_t(c)];
    }
    EXPECT_LE(rel_norm_err(out.get(), ro), tol_out()) << "out, residual " << residual;
    EXPECT_LE(rel_norm_err(mean.get(), rm), tol_f32()) << "mean, residual " << residual;
    EXPECT_LE(rel_norm_err(rstd.get(), rr), tol_f32()) << "rstd, residual " << residual;
    if (!residual) continue;
    // Backward on the residual sum, accumulating into din (= dx0 on entry).
    be().layernorm_backward({.dtype = dt_, .dinp = din.p(), .accumulate = true, .dweight = gw.as<float>(),
                             .dbias = gb.as<float>(), .dout = ddy.p(), .inp = res.p(), .weight = dw.p(),
                             .mean = mean.as<float>(), .rstd = rstd.as<float>(), .N = N, .C = C});
    std::vector<double> rdx(static_cast<size_t>(N * C)), rgw(static_cast<size_t>(C), 0.0), rgb(static_cast<size_t>(C), 0.0);
    for (int64_t i = 0; i < N; ++i) {
      double s1 = 0, s2 = 0;
      for (int64_t c = 0; c < C; ++c) {
        const double xh = (xin[size_t(i * C + c)] - rm[size_t(i)]) * rr[size_t(i)], g = dy[size_t(i * C + c)];
        s1 += g * w[size_t(c)];
        s2 += g * w[size_t(c)] * xh;
        rgw[size_t(c)] += g * xh;
        rgb[size_t(c)] += g;
      }
      for (int64_t c = 0; c < C; ++c) {
        const double xh = (xin[size_t(i * C + c)] - rm[size_t(i)]) * rr[size_t(i)];
        rdx[size_t(i * C + c)] =
            dx0[size_t(i * C + c)] + rr[size_t(i)] * (dy[size_t(i * C + c)] * w[size_t(c)] - s1 / double(C) - xh * s2 / double(C));
      }
    }
    EXPECT_LE(rel_norm_err(din.get(), rdx), tol_out()) << "dinp (accumulated)";
    EXPECT_LE(rel_norm_err(gw.get(), rgw), tol_f32()) << "dweight";
    EXPECT_LE(rel_norm_err(gb.get(), rgb), tol_f32()) << "dbias";
  }
}

// The Llama family's ops: RMSNorm on a residual sum (forward, backward accumulating), rotary
// embeddings on the K columns of a packed qkv buffer and back, SwiGLU forward and backward. A
// backend without them must refuse each by name.
TEST_P(BackendParity, LlamaOps) {
  const int64_t N = 37, C0 = 64, H = 40;
  if (!be().supports(Op::rmsnorm, dt_)) {
    for (Op op : {Op::rope, Op::swiglu}) EXPECT_FALSE(be().supports(op, dt_)) << op_name(op);
    DevBuf x(be(), N * C0, dt_), w(be(), C0, dt_);
    try {
      be().layernorm_forward({.dtype = dt_, .out = x.p(), .inp = x.p(), .weight = w.p(), .N = N, .C = C0, .rms = true});
      ADD_FAILURE() << "rmsnorm ran on a backend that says it does not support it";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("rmsnorm"), std::string::npos) << e.what();
    }
    EXPECT_THROW(be().swiglu_forward(dt_, x.p(), x.p(), 2, 4), Error);
    return;
  }
  // RMSNorm of a + b, at two widths (64, and SmolLM-135M's 576: a CUDA lane's third chunk of the
  // row part-filled).
  for (const int64_t C : {C0, int64_t(576)}) {
    SCOPED_TRACE("rmsnorm C = " + std::to_string(C));
    auto a = bf16_random(N * C, 21, 2.f), b = bf16_random(N * C, 22), w = bf16_random(C, 23), dy = bf16_random(N * C, 24);
    auto dx0 = bf16_random(N * C, 25);
    DevBuf da(be(), a, dt_), dbb(be(), b, dt_), dw(be(), w, dt_), out(be(), N * C, dt_), res(be(), N * C, dt_),
        rstd(be(), N, DType::f32), ddy(be(), dy, dt_), din(be(), dx0, dt_), gw(be(), C, DType::f32);
    gw.set(std::vector<float>(static_cast<size_t>(C), 0.f));
    out.poison();
    rstd.poison();
    be().layernorm_forward({.dtype = dt_, .out = out.p(), .rstd = rstd.as<float>(), .inp = da.p(), .residual_b = dbb.p(),
                            .residual_out = res.p(), .weight = dw.p(), .N = N, .C = C, .rms = true});
    const std::vector<float> xin = res.get();
    std::vector<double> ro(static_cast<size_t>(N * C)), rr(static_cast<size_t>(N)), rdx(static_cast<size_t>(N * C));
    std::vector<double> rgw(static_cast<size_t>(C), 0.0);
    for (int64_t i = 0; i < N; ++i) {
      double q = 0;
      for (int64_t c = 0; c < C; ++c) q += double(xin[size_t(i * C + c)]) * xin[size_t(i * C + c)];
      const double r = 1.0 / std::sqrt(q / double(C) + 1e-5);
      rr[size_t(i)] = r;
      double s = 0;
      for (int64_t c = 0; c < C; ++c) {
        const double xh = xin[size_t(i * C + c)] * r, g = dy[size_t(i * C + c)];
        ro[size_t(i * C + c)] = xh * w[size_t(c)];
        s += g * w[size_t(c)] * xh;
        rgw[size_t(c)] += g * xh;
      }
      for (int64_t c = 0; c < C; ++c)
        rdx[size_t(i * C + c)] = dx0[size_t(i * C + c)] +
                                 r * (dy[size_t(i * C + c)] * w[size_t(c)] - xin[size_t(i * C + c)] * r * s / double(C));
    }
    EXPECT_LE(rel_norm_err(out.get(), ro), tol_out()) << "rmsnorm out";
    EXPECT_LE(rel_norm_err(rstd.get(), rr), tol_f32()) << "rmsnorm rstd";
    be().layernorm_backward({.dtype = dt_, .dinp = din.p(), .accumulate = true, .dweight = gw.as<float>(), .dout = ddy.p(),
                             .inp = res.p(), .weight = dw.p(), .rstd = rstd.as<float>(), .N = N, .C = C, .rms = true});
    EXPECT_LE(rel_norm_err(din.get(), rdx), tol_out()) << "rmsnorm dinp (accumulated)";
    EXPECT_LE(rel_norm_err(gw.get(), rgw), tol_f32()) << "rmsnorm dweight";
    EXPECT_THROW(be().layernorm_forward({.dtype = dt_, .out = out.p(), .inp = da.p(), .weight = dw.p(), .bias = dw.p(),
                                         .N = N, .C = C, .rms = true}),
                 Error);

  }

  // Rotary embeddings on the K columns of qkv [B, T, 3 NH HS] at positions 7, 8, ..., at head sizes
  // 16 and 24 (the CUDA backend's 8-pair vector path and its element path).
  for (const int64_t HS : {int64_t(16), int64_t(24)}) {
    SCOPED_TRACE("rope HS = " + std::to_string(HS));
    const int64_t B = 2, T = 5, NH = 2, Cq = NH * HS;
    const std::vector<double> inv = rope_inv_freq(HS, 10000.0);
    auto qkv = bf16_random(B * T * 3 * Cq, 26);
    DevBuf dq(be(), qkv, dt_);
    be().rope({.dtype = dt_, .x = static_cast<char*>(dq.p()) + Cq * dtype_size(dt_), .B = B, .T = T, .NH = NH, .HS = HS,
               .stride = 3 * Cq, .pos0 = 7, .inv_freq = inv.data()});
    std::vector<double> want(qkv.begin(), qkv.end());
    for (int64_t r = 0; r < B * T; ++r)
      for (int64_t h = 0; h < NH; ++h)
        for (int64_t i = 0; i < HS / 2; ++i) {
          const double ang = double(7 + r % T) * inv[size_t(i)];
          const size_t lo = size_t(r * 3 * Cq + Cq + h * HS + i), hi = lo + size_t(HS / 2);
          want[lo] = qkv[lo] * std::cos(ang) - qkv[hi] * std::sin(ang);
          want[hi] = qkv[hi] * std::cos(ang) + qkv[lo] * std::sin(ang);
        }
    EXPECT_LE(rel_norm_err(dq.get(), want), tol_out()) << "rope";
    be().rope({.dtype = dt_, .x = static_cast<char*>(dq.p()) + Cq * dtype_size(dt_), .B = B, .T = T, .NH = NH, .HS = HS,
               .stride = 3 * Cq, .pos0 = 7, .inv_freq = inv.data(), .inverse = true});
    EXPECT_LE(rel_norm_err(dq.get(), std::vector<double>(qkv.begin(), qkv.end())), tol_out()) << "rope and back";
  }

  // SwiGLU, at a width of whole 8-element vectors (H) and one that is not (12: the CUDA
  // backend's element-wise path).
  for (const int64_t Hs : {H, int64_t(12)}) {
    auto gu = bf16_random(N * 2 * Hs, 27, 3.f), gy = bf16_random(N * Hs, 28);
    DevBuf dgu(be(), gu, dt_), dout(be(), N * Hs, dt_), dgy(be(), gy, dt_), dgin(be(), N * 2 * Hs, dt_);
    dout.poison();
    dgin.poison();
    be().swiglu_forward(dt_, dout.p(), dgu.p(), N, Hs);
    be().swiglu_backward(dt_, dgin.p(), dgy.p(), dgu.p(), N, Hs);
    std::vector<double> so(static_cast<size_t>(N * Hs)), sd(static_cast<size_t>(N * 2 * Hs));
    for (int64_t n = 0; n < N; ++n)
      for (int64_t j = 0; j < Hs; ++j) {
        const double g = gu[size_t(n * 2 * Hs + j)], u = gu[size_t(n * 2 * Hs + Hs + j)], d = gy[size_t(n * Hs + j)];
        const double sg = 1 / (1 + std::exp(-g));
        so[size_t(n * Hs + j)] = g * sg * u;
        sd[size_t(n * 2 * Hs + j)] = d * u * sg * (1 + g * (1 - sg));
        sd[size_t(n * 2 * Hs + Hs + j)] = d * g * sg;
      }
    EXPECT_LE(rel_norm_err(dout.get(), so), tol_out()) << "swiglu out, H = " << Hs;
    EXPECT_LE(rel_norm_err(dgin.get(), sd), tol_out()) << "swiglu dinp, H = " << Hs;
  }
}

// Packed causal self-attention (qkv [B, T, 3C]) with head size 64, the size every CUDA kernel
// takes, at an odd length: on the CUDA backend through each of its kernels (flash, the GEMM
// kernels, and cuDNN's where loom has it), in the suite's compute dtype.
inline void check_attention(Backend& be, DType dt_, double tol_out, double tol_f32) {
  const int64_t B = 2, NH = 2, HS = 64, T = 37, C = NH * HS;
  auto qkv = bf16_random(B * T * 3 * C, 17), dy = bf16_random(B * T * C, 18);
  AttnShape s{.B = B, .NH = NH, .HS = HS, .Tq = T, .Tkv = T, .q_stride = 3 * C, .kv_stride = 3 * C, .o_stride = C};
  be.prepare_attention(dt_, s);
  const int64_t probs_bytes = be.attention_probs_bytes(dt_, s);
  DevBuf dqkv(be, qkv, dt_), out(be, B * T * C, dt_), lse(be, B * NH * T, DType::f32), ddy(be, dy, dt_),
      grad(be, B * T * 3 * C, dt_);
  Tensor probs = probs_bytes ? be.empty({probs_bytes / 2}, DType::u16, MemTag::workspace) : Tensor();
  out.poison();
  lse.poison();
  grad.poison();
  const char* q = static_cast<const char*>(dqkv.p());
  const size_t es = dtype_size(dt_);
  be.attention_forward({.dtype = dt_, .shape = s, .out = out.p(), .lse = lse.as<float>(),
                          .probs = probs.defined() ? probs.raw() : nullptr, .q = q, .k = q + C * es, .v = q + 2 * C * es});
  char* g = static_cast<char*>(grad.p());
  be.attention_backward({.dtype = dt_, .shape = s, .dq = g, .dk = g + C * es, .dv = g + 2 * C * es, .dout = ddy.p(),
                           .q = q, .k = q + C * es, .v = q + 2 * C * es, .out = out.p(), .lse = lse.as<float>(),
                           .probs = probs.defined() ? probs.raw() : nullptr});
  // Reference in double.
  std::vector<double> ro(static_cast<size_t>(B * T * C)), rl(static_cast<size_t>(B * NH * T)), rg(static_cast<size_t>(B * T * 3 * C), 0.0);
  const double scale = 1.0 / std::sqrt(double(HS));
  auto at = [&](int64_t b, int64_t t, int64_t part, int64_t h, int64_t d) {
    return size_t((b * T + t) * 3 * C + part * C + h * HS + d);
  };
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < NH; ++h)
      for (int64_t t = 0; t < T; ++t) {
        std::vector<double> p(static_cast<size_t>(t + 1));
        double mx = -1e300;
        for (int64_t u = 0; u <= t; ++u) {
          double sc = 0;
          for (int64_t d = 0; d < HS; ++d) sc += double(qkv[at(b, t, 0, h, d)]) * qkv[at(b, u, 1, h, d)];
          p[size_t(u)] = sc * scale;
          mx = std::max(mx, p[size_t(u)]);
        }
        double z = 0;
        for (auto& v : p) z += (v = std::exp(v - mx));
        rl[size_t((b * NH + h) * T + t)] = mx + std::log(z);
        for (auto& v : p) v /= z;
        std::vector<double> dp(static_cast<size_t>(t + 1));
        double dsum = 0;
        for (int64_t u = 0; u <= t; ++u) {
          double dpu = 0;
          for (int64_t d = 0; d < HS; ++d) {
            const double vv = qkv[at(b, u, 2, h, d)];
            ro[size_t((b * T + t) * C + h * HS + d)] += p[size_t(u)] * vv;
            dpu += double(dy[size_t((b * T + t) * C + h * HS + d)]) * vv;
            rg[at(b, u, 2, h, d)] += p[size_t(u)] * dy[size_t((b * T + t) * C + h * HS + d)];
          }
          dp[size_t(u)] = dpu;
          dsum += p[size_t(u)] * dpu;
        }
        for (int64_t u = 0; u <= t; ++u) {
          const double ds = p[size_t(u)] * (dp[size_t(u)] - dsum) * scale;
          for (int64_t d = 0; d < HS; ++d) {
            rg[at(b, t, 0, h, d)] += ds * qkv[at(b, u, 1, h, d)];
            rg[at(b, u, 1, h, d)] += ds * qkv[at(b, t, 0, h, d)];
          }
        }
      }
  EXPECT_LE(rel_norm_err(out.get(), ro), tol_out) << "out (" << attn_kernel_name(be.attention_kernel(s)) << ")";
  if (!probs.defined()) {
    EXPECT_LE(rel_norm_err(lse.get(), rl), tol_f32) << "lse";
  }
  EXPECT_LE(rel_norm_err(grad.get(), rg), tol_out) << "dq, dk, dv (" << attn_kernel_name(be.attention_kernel(s)) << ")";
}

TEST_P(BackendParity, Attention) {
  if (GetParam().device != Device::cuda) {
    check_attention(be(), dt_, tol_out(), tol_f32());
    return;
  }
  for (AttnKernel k : {AttnKernel::flash, AttnKernel::gemm, AttnKernel::cudnn}) {
    SCOPED_TRACE(attn_kernel_name(k));
    auto inst = make_backend(GetParam().device, {.attention = k, .compute = GetParam().compute});
    if (k == AttnKernel::cudnn) {
      try {
        inst->prepare_attention(dt_, {.B = 2, .NH = 2, .HS = 64, .Tq = 37, .Tkv = 37, .q_stride = 384,
                                      .kv_stride = 384, .o_stride = 128});
      } catch (const Error& e) {
        // Only a build without cuDNN, or a cuDNN older than the graphs need, skips it.
        const std::string w = e.what();
        if (w.find("built without cuDNN") == std::string::npos && w.find("needs cuDNN 9.16") == std::string::npos)
          ADD_FAILURE() << "cuDNN attention could not be planned: " << w;
        else
          std::printf("cuDNN attention not checked: %s\n", w.c_str());
        continue;
      }
    }
    check_attention(*inst, dt_, tol_out(), tol_f32());
  }
}

// The fused loss in double: losses [N] and dloss * (softmax - onehot) [N, Vp] over the first V of
// Vp columns (0 elsewhere and in rows with target -1).
inline void crossentropy_ref(const std::vector<float>& logits, const std::vector<int32_t>& tg, int64_t N, int64_t V,
                             int64_t Vp, float dloss, std::vector<double>& rl, std::vector<double>& rg) {
  rl.assign(static_cast<size_t>(N), 0.0);
  rg.assign(static_cast<size_t>(N * Vp), 0.0);
  for (int64_t i = 0; i < N; ++i) {
    if (tg[size_t(i)] < 0) continue;
    double mx = -1e300, z = 0;
    for (int64_t v = 0; v < V; ++v) mx = std::max(mx, double(logits[size_t(i * Vp + v)]));
    for (int64_t v = 0; v < V; ++v) z += std::exp(logits[size_t(i * Vp + v)] - mx);
    rl[size_t(i)] = mx + std::log(z) - logits[size_t(i * Vp + tg[size_t(i)])];
    for (int64_t v = 0; v < V; ++v)
      rg[size_t(i * Vp + v)] = dloss * (std::exp(logits[size_t(i * Vp + v)] - mx) / z - (v == tg[size_t(i)] ? 1.0 : 0.0));
  }
}

TEST_P(BackendParity, CrossEntropy) {
  const int64_t N = 21, V = 1000, Vp = 1024;
  auto logits = bf16_random(N * Vp, 19, 4.f);
  std::vector<int32_t> tg(static_cast<size_t>(N));
  for (int64_t i = 0; i < N; ++i) tg[size_t(i)] = int32_t((i * 397) % V);
  tg[3] = -1;  // ignored
  std::vector<float> tgf(tg.begin(), tg.end());
  DevBuf dl(be(), logits, dt_), loss(be(), N, DType::f32), grad(be(), N * Vp, dt_);
  Tensor targets = be().empty({N}, DType::i32, MemTag::workspace);
  be().copy({.dst = targets.raw(), .dst_dtype = DType::i32, .src = tg.data(), .src_dtype = DType::i32, .src_host = true, .n = N});
  const float dloss = 1.f / float(N - 1);
  std::vector<double> rl, rg;
  crossentropy_ref(logits, tg, N, V, Vp, dloss, rl, rg);
  loss.poison();
  be().crossentropy({.dtype = dt_, .losses = loss.as<float>(), .logits = dl.p(), .targets = targets.i32(), .N = N,
                     .V = V, .Vp = Vp});
  EXPECT_LE(rel_norm_err(loss.get(), rl), tol_f32()) << "losses";
  loss.poison();
  grad.poison();
  be().crossentropy({.dtype = dt_, .losses = loss.as<float>(), .dlogits = grad.p(), .logits = dl.p(),
                     .targets = targets.i32(), .dloss = dloss, .N = N, .V = V, .Vp = Vp});
  EXPECT_LE(rel_norm_err(loss.get(), rl), tol_f32()) << "losses with dlogits";
  const auto got = grad.get();
  EXPECT_LE(rel_norm_err(got, rg), tol_out()) << "dlogits";
  for (int64_t v = 0; v < Vp; ++v) EXPECT_EQ(got[size_t(3 * Vp + v)], 0.f) << "ignored row, column " << v;
  for (int64_t v = V; v < Vp; ++v) EXPECT_EQ(got[size_t(v)], 0.f) << "padding column " << v;
}

// The operands the contracts let alias (core/backend.h): an op computing in place gives what it
// gives into a buffer of its own, bit for bit (the same arithmetic on the same values; the model
// relies on each of these).
TEST_P(BackendParity, AliasedOperandsGiveTheSameValues) {
  const int64_t N = 21, H = 48, n = N * 2 * H;
  const auto x = bf16_random(n, 81), g = bf16_random(n, 82), h = bf16_random(N * H, 83);
  {  // gelu forward in place; gelu backward into dout
    DevBuf a(be(), x, dt_), out(be(), n, dt_), dout(be(), g, dt_), din(be(), n, dt_);
    be().gelu_backward(dt_, din.p(), a.p(), dout.p(), n);
    be().gelu_backward(dt_, dout.p(), a.p(), dout.p(), n);
    EXPECT_EQ(dout.get(), din.get()) << "gelu_backward into dout";
    be().gelu_forward(dt_, out.p(), a.p(), n);
    be().gelu_forward(dt_, a.p(), a.p(), n);
    EXPECT_EQ(a.get(), out.get()) << "gelu_forward in place";
  }
  {  // swiglu backward into its input
    DevBuf inp(be(), x, dt_), dout(be(), h, dt_), din(be(), n, dt_);
    be().swiglu_backward(dt_, din.p(), dout.p(), inp.p(), N, H);
    be().swiglu_backward(dt_, inp.p(), dout.p(), inp.p(), N, H);
    EXPECT_EQ(inp.get(), din.get()) << "swiglu_backward into inp";
  }
  {  // add into either input
    DevBuf a(be(), x, dt_), b(be(), g, dt_), sum(be(), n, dt_);
    be().add(dt_, sum.p(), a.p(), b.p(), n);
    be().add(dt_, a.p(), a.p(), b.p(), n);
    EXPECT_EQ(a.get(), sum.get()) << "add into a";
    a.set(x);
    be().add(dt_, b.p(), a.p(), b.p(), n);
    EXPECT_EQ(b.get(), sum.get()) << "add into b";
  }
  {  // the residual sum of a LayerNorm into its input
    const int64_t C = 2 * H;
    DevBuf a(be(), x, dt_), r(be(), g, dt_), w(be(), bf16_random(C, 84), dt_), bias(be(), bf16_random(C, 85), dt_),
        out1(be(), n, dt_), out2(be(), n, dt_), res(be(), n, dt_), mean(be(), N, DType::f32), rstd(be(), N, DType::f32);
    be().layernorm_forward({.dtype = dt_, .out = out1.p(), .mean = mean.as<float>(), .rstd = rstd.as<float>(),
                            .inp = a.p(), .residual_b = r.p(), .residual_out = res.p(), .weight = w.p(),
                            .bias = bias.p(), .N = N, .C = C});
    be().layernorm_forward({.dtype = dt_, .out = out2.p(), .mean = mean.as<float>(), .rstd = rstd.as<float>(),
                            .inp = a.p(), .residual_b = r.p(), .residual_out = a.p(), .weight = w.p(),
                            .bias = bias.p(), .N = N, .C = C});
    EXPECT_EQ(a.get(), res.get()) << "residual sum into inp";
    EXPECT_EQ(out2.get(), out1.get()) << "layernorm of the residual sum written into inp";
  }
  {  // the loss's gradient into the logits
    const int64_t V = 1000, Vp = 1024;
    const auto logits = bf16_random(N * Vp, 86, 4.f);
    std::vector<int32_t> tg(static_cast<size_t>(N));
    for (int64_t i = 0; i < N; ++i) tg[size_t(i)] = int32_t((i * 397) % V);
    DevBuf dl(be(), logits, dt_), grad(be(), N * Vp, dt_), l1(be(), N, DType::f32), l2(be(), N, DType::f32);
    Tensor targets = be().empty({N}, DType::i32, MemTag::workspace);
    be().copy({.dst = targets.raw(), .dst_dtype = DType::i32, .src = tg.data(), .src_dtype = DType::i32,
               .src_host = true, .n = N});
    be().crossentropy({.dtype = dt_, .losses = l1.as<float>(), .dlogits = grad.p(), .logits = dl.p(),
                       .targets = targets.i32(), .dloss = 0.05f, .N = N, .V = V, .Vp = Vp});
    be().crossentropy({.dtype = dt_, .losses = l2.as<float>(), .dlogits = dl.p(), .logits = dl.p(),
                       .targets = targets.i32(), .dloss = 0.05f, .N = N, .V = V, .Vp = Vp});
    EXPECT_EQ(dl.get(), grad.get()) << "dlogits into logits";
    EXPECT_EQ(l2.get(), l1.get()) << "losses with dlogits into logits";
  }
}

// The vocabulary-parallel loss's passes over four shards of a padded vocabulary (the last holds
// padding only), the statistics reduced on the host between passes as the tp group would: the
// losses and each shard's dlogits against the whole-row reference.
TEST_P(BackendParity, VocabCrossEntropy) {
  const int64_t N = 13, V = 700, Vp = 1024, shards = 4, Vs = Vp / shards;
  auto logits = bf16_random(N * Vp, 31, 4.f);
  std::vector<int32_t> tg(static_cast<size_t>(N));
  for (int64_t i = 0; i < N; ++i) tg[size_t(i)] = int32_t((i * 211) % V);
  tg[5] = -1;  // ignored
  Tensor targets = be().empty({N}, DType::i32, MemTag::workspace);
  be().copy({.dst = targets.raw(), .dst_dtype = DType::i32, .src = tg.data(), .src_dtype = DType::i32, .src_host = true,
             .n = N});
  const float dloss = 1.f / float(N - 1);
  std::vector<double> rl, rg;
  crossentropy_ref(logits, tg, N, V, Vp, dloss, rl, rg);
  std::vector<std::unique_ptr<DevBuf>> part, stats, loss;
  for (int64_t s = 0; s < shards; ++s) {
    std::vector<float> mine(static_cast<size_t>(N * Vs));
    for (int64_t i = 0; i < N; ++i)
      for (int64_t v = 0; v < Vs; ++v) mine[size_t(i * Vs + v)] = logits[size_t(i * Vp + s * Vs + v)];
    part.push_back(std::make_unique<DevBuf>(be(), mine, dt_));
    stats.push_back(std::make_unique<DevBuf>(be(), 3 * N, DType::f32));
    loss.push_back(std::make_unique<DevBuf>(be(), N, DType::f32));
    stats.back()->poison();
    loss.back()->poison();
  }
  using Pass = VocabCrossEntropy::Pass;
  auto run = [&](Pass pass) {
    for (int64_t s = 0; s < shards; ++s)
      be().vocab_crossentropy({.pass = pass, .dtype = dt_, .losses = loss[size_t(s)]->as<float>(),
                               .dlogits = pass == Pass::finish ? part[size_t(s)]->p() : nullptr,
                               .logits = part[size_t(s)]->p(), .targets = targets.i32(),
                               .stats = stats[size_t(s)]->as<float>(), .dloss = dloss, .N = N, .Vs = Vs,
                               .v0 = s * Vs, .V = V});
  };
  // The group's reduction of stats[begin, end): max or sum over the shards, on every shard.
  auto reduce = [&](int64_t begin, int64_t end, bool max) {
    std::vector<std::vector<float>> got;
    for (auto& st : stats) got.push_back(st->get());
    std::vector<float> r = got[0];
    for (int64_t s = 1; s < shards; ++s)
      for (int64_t i = begin; i < end; ++i)
        r[size_t(i)] = max ? std::max(r[size_t(i)], got[size_t(s)][size_t(i)]) : r[size_t(i)] + got[size_t(s)][size_t(i)];
    for (int64_t s = 0; s < shards; ++s) {
      for (int64_t i = begin; i < end; ++i) got[size_t(s)][size_t(i)] = r[size_t(i)];
      stats[size_t(s)]->set(got[size_t(s)]);
    }
  };
  run(Pass::max);
  EXPECT_EQ(stats[3]->get()[0], -std::numeric_limits<float>::infinity()) << "a shard of padding only";
  reduce(0, N, true);
  run(Pass::sums);
  reduce(N, 3 * N, false);
  run(Pass::finish);
  std::vector<float> full(static_cast<size_t>(N * Vp));
  for (int64_t s = 0; s < shards; ++s) {
    EXPECT_LE(rel_norm_err(loss[size_t(s)]->get(), rl), tol_f32()) << "losses on shard " << s;
    const auto d = part[size_t(s)]->get();
    for (int64_t i = 0; i < N; ++i)
      for (int64_t v = 0; v < Vs; ++v) full[size_t(i * Vp + s * Vs + v)] = d[size_t(i * Vs + v)];
  }
  EXPECT_LE(rel_norm_err(full, rg), tol_out()) << "dlogits";
  for (int64_t v = 0; v < Vp; ++v) EXPECT_EQ(full[size_t(5 * Vp + v)], 0.f) << "ignored row, column " << v;
  for (int64_t v = V; v < Vp; ++v) EXPECT_EQ(full[size_t(v)], 0.f) << "padding column " << v;
}

// The embedding of one shard of the vocabulary's rows (tensor parallelism) at listed positions
// (context parallelism): other shards' tokens give zero rows and no gradient.
TEST_P(BackendParity, EmbeddingVocabularyShardAtPositions) {
  const int64_t B = 2, T = 8, C = 64, V = 50, maxT = 16, v0 = 20, Vs = 16;
  auto wte = bf16_random(Vs * C, 25), wpe = bf16_random(maxT * C, 26), dy = bf16_random(B * T * C, 27);
  std::vector<int32_t> tok(static_cast<size_t>(B * T)), pos{1, 2, 13, 14, 5, 6, 9, 10};
  for (size_t i = 0; i < tok.size(); ++i) tok[i] = int32_t((i * 13) % V);
  DevBuf dwte(be(), wte, dt_), dwpe(be(), wpe, dt_), out(be(), B * T * C, dt_), ddy(be(), dy, dt_),
      gte(be(), Vs * C, DType::f32), gpe(be(), maxT * C, DType::f32);
  Tensor tokens = be().empty({B * T}, DType::i32, MemTag::workspace);
  Tensor positions = be().empty({T}, DType::i32, MemTag::workspace);
  be().copy({.dst = tokens.raw(), .dst_dtype = DType::i32, .src = tok.data(), .src_dtype = DType::i32, .src_host = true,
             .n = B * T});
  be().copy({.dst = positions.raw(), .dst_dtype = DType::i32, .src = pos.data(), .src_dtype = DType::i32,
             .src_host = true, .n = T});
  gte.set(std::vector<float>(static_cast<size_t>(Vs * C), 0.f));
  gpe.set(std::vector<float>(static_cast<size_t>(maxT * C), 0.f));
  out.poison();
  be().embedding_forward({.dtype = dt_, .out = out.p(), .tokens = tokens.i32(), .wte = dwte.p(), .wpe = dwpe.p(),
                          .B = B, .T = T, .C = C, .V = V, .positions = positions.i32(), .vocab_begin = v0,
                          .vocab_rows = Vs});
  be().embedding_backward({.dtype = dt_, .dwte = gte.as<float>(), .dwpe = gpe.as<float>(), .dout = ddy.p(),
                           .tokens = tokens.i32(), .B = B, .T = T, .C = C, .V = V, .positions = positions.i32(),
                           .vocab_begin = v0, .vocab_rows = Vs});
  std::vector<double> ro(static_cast<size_t>(B * T * C)), rte(static_cast<size_t>(Vs * C), 0.0),
      rpe(static_cast<size_t>(maxT * C), 0.0);
  int64_t mine = 0;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      const int64_t row = tok[size_t(b * T + t)] - v0;
      const bool here = row >= 0 && row < Vs;
      mine += here;
      for (int64_t c = 0; c < C; ++c) {
        const size_t i = size_t((b * T + t) * C + c);
        const int64_t p = pos[size_t(t)];
        ro[i] = (here ? double(wte[size_t(row * C + c)]) : 0.0) + wpe[size_t(p * C + c)];
        if (here) rte[size_t(row * C + c)] += dy[i];
        rpe[size_t(p * C + c)] += dy[i];
      }
    }
  ASSERT_GT(mine, 0);
  ASSERT_LT(mine, B * T);  // both kinds of token
  EXPECT_LE(rel_norm_err(out.get(), ro), tol_out()) << "embedding out";
  EXPECT_LE(rel_norm_err(gte.get(), rte), tol_f32()) << "dwte shard";
  EXPECT_LE(rel_norm_err(gpe.get(), rpe), tol_f32()) << "dwpe";
}

TEST_P(BackendParity, EmbeddingGeluAdd) {
  const int64_t B = 2, T = 9, C = 64, V = 50, maxT = 16, pos0 = 3;
  auto wte = bf16_random(V * C, 20), wpe = bf16_random(maxT * C, 21), dy = bf16_random(B * T * C, 22);
  std::vector<int32_t> tok(static_cast<size_t>(B * T));
  for (size_t i = 0; i < tok.size(); ++i) tok[i] = int32_t((i * 7) % 5);  // repeated ids: scattered sums
  DevBuf dwte(be(), wte, dt_), dwpe(be(), wpe, dt_), out(be(), B * T * C, dt_), ddy(be(), dy, dt_),
      gte(be(), V * C, DType::f32), gpe(be(), maxT * C, DType::f32);
  Tensor tokens = be().empty({B * T}, DType::i32, MemTag::workspace);
  be().copy({.dst = tokens.raw(), .dst_dtype = DType::i32, .src = tok.data(), .src_dtype = DType::i32, .src_host = true,
             .n = B * T});
  gte.set(std::vector<float>(static_cast<size_t>(V * C), 0.f));
  gpe.set(std::vector<float>(static_cast<size_t>(maxT * C), 0.f));
  out.poison();
  be().embedding_forward({.dtype = dt_, .out = out.p(), .tokens = tokens.i32(), .wte = dwte.p(), .wpe = dwpe.p(),
                          .B = B, .T = T, .C = C, .V = V, .pos0 = pos0});
  be().embedding_backward({.dtype = dt_, .dwte = gte.as<float>(), .dwpe = gpe.as<float>(), .dout = ddy.p(),
                           .tokens = tokens.i32(), .B = B, .T = T, .C = C, .V = V, .pos0 = pos0});
  std::vector<double> ro(static_cast<size_t>(B * T * C)), rte(static_cast<size_t>(V * C), 0.0), rpe(static_cast<size_t>(maxT * C), 0.0);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t c = 0; c < C; ++c) {
        const size_t i = size_t((b * T + t) * C + c);
        const int64_t id = tok[size_t(b * T + t)];
        ro[i] = double(wte[size_t(id * C + c)]) + wpe[size_t((pos0 + t) * C + c)];
        rte[size_t(id * C + c)] += dy[i];
        rpe[size_t((pos0 + t) * C + c)] += dy[i];
      }
  EXPECT_LE(rel_norm_err(out.get(), ro), tol_out()) << "embedding out";
  EXPECT_LE(rel_norm_err(gte.get(), rte), tol_f32()) << "dwte";
  EXPECT_LE(rel_norm_err(gpe.get(), rpe), tol_f32()) << "dwpe";

  const int64_t n = 1003;  // not a multiple of 8: the tail too
  auto x = bf16_random(n, 23, 3.f), y = bf16_random(n, 24);
  DevBuf dx(be(), x, dt_), dyy(be(), y, dt_), o(be(), n, dt_);
  std::vector<double> rg(static_cast<size_t>(n)), rgb(static_cast<size_t>(n)), rs(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    rg[size_t(i)] = gelu_d(x[size_t(i)]);
    rgb[size_t(i)] = y[size_t(i)] * gelu_grad_d(x[size_t(i)]);
    rs[size_t(i)] = double(x[size_t(i)]) + y[size_t(i)];
  }
  o.poison();
  be().gelu_forward(dt_, o.p(), dx.p(), n);
  EXPECT_LE(rel_norm_err(o.get(), rg), tol_out()) << "gelu";
  o.poison();
  be().gelu_backward(dt_, o.p(), dx.p(), dyy.p(), n);
  EXPECT_LE(rel_norm_err(o.get(), rgb), tol_out()) << "gelu backward";
  o.poison();
  be().add(dt_, o.p(), dx.p(), dyy.p(), n);
  EXPECT_LE(rel_norm_err(o.get(), rs), tol_out()) << "add";
}

// Two tensors, clipping active, against PyTorch's AdamW written out in double; the compute copy
// (bf16 backends) is refreshed from the updated master weights.
TEST_P(BackendParity, AdamWPlan) {
  const int64_t n0 = 3000, n1 = 77;
  const std::vector<int64_t> ns{n0, n1};
  std::vector<std::vector<float>> p, g, m, v;
  for (int i = 0; i < 2; ++i) {
    p.push_back(bf16_random(ns[size_t(i)], uint32_t(30 + i)));
    g.push_back(bf16_random(ns[size_t(i)], uint32_t(40 + i), 2.f));
    m.push_back(bf16_random(ns[size_t(i)], uint32_t(50 + i), 0.1f));
    auto vv = bf16_random(ns[size_t(i)], uint32_t(60 + i), 0.01f);
    for (float& x : vv) x = std::fabs(x);
    v.push_back(vv);
  }
  std::vector<std::unique_ptr<DevBuf>> bufs;
  std::vector<AdamWTensor> ts;
  std::vector<DevBuf*> compute;
  for (int i = 0; i < 2; ++i) {
    auto mk = [&](const std::vector<float>& x, DType dt) {
      bufs.push_back(std::make_unique<DevBuf>(be(), x, dt));
      return bufs.back().get();
    };
    DevBuf *bp = mk(p[size_t(i)], DType::f32), *bg = mk(g[size_t(i)], DType::f32), *bm = mk(m[size_t(i)], DType::f32),
           *bv = mk(v[size_t(i)], DType::f32);
    DevBuf* bc = half_ ? mk(std::vector<float>(static_cast<size_t>(ns[size_t(i)]), std::nanf("")), dt_) : nullptr;
    compute.push_back(bc);
    ts.push_back({.param = bp->as<float>(), .compute = bc ? bc->p() : nullptr, .grad = bg->as<float>(),
                  .m = bm->as<float>(), .v = bv->as<float>(), .n = ns[size_t(i)], .weight_decay = i == 0 ? 0.1f : 0.f});
  }
  auto plan = be().plan_adamw(ts);
  const AdamWHyper h{.lr = 1e-2, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .step = 3, .max_norm = 1.f, .grad_scale = 0.5f};
  plan->step(h);
  double sq = 0;
  for (auto& gg : g)
    for (float x : gg) sq += double(x) * 0.5 * double(x) * 0.5;
  const double norm = std::sqrt(sq), clip = std::min(1.0, 1.0 / (norm + 1e-6));
  EXPECT_NEAR(plan->grad_norm(), norm, norm * tol_f32()) << "gradient norm";
  for (int i = 0; i < 2; ++i) {
    std::vector<double> rp(static_cast<size_t>(ns[size_t(i)]));
    const double wd = i == 0 ? 0.1 : 0.0, bc1 = 1 - std::pow(0.9, 3), bc2 = 1 - std::pow(0.95, 3);
    for (int64_t k = 0; k < ns[size_t(i)]; ++k) {
      const double gr = double(g[size_t(i)][size_t(k)]) * 0.5 * clip;
      const double mm = 0.9 * m[size_t(i)][size_t(k)] + 0.1 * gr, vv = 0.95 * v[size_t(i)][size_t(k)] + 0.05 * gr * gr;
      double pp = double(p[size_t(i)][size_t(k)]) * (1 - 1e-2 * wd);
      pp -= 1e-2 / bc1 * mm / (std::sqrt(vv) / std::sqrt(bc2) + 1e-8);
      rp[size_t(k)] = pp;
    }
    EXPECT_LE(rel_norm_err(bufs[size_t(i * (half_ ? 5 : 4))]->get(), rp), 1e-6) << "master weights of tensor " << i;
    if (compute[size_t(i)]) {
      EXPECT_LE(rel_norm_err(compute[size_t(i)]->get(), rp), 5e-3) << "compute copy of tensor " << i;
    }
  }
}

TEST_P(BackendParity, CopiesAndRefusals) {
  const int64_t n = 517;
  auto x = bf16_random(n, 70);
  DevBuf a(be(), x, DType::f32), b(be(), n, DType::bf16), c(be(), n, DType::f32);
  be().copy({.dst = b.p(), .dst_dtype = DType::bf16, .src = a.p(), .src_dtype = DType::f32, .n = n});
  be().copy({.dst = c.p(), .dst_dtype = DType::f32, .src = b.p(), .src_dtype = DType::bf16, .n = n});
  EXPECT_EQ(c.get(), x) << "f32 -> bf16 -> f32 of bf16 values is exact";
  if (dt_ == DType::f16) {  // f16 through the device's conversion kernels and the host's, both ways
    DevBuf h(be(), n, DType::f16), d(be(), n, DType::f32);
    be().copy({.dst = h.p(), .dst_dtype = DType::f16, .src = a.p(), .src_dtype = DType::f32, .n = n});
    be().copy({.dst = d.p(), .dst_dtype = DType::f32, .src = h.p(), .src_dtype = DType::f16, .n = n});
    EXPECT_LE(rel_norm_err(d.get(), std::vector<double>(x.begin(), x.end())), 1e-3) << "f32 -> f16 -> f32";
    EXPECT_LE(rel_norm_err(h.get(), std::vector<double>(x.begin(), x.end())), 1e-3) << "f16 downloaded as f32";
  }
  be().fill_zero(c.p(), n * 4);
  EXPECT_EQ(c.get(), std::vector<float>(static_cast<size_t>(n), 0.f));
  // An op in a dtype the backend does not compute in is refused, naming the op and the dtype.
  const DType other = half_ ? DType::f32 : DType::bf16;
  EXPECT_FALSE(be().supports(Op::linear, other));
  try {
    be().linear_forward({.dtype = other, .out = c.p(), .inp = a.p(), .weight = a.p(), .M = 1, .K = 8, .N = 8});
    ADD_FAILURE() << "linear in " << dtype_name(other) << " was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("linear"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(std::string(dtype_name(other))), std::string::npos) << e.what();
  }
}

// Device f32 added into host memory (an offloaded optimizer's gradient shard): exactly the sums,
// for a few elements and for more than two of a GPU's 8 MiB staging pieces (the last one short),
// and nothing for n = 0.
TEST_P(BackendParity, AddToHost) {
  for (const int64_t n : {int64_t(3), (int64_t(2) << 21) + 517}) {
    SCOPED_TRACE(n);
    const std::vector<float> x = bf16_random(n, 71), h0 = bf16_random(n, 72);
    DevBuf a(be(), x, DType::f32);
    std::vector<float> host = h0;
    be().add_to_host(host.data(), static_cast<const float*>(a.p()), n);
    int64_t wrong = 0;
    for (int64_t i = 0; i < n; ++i) wrong += host[size_t(i)] != h0[size_t(i)] + x[size_t(i)];
    EXPECT_EQ(wrong, 0);
    be().add_to_host(host.data(), static_cast<const float*>(a.p()), 0);
    EXPECT_EQ(host[0], h0[0] + x[0]);
  }
}

// Sums of squares of f32 ranges (the gradient norm's and the replicated copies' check), one per
// range in one call: each within 1e-12 of a double sum (f32 squares are exact in double; only the
// order of the double additions differs), the same bits from call to call, an empty range 0, a
// NaN reaching only its own range's sum. Ranges of one element, of an odd size and of more than
// one GPU block's share (16384 elements), one of them starting off a 16-byte boundary.
TEST_P(BackendParity, SumSquaresPerRange) {
  const int64_t n = 50000;
  const std::vector<float> x = bf16_random(n, 81, 3.f);
  DevBuf a(be(), x, DType::f32);
  const float* d = static_cast<const float*>(a.p());
  const std::vector<std::pair<int64_t, int64_t>> spans = {{0, 1}, {1, 1000}, {1001, 0}, {1001, 40001}, {41002, 7}};
  std::vector<Backend::Range> ranges;
  for (const auto& [b, m] : spans) ranges.push_back({d + b, m});
  std::vector<double> got(ranges.size(), -1.0), again(ranges.size(), -2.0);
  be().sum_squares(ranges, got.data());
  be().sum_squares(ranges, again.data());
  for (size_t i = 0; i < spans.size(); ++i) {
    double want = 0;
    for (int64_t k = 0; k < spans[i].second; ++k) want += double(x[size_t(spans[i].first + k)]) * x[size_t(spans[i].first + k)];
    EXPECT_NEAR(got[i], want, 1e-12 * want) << "range " << i;
    EXPECT_EQ(got[i], again[i]) << "range " << i;
  }
  EXPECT_EQ(got[2], 0.0);
  be().sum_squares({}, nullptr);  // no ranges: nothing written
  std::vector<float> bad = x;
  bad[1500] = std::numeric_limits<float>::quiet_NaN();
  a.set(bad);
  be().sum_squares(ranges, got.data());
  for (size_t i = 0; i < spans.size(); ++i) EXPECT_EQ(std::isnan(got[i]), i == 3) << "range " << i;
}

// Strided copies (ring attention's packing): a block of batches x rows x cols out of a padded
// tensor into a packed one of the compute dtype, back into a padded f32 one (elements outside the
// block keep their NaN), and added into f32 values.
TEST_P(BackendParity, StridedCopy) {
  const int64_t batches = 3, rows = 5, cols = 24, src_row = 40, src_batch = rows * src_row + 8;
  const int64_t dst_row = cols, dst_batch = rows * cols;
  const auto x = bf16_random(batches * src_batch, 71);
  DevBuf src(be(), x, DType::f32), packed(be(), batches * dst_batch, dt_), same(be(), batches * dst_batch, dt_);
  packed.poison();
  be().copy_strided({.dst = packed.p(), .dst_dtype = dt_, .src = static_cast<float*>(src.p()) + 4,
                     .src_dtype = DType::f32, .batches = batches, .rows = rows, .cols = cols, .dst_row = dst_row,
                     .dst_batch = dst_batch, .src_row = src_row, .src_batch = src_batch});
  std::vector<double> want(static_cast<size_t>(batches * dst_batch));
  for (int64_t b = 0; b < batches; ++b)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c)
        want[size_t(b * dst_batch + r * dst_row + c)] = x[size_t(4 + b * src_batch + r * src_row + c)];
  EXPECT_LE(rel_norm_err(packed.get(), want), tol_f32()) << "pack, converting into " << dtype_name(dt_);
  // The same dtype on both sides (a plain strided copy), packed -> packed.
  same.poison();
  be().copy_strided({.dst = same.p(), .dst_dtype = dt_, .src = packed.p(), .src_dtype = dt_, .batches = batches,
                     .rows = rows, .cols = cols, .dst_row = dst_row, .dst_batch = dst_batch, .src_row = dst_row,
                     .src_batch = dst_batch});
  EXPECT_EQ(same.get(), packed.get());
  // One row with the default (zero) strides: a plain copy.
  same.poison();
  be().copy_strided({.dst = same.p(), .dst_dtype = dt_, .src = packed.p(), .src_dtype = dt_,
                     .cols = batches * dst_batch});
  EXPECT_EQ(same.get(), packed.get());
  // Unpacked into a padded f32 tensor: the padding is not written.
  DevBuf back(be(), batches * src_batch, DType::f32);
  back.poison();
  be().copy_strided({.dst = static_cast<float*>(back.p()) + 4, .dst_dtype = DType::f32, .src = packed.p(),
                     .src_dtype = dt_, .batches = batches, .rows = rows, .cols = cols, .dst_row = src_row,
                     .dst_batch = src_batch, .src_row = dst_row, .src_batch = dst_batch});
  const std::vector<float> got = back.get(), p = packed.get();
  for (int64_t i = 0; i < batches * src_batch; ++i) {
    const int64_t j = i - 4, b = j / src_batch, r = (j % src_batch) / src_row, c = (j % src_batch) % src_row;
    const bool inside = j >= 0 && b < batches && r < rows && c < cols;
    if (inside) ASSERT_EQ(got[size_t(i)], p[size_t(b * dst_batch + r * dst_row + c)]) << "element " << i;
    else ASSERT_TRUE(std::isnan(got[size_t(i)])) << "padding element " << i << " was written";
  }
  // Accumulated: f32 += the compute dtype's values.
  const auto y = bf16_random(batches * dst_batch, 72);
  DevBuf acc(be(), y, DType::f32);
  be().copy_strided({.dst = acc.p(), .dst_dtype = DType::f32, .src = packed.p(), .src_dtype = dt_, .rows = 1,
                     .cols = batches * dst_batch, .accumulate = true});
  std::vector<double> sum(y.size());
  for (size_t i = 0; i < y.size(); ++i) sum[i] = double(y[i]) + double(p[i]);
  EXPECT_LE(rel_norm_err(acc.get(), sum), 1e-6) << "accumulate";
  EXPECT_THROW(be().copy_strided({.dst = packed.p(), .dst_dtype = DType::bf16, .src = acc.p(), .src_dtype = DType::f32,
                                  .cols = 1, .accumulate = true}),
               Error)
      << "accumulating into a 16-bit destination";
  // Rows narrower than their stride on either side: refused by every backend alike.
  EXPECT_THROW(be().copy_strided({.dst = same.p(), .dst_dtype = dt_, .src = packed.p(), .src_dtype = dt_, .rows = 2,
                                  .cols = cols, .dst_row = cols, .src_row = 0}),
               Error)
      << "a source row stride below the width";
  EXPECT_THROW(be().copy_strided({.dst = same.p(), .dst_dtype = dt_, .src = packed.p(), .src_dtype = dt_, .rows = 2,
                                  .cols = cols, .dst_row = cols - 1, .src_row = cols}),
               Error)
      << "a destination row stride below the width";
}

// Ring attention's merge of partial results: into a strided f32 output and log-sum-exps, first
// with init (the first partial result, rows without a visible key included), then a second partial
// result, against the definition in double.
TEST_P(BackendParity, AttentionMerge) {
  const int64_t B = 2, NH = 3, HS = 40, Tq = 5, C = NH * HS;
  const int64_t o_row = C + 8, o_batch = Tq * o_row + 16, lse_batch = NH * Tq + 3;
  const double inf = std::numeric_limits<double>::infinity();
  auto lse_values = [&](uint32_t seed, int64_t skip) {
    std::vector<float> l = bf16_random(B * NH * Tq, seed, 2.f);
    for (size_t i = 0; i < l.size(); i += size_t(skip)) l[i] = -std::numeric_limits<float>::infinity();
    return l;
  };
  const auto p1 = bf16_random(B * Tq * C, 73), p2 = bf16_random(B * Tq * C, 74);
  const auto l1 = lse_values(75, 7), l2 = lse_values(76, 5);
  DevBuf part1(be(), p1, dt_), part2(be(), p2, dt_), lse1(be(), l1, DType::f32), lse2(be(), l2, DType::f32);
  DevBuf out(be(), B * o_batch, DType::f32), lse(be(), B * lse_batch, DType::f32);
  out.poison();
  lse.poison();
  std::vector<double> o_ref(static_cast<size_t>(B * o_batch), std::nan("")), l_ref(static_cast<size_t>(B * lse_batch), std::nan(""));
  auto merge_ref = [&](const std::vector<float>& p, const std::vector<float>& lp, bool init) {
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < NH; ++h)
        for (int64_t t = 0; t < Tq; ++t) {
          double& l = l_ref[size_t(b * lse_batch + h * Tq + t)];
          const double lb = lp[size_t((b * NH + h) * Tq + t)], la = init ? -inf : l;
          if (!init && lb == -inf) continue;
          const double m = std::max(la, lb);
          const double wa = la == -inf ? 0 : std::exp(la - m), wb = std::exp(lb - m);
          for (int64_t d = 0; d < HS; ++d) {
            double& o = o_ref[size_t(b * o_batch + t * o_row + h * HS + d)];
            const double x = p[size_t((b * Tq + t) * C + h * HS + d)];
            o = la == -inf ? x : (wa * o + wb * x) / (wa + wb);
          }
          l = la == -inf ? lb : m + std::log(wa + wb);
        }
  };
  auto compare = [&](const char* what) {
    const std::vector<float> og = out.get(), lg = lse.get();
    std::vector<float> o_got, l_got;
    std::vector<double> o_want, l_want;
    for (size_t i = 0; i < og.size(); ++i) {
      if (std::isnan(o_ref[i])) {
        ASSERT_TRUE(std::isnan(og[i])) << what << ": padding element " << i << " of out was written";
        continue;
      }
      o_got.push_back(og[i]), o_want.push_back(o_ref[i]);
    }
    for (size_t i = 0; i < lg.size(); ++i) {
      if (std::isnan(l_ref[i])) continue;
      if (l_ref[i] == -inf) {
        EXPECT_EQ(lg[i], -std::numeric_limits<float>::infinity()) << what << ": lse " << i;
        continue;
      }
      l_got.push_back(lg[i]), l_want.push_back(l_ref[i]);
    }
    EXPECT_LE(rel_norm_err(o_got, o_want), tol_f32()) << what << ": out";
    EXPECT_LE(rel_norm_err(l_got, l_want), 1e-6) << what << ": lse";
  };
  const AttentionMerge base{.dtype = dt_, .out = out.as<float>(), .lse = lse.as<float>(), .B = B, .NH = NH, .HS = HS,
                            .Tq = Tq, .o_row = o_row, .o_batch = o_batch, .lse_batch = lse_batch};
  AttentionMerge a = base;
  a.part = part1.p(), a.part_lse = lse1.as<float>(), a.init = true;
  be().attention_merge(a);
  merge_ref(p1, l1, true);
  compare("init");
  a.part = part2.p(), a.part_lse = lse2.as<float>(), a.init = false;
  be().attention_merge(a);
  merge_ref(p2, l2, false);
  compare("merge");
}

// Backend instances share no state: two threads, each with its own instance, run the same linear
// layer forward and backward (GEMM tuning, scratch growth and all) at once and get what one
// instance gets alone (within the tolerances: tuning may choose another algorithm, and so another
// summation order, per instance).
TEST_P(BackendParity, InstancesOnThreadsAgree) {
  const int64_t M = 256, K = 128, N = 192;
  auto x = bf16_random(M * K, 80), w = bf16_random(N * K, 81, 0.2f), b = bf16_random(N, 82), dy = bf16_random(M * N, 83);
  auto run = [&](Backend& bk) {
    DevBuf dx(bk, x, dt_), dw(bk, w, dt_), db(bk, b, dt_), dd(bk, dy, dt_), out(bk, M * N, dt_), din(bk, M * K, dt_),
        gw(bk, std::vector<float>(static_cast<size_t>(N * K), 0.f), DType::f32), gb(bk, std::vector<float>(static_cast<size_t>(N), 0.f), DType::f32);
    for (int rep = 0; rep < 3; ++rep) {
      bk.linear_forward({.dtype = dt_, .out = out.p(), .inp = dx.p(), .weight = dw.p(), .bias = db.p(), .M = M, .K = K, .N = N});
      bk.linear_backward({.dtype = dt_, .dinp = din.p(), .dweight = gw.as<float>(), .dbias = gb.as<float>(),
                          .dout = dd.p(), .inp = dx.p(), .weight = dw.p(), .M = M, .K = K, .N = N});
    }
    std::vector<std::vector<float>> r{out.get(), din.get(), gw.get(), gb.get()};
    return r;
  };
  const auto alone = run(be());
  std::vector<std::vector<float>> got[2];
  std::string err[2];
  std::thread th[2];
  for (int i = 0; i < 2; ++i)
    th[i] = std::thread([&, i] {
      try {
        auto inst = make_backend(GetParam().device, {.compute = GetParam().compute});
        got[i] = run(*inst);
      } catch (const std::exception& e) {
        err[i] = e.what();
      }
    });
  for (auto& t : th) t.join();
  for (int i = 0; i < 2; ++i) {
    ASSERT_EQ(err[i], "") << "thread " << i;
    // The weight and bias gradients may take another summation order when a tuned algorithm or
    // the bias path differs between instances; the output and dinp GEMMs too. Equal within the
    // f32 tolerance, and the outputs within one bf16 rounding.
    for (size_t k = 0; k < alone.size(); ++k) {
      std::vector<double> ref(alone[k].begin(), alone[k].end());
      EXPECT_LE(rel_norm_err(got[i][k], ref), k < 2 ? tol_out() : tol_f32()) << "thread " << i << ", output " << k;
    }
  }
}

}  // namespace loom::test
