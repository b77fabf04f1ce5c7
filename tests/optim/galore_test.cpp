// GaLore (optim/galore.h): the projector is the gradient's top singular vectors (checked on
// matrices built from known singular vectors), and a step equals GaLore's update computed in
// double from the same projector (Adam in the subspace, the normalized step projected back and
// scaled, decoupled weight decay, clipping), for a left and a right projection beside parameters
// that keep plain AdamW; the state is what the rank saves.
#include "optim/galore.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "core/error.h"
#include "kernels/cpu/adamw.h"
#include "optim/sharded_adamw.h"

using namespace loom;

namespace {

// An n x k matrix (row-major, double) with orthonormal columns, from Gram-Schmidt on normals.
std::vector<double> orthonormal_columns(int64_t n, int64_t k, std::mt19937& g) {
  std::normal_distribution<double> d;
  std::vector<double> q(size_t(n * k));
  for (auto& x : q) x = d(g);
  for (int64_t j = 0; j < k; ++j)
    for (int pass = 0; pass < 2; ++pass) {
      for (int64_t p = 0; p < j; ++p) {
        double dot = 0;
        for (int64_t i = 0; i < n; ++i) dot += q[size_t(i * k + j)] * q[size_t(i * k + p)];
        for (int64_t i = 0; i < n; ++i) q[size_t(i * k + j)] -= dot * q[size_t(i * k + p)];
      }
      double norm = 0;
      for (int64_t i = 0; i < n; ++i) norm += q[size_t(i * k + j)] * q[size_t(i * k + j)];
      for (int64_t i = 0; i < n; ++i) q[size_t(i * k + j)] /= std::sqrt(norm);
    }
  return q;
}

}  // namespace

TEST(GaLore, ProjectorIsTheTopSingularVectors) {
  MemoryPool pool("galore");
  std::mt19937 g(3);
  for (const auto& [m, n] : {std::pair<int64_t, int64_t>{24, 40}, {40, 24}, {32, 32}}) {
    const int64_t k = std::min(m, n), r = 5;
    const std::vector<double> U = orthonormal_columns(m, k, g), V = orthonormal_columns(n, k, g);
    std::vector<float> G(size_t(m * n));
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) {
        double x = 0;
        for (int64_t c = 0; c < k; ++c) x += U[size_t(i * k + c)] * (10.0 / double(c + 1)) * V[size_t(j * k + c)];
        G[size_t(i * n + j)] = float(x);
      }
    const bool left = m < n;
    std::vector<float> out(size_t((left ? m : n) * r));
    optim::top_singular_vectors(G.data(), m, n, r, left, out.data(), pool, "test");
    // Column c of P (left) or row c of Q (right) is +-U[:, c] or +-V[:, c].
    for (int64_t c = 0; c < r; ++c) {
      const std::vector<double>& want = left ? U : V;
      const int64_t len = left ? m : n;
      double dot = 0;
      for (int64_t i = 0; i < len; ++i)
        dot += double(left ? out[size_t(i * r + c)] : out[size_t(c * n + i)]) * want[size_t(i * k + c)];
      for (int64_t i = 0; i < len; ++i) {
        const double got = left ? out[size_t(i * r + c)] : out[size_t(c * n + i)];
        EXPECT_NEAR(got, (dot > 0 ? 1 : -1) * want[size_t(i * k + c)], 1e-5) << m << "x" << n << " vector " << c;
      }
    }
    EXPECT_EQ(pool.stats().current[int(MemTag::workspace)], 0) << "the SVD's scratch is freed";
  }
}

TEST(GaLore, ShapesFollowTheSmallerSideAndSkipWhatIsNotABlockMatrix) {
  auto s = optim::galore_shapes("h.0.attn.c_attn.weight", {96, 32}, 8);
  EXPECT_TRUE(s.low_rank);
  ASSERT_EQ(s.parts.size(), 1u);
  EXPECT_FALSE(s.parts[0].left);
  EXPECT_EQ(s.parts[0].moments, (Shape{96, 8}));
  EXPECT_EQ(s.parts[0].projector, (Shape{8, 32}));
  EXPECT_EQ(optim::galore_state_name("galore_m/", "h.0.attn.c_attn.weight", s.parts[0]), "galore_m/h.0.attn.c_attn.weight");
  s = optim::galore_shapes("h.1.mlp.c_proj.weight", {32, 128}, 8);
  EXPECT_TRUE(s.parts[0].left);
  EXPECT_EQ(s.parts[0].moments, (Shape{8, 128}));
  EXPECT_EQ(s.parts[0].projector, (Shape{32, 8}));
  // A Llama block's fused matrices, as Hugging Face's modules: q [32, 32] right, k and v [8, 32]
  // left (fewer rows than columns), each at rank 4; at rank 8, k and v keep AdamW.
  s = optim::galore_shapes("h.0.attn.c_attn.weight", {48, 32}, 4, {{"q", 32}, {"k", 8}, {"v", 8}});
  ASSERT_EQ(s.parts.size(), 3u);
  EXPECT_EQ(s.parts[1].label, "k");
  EXPECT_EQ(s.parts[1].row0, 32);
  EXPECT_TRUE(s.parts[1].left);
  EXPECT_EQ(s.parts[1].moments, (Shape{4, 32}));
  EXPECT_EQ(s.parts[1].projector, (Shape{8, 4}));
  EXPECT_FALSE(s.parts[0].left);
  EXPECT_EQ(s.parts[0].moments, (Shape{32, 4}));
  EXPECT_EQ(optim::galore_state_name("galore_p/", "h.0.attn.c_attn.weight", s.parts[2]),
            "galore_p/h.0.attn.c_attn.weight[v]");
  s = optim::galore_shapes("h.0.attn.c_attn.weight", {48, 32}, 8, {{"q", 32}, {"k", 8}, {"v", 8}});
  EXPECT_TRUE(s.parts[0].low_rank);
  EXPECT_FALSE(s.parts[1].low_rank);
  EXPECT_EQ(s.parts[1].moments, (Shape{8, 32}));
  EXPECT_THROW(optim::galore_shapes("h.0.attn.c_attn.weight", {48, 32}, 4, {{"q", 32}, {"k", 8}}), Error);
  EXPECT_FALSE(optim::galore_shapes("wte.weight", {97, 32}, 8).low_rank);
  EXPECT_FALSE(optim::galore_shapes("lm_head.weight", {97, 32}, 8).low_rank);
  EXPECT_FALSE(optim::galore_shapes("h.0.ln_1.weight", {32}, 8).low_rank);
  EXPECT_FALSE(optim::galore_shapes("h.0.attn.c_proj.weight", {32, 32}, 32).low_rank);  // rank not below the side
  EXPECT_FALSE(optim::galore_shapes("h.0.attn.c_proj.weight", {32, 32}, 0).low_rank);
}

// Three steps (projector refreshed at steps 1 and 3) against double precision from the same
// projectors.
TEST(GaLore, StepsMatchTheUpdateInDouble) {
  MemoryPool pool("galore");
  struct P {
    std::string name;
    Shape shape;
  };
  const std::vector<P> params = {{"wte.weight", {10, 8}},
                                 {"h.0.attn.c_attn.weight", {24, 8}},
                                 {"h.0.attn.c_attn.bias", {24}},
                                 {"h.0.mlp.c_proj.weight", {6, 16}},
                                 {"h.1.attn.c_attn.weight", {14, 8}}};  // a Llama block's q, k, v
  std::vector<optim::FlatSegment> segs;
  int64_t at = 0;
  for (const P& p : params) {
    const int64_t n = shape_numel(p.shape);
    segs.push_back({at, at + n, p.shape.size() >= 2, p.name, true, p.shape});
    if (p.name == "h.1.attn.c_attn.weight") segs.back().row_blocks = {{"q", 8}, {"k", 4}, {"v", 2}};
    at += n + 3;  // gaps, as the flat layout's alignment leaves
  }
  optim::AdamWConfig cfg;
  cfg.lr = 1e-2;
  cfg.weight_decay = 0.1;
  cfg.max_norm = 2.0f;  // clips: the gradients' norm is about 6
  cfg.galore_rank = 3;
  cfg.galore_update_every = 2;
  cfg.galore_scale = 0.5;
  optim::GaLore opt(segs, 0, at, cfg, pool, pool);
  // State: plain moments for wte and the bias, r max(m, n) moments and r min(m, n) projectors;
  // the fused matrix's q [8, 8] and k [4, 8] so, its v [2, 8] (not above the rank) plain.
  EXPECT_EQ(opt.state_bytes(), 4 * (2 * 80 + 2 * (3 * 24) + 3 * 8 + 2 * 24 + 2 * (3 * 16) + 6 * 3 + 2 * (8 * 3) +
                                    8 * 3 + 2 * (3 * 8) + 4 * 3 + 2 * 16));
  EXPECT_EQ(pool.stats().current[int(MemTag::optimizer)], opt.state_bytes());

  std::mt19937 g(5);
  std::normal_distribution<float> d;
  std::vector<float> w(size_t(at), 0.0f), grad(size_t(at), 0.0f);
  for (const auto& s : segs)
    for (int64_t i = s.begin; i < s.end; ++i) w[size_t(i)] = d(g);
  std::vector<double> wd(w.begin(), w.end());
  struct Ref {
    std::vector<double> m, v;
  };
  // Per segment and part (one part where a segment is not projected).
  std::vector<std::vector<Ref>> ref(segs.size());
  for (size_t k = 0; k < segs.size(); ++k) {
    const auto sh = optim::galore_shapes(segs[k].name, segs[k].shape, cfg.galore_rank, segs[k].row_blocks);
    if (!sh.low_rank) ref[k].push_back({std::vector<double>(size_t(segs[k].end - segs[k].begin), 0.0),
                                        std::vector<double>(size_t(segs[k].end - segs[k].begin), 0.0)});
    for (const auto& part : sh.parts)
      ref[k].push_back({std::vector<double>(size_t(shape_numel(part.moments)), 0.0),
                        std::vector<double>(size_t(shape_numel(part.moments)), 0.0)});
  }
  for (int64_t t = 1; t <= 3; ++t) {
    double ss = 0;
    for (const auto& s : segs)
      for (int64_t i = s.begin; i < s.end; ++i) grad[size_t(i)] = d(g), ss += double(grad[size_t(i)]) * grad[size_t(i)];
    const double norm = std::sqrt(ss);
    EXPECT_NEAR(opt.grad_sum_squares(grad.data()), ss, 1e-9 * ss);
    const optim::StepStats st = opt.step(w.data(), grad.data(), norm);
    EXPECT_EQ(opt.refreshes(), t == 1 ? 4 : t == 2 ? 4 : 8);  // c_attn, c_proj, and the fused q and k
    const double clip = std::min(1.0, cfg.max_norm / (norm + 1e-6));
    EXPECT_NEAR(st.clip_scale, clip, 1e-6);
    const double bc1 = 1 - std::pow(cfg.beta1, double(t)), bc2 = 1 - std::pow(cfg.beta2, double(t));
    for (size_t k = 0; k < segs.size(); ++k) {
      const optim::FlatSegment& s = segs[k];
      const optim::GaLore::State& state = opt.states()[k];
      const auto sh = state.shapes;
      const double decay = s.decay ? 1 - cfg.lr * cfg.weight_decay : 1.0;
      auto adam = [&](Ref& st, std::vector<double>& R) {  // R -> N in place, moments updated
        for (size_t i = 0; i < R.size(); ++i) {
          st.m[i] = cfg.beta1 * st.m[i] + (1 - cfg.beta1) * R[i];
          st.v[i] = cfg.beta2 * st.v[i] + (1 - cfg.beta2) * R[i] * R[i];
          R[i] = (st.m[i] / bc1) / (std::sqrt(st.v[i] / bc2) + cfg.eps);
        }
      };
      auto plain = [&](Ref& st, int64_t begin, int64_t count) {
        std::vector<double> R(static_cast<size_t>(count));
        for (size_t i = 0; i < R.size(); ++i) R[i] = clip * grad[size_t(begin) + i];
        adam(st, R);
        for (size_t i = 0; i < R.size(); ++i) {
          double& x = wd[size_t(begin) + i];
          x = x * decay - cfg.lr * R[i];
        }
      };
      if (!sh.low_rank) {
        plain(ref[k][0], s.begin, s.end - s.begin);
        continue;
      }
      for (size_t q = 0; q < sh.parts.size(); ++q) {
        const optim::GaLorePart& part = sh.parts[q];
        const int64_t m = part.rows, n = s.shape[1], r = cfg.galore_rank, begin = s.begin + part.row0 * n;
        if (!part.low_rank) {
          plain(ref[k][q], begin, m * n);
          continue;
        }
        const float* P = state.parts[q].projector.f32();
        auto G = [&](int64_t i, int64_t j) { return clip * grad[size_t(begin + i * n + j)]; };
        std::vector<double> R(size_t(shape_numel(part.moments)), 0.0);
        if (part.left) {  // R [r, n] = P^T G, P [m, r]
          for (int64_t a = 0; a < r; ++a)
            for (int64_t j = 0; j < n; ++j)
              for (int64_t i = 0; i < m; ++i) R[size_t(a * n + j)] += double(P[i * r + a]) * G(i, j);
        } else {          // R [m, r] = G Q^T, Q [r, n]
          for (int64_t i = 0; i < m; ++i)
            for (int64_t a = 0; a < r; ++a)
              for (int64_t j = 0; j < n; ++j) R[size_t(i * r + a)] += G(i, j) * double(P[a * n + j]);
        }
        adam(ref[k][q], R);
        for (int64_t i = 0; i < m; ++i)
          for (int64_t j = 0; j < n; ++j) {
            double back = 0;
            for (int64_t a = 0; a < r; ++a)
              back += part.left ? double(P[i * r + a]) * R[size_t(a * n + j)] : R[size_t(i * r + a)] * double(P[a * n + j]);
            double& x = wd[size_t(begin + i * n + j)];
            x = x * decay - cfg.lr * cfg.galore_scale * back;
          }
      }
    }
    // The projector's columns are orthonormal.
    for (size_t k = 0; k < opt.states().size(); ++k) {
      const optim::GaLore::State& state = opt.states()[k];
      const optim::FlatSegment& seg = opt.segments()[k];
      for (size_t q = 0; q < state.shapes.parts.size(); ++q) {
        const optim::GaLorePart& part = state.shapes.parts[q];
        if (!part.low_rank) continue;
        const float* P = state.parts[q].projector.f32();
        const int64_t r = cfg.galore_rank, len = part.left ? part.rows : seg.shape[1];
        for (int64_t a = 0; a < r; ++a)
          for (int64_t b = 0; b < r; ++b) {
            double dot = 0;
            for (int64_t i = 0; i < len; ++i)
              dot += part.left ? double(P[i * r + a]) * P[i * r + b] : double(P[a * len + i]) * P[b * len + i];
            EXPECT_NEAR(dot, a == b ? 1.0 : 0.0, 1e-5) << seg.name << part.label;
          }
      }
    }
    for (const auto& s : segs) {
      for (int64_t i = s.begin; i < s.end; ++i) {
        ASSERT_NEAR(w[size_t(i)], wd[size_t(i)], 2e-6 * (1 + std::abs(wd[size_t(i)])))
            << s.name << " step " << t << " element " << i - s.begin;
      }
    }
    for (int64_t i = 0; i < at; ++i) {
      bool inside = false;
      for (const auto& s : segs) inside = inside || (i >= s.begin && i < s.end);
      if (!inside) {
        ASSERT_EQ(w[size_t(i)], 0.0f) << "gap element " << i << " was written";
      }
    }
  }
}

TEST(GaLore, NeedsEveryProjectedMatrixWholeInItsRange) {
  MemoryPool pool("galore");
  optim::AdamWConfig cfg;
  cfg.galore_rank = 2;
  std::vector<optim::FlatSegment> segs = {{0, 64, true, "h.0.attn.c_proj.weight", true, {8, 8}}};
  try {
    optim::GaLore opt(segs, 0, 32, cfg, pool, pool);
    FAIL() << "a matrix cut by the range was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("h.0.attn.c_proj.weight"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("ZeRO stage 0"), std::string::npos) << e.what();
  }
}

// Holders of the same gradient share the refresh: each computes its share of the projectors and
// takes the others' (a broadcast over the data-parallel group in DataParallel); the result is one
// holder computing them all, and the next step does not compute them again.
TEST(GaLore, HoldersShareTheProjectorRefresh) {
  MemoryPool pool("galore");
  std::vector<optim::FlatSegment> segs;
  int64_t at = 0;
  for (int l = 0; l < 3; ++l)
    for (const auto& [name, shape] : {std::pair<std::string, Shape>{".attn.c_attn.weight", {24, 8}},
                                      {".mlp.c_proj.weight", {8, 20}}}) {
      const int64_t n = shape_numel(shape);
      segs.push_back({at, at + n, true, "h." + std::to_string(l) + name, true, shape});
      at += n;
    }
  optim::AdamWConfig cfg;
  cfg.galore_rank = 3;
  cfg.galore_update_every = 2;
  std::mt19937 g(9);
  std::normal_distribution<float> d;
  std::vector<float> grad(static_cast<size_t>(at)), w0(static_cast<size_t>(at));
  for (auto& x : grad) x = d(g);
  for (auto& x : w0) x = d(g);
  optim::GaLore one(segs, 0, at, cfg, pool, pool), a(segs, 0, at, cfg, pool, pool), b(segs, 0, at, cfg, pool, pool);
  std::vector<float> w_one = w0, w_a = w0, w_b = w0;
  for (int step = 1; step <= 3; ++step) {
    ASSERT_EQ(a.refresh_due(), step != 2);
    if (a.refresh_due()) {
      // a is rank 0 of 2, b rank 1: a computes matrices 0, 2, 4 and b 1, 3, 5; then each takes
      // the owner's.
      a.refresh_projectors(grad.data(), 0, 2, [](Tensor&, int) {});
      b.refresh_projectors(grad.data(), 1, 2, [](Tensor&, int) {});
      for (size_t i = 0; i < a.states().size(); ++i) {
        Tensor& from = (i % 2 == 0 ? a : b).states()[i].parts[0].projector;
        Tensor& to = (i % 2 == 0 ? b : a).states()[i].parts[0].projector;
        std::memcpy(to.f32(), from.f32(), from.nbytes());
      }
    }
    one.step(w_one.data(), grad.data(), 1.0);
    a.step(w_a.data(), grad.data(), 1.0);
    b.step(w_b.data(), grad.data(), 1.0);
    EXPECT_EQ(std::memcmp(w_a.data(), w_one.data(), w_one.size() * 4), 0) << "step " << step;
    EXPECT_EQ(std::memcmp(w_b.data(), w_one.data(), w_one.size() * 4), 0) << "step " << step;
    for (auto& x : grad) x = d(g);
  }
  EXPECT_EQ(one.refreshes(), 12);  // 6 matrices at steps 1 and 3
  EXPECT_EQ(a.refreshes(), 6);
  EXPECT_EQ(b.refreshes(), 6);
}
