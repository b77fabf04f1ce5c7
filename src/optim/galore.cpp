#include "optim/galore.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/error.h"
#include "kernels/cpu/adamw.h"
#include "kernels/cpu/matmul.h"

// LAPACK and BLAS from OpenBLAS (Fortran calling convention, hidden string lengths last).
extern "C" {
void dsyrk_(const char* uplo, const char* trans, const int* n, const int* k, const double* alpha, const double* a,
            const int* lda, const double* beta, double* c, const int* ldc, size_t, size_t);
void dsyevr_(const char* jobz, const char* range, const char* uplo, const int* n, double* a, const int* lda,
             const double* vl, const double* vu, const int* il, const int* iu, const double* abstol, int* m, double* w,
             double* z, const int* ldz, int* isuppz, double* work, const int* lwork, int* iwork, const int* liwork,
             int* info, size_t, size_t, size_t);
void openblas_set_num_threads(int n);
}

namespace loom::optim {

GaLoreShapes galore_shapes(const std::string& name, const Shape& shape, int64_t rank,
                           const std::vector<std::pair<std::string, int64_t>>& row_blocks) {
  GaLoreShapes g;
  if (rank <= 0 || shape.size() != 2 || name.rfind("h.", 0) != 0) return g;
  const int64_t n = shape[1];
  std::vector<std::pair<std::string, int64_t>> blocks = row_blocks;
  if (blocks.empty()) blocks = {{"", shape[0]}};
  int64_t row0 = 0;
  for (const auto& [label, m] : blocks) {
    GaLorePart part;
    part.label = label;
    part.row0 = row0;
    part.rows = m;
    row0 += m;
    part.low_rank = rank < std::min(m, n);  // (else no smaller subspace: plain AdamW)
    part.left = m < n;
    part.moments = !part.low_rank ? Shape{m, n} : part.left ? Shape{rank, n} : Shape{m, rank};
    if (part.low_rank) part.projector = part.left ? Shape{m, rank} : Shape{rank, n};
    g.low_rank |= part.low_rank;
    g.parts.push_back(part);
  }
  LOOM_CHECK(row0 == shape[0], "galore: the row blocks of '{}' hold {} rows, its shape {}", name, row0, shape[0]);
  if (!g.low_rank) g.parts.clear();
  return g;
}

std::string galore_state_name(const std::string& kind, const std::string& param, const GaLorePart& part) {
  return kind + param + (part.label.empty() ? "" : "[" + part.label + "]");
}

std::array<std::string, 3> galore_part_tensors(const std::string& param, const GaLorePart& part) {
  if (!part.low_rank) return {galore_state_name("adam_m/", param, part), galore_state_name("adam_v/", param, part), ""};
  return {galore_state_name("galore_m/", param, part), galore_state_name("galore_v/", param, part),
          galore_state_name("galore_p/", param, part)};
}

void top_singular_vectors(const float* G, int64_t m, int64_t n, int64_t r, bool left, float* out, MemoryPool& pool,
                          const std::string& what) {
  const int64_t k = std::min(m, n);
  LOOM_CHECK(r >= 1 && r <= k, "galore: rank {} for a [{}, {}] matrix", r, m, n);
  LOOM_CHECK(m * n < (int64_t(1) << 31), "galore: matrix '{}' [{}, {}] is too large for LAPACK's int sizes", what, m, n);
  // OpenBLAS's own threads fight the OpenMP teams of the rank threads for the cores (its
  // eigensolver ran 100x slower with 2 threads beside them): one thread, the caller's.
  openblas_set_num_threads(1);
  // The singular vectors of G are the eigenvectors of its Gram matrix on the smaller side:
  // G G^T [m, m] = U S^2 U^T (left) or G^T G [n, n] = V S^2 V^T (right); the top r by LAPACK's
  // dsyevr, in double. Row-major G [m, n] is column-major A = G^T [n, m].
  auto doubles = [&](int64_t count) { return Tensor::empty({2 * count}, DType::f32, MemTag::workspace, pool); };
  Tensor a_t = doubles(m * n), c_t = doubles(k * k), w_t = doubles(k), z_t = doubles(k * r), sup_t = doubles(r);
  double* a = reinterpret_cast<double*>(a_t.f32());
  double* c = reinterpret_cast<double*>(c_t.f32());
  double* z = reinterpret_cast<double*>(z_t.f32());
  for (int64_t i = 0; i < m * n; ++i) a[i] = double(G[i]);
  const int K = int(k), lda = int(n);
  const double one = 1.0, zero = 0.0;
  if (left) {  // A^T A = G G^T
    const int inner = int(n);
    dsyrk_("U", "T", &K, &inner, &one, a, &lda, &zero, c, &K, 1, 1);
  } else {     // A A^T = G^T G
    const int inner = int(m);
    dsyrk_("U", "N", &K, &inner, &one, a, &lda, &zero, c, &K, 1, 1);
  }
  const int il = int(k - r + 1), iu = int(k);
  const double vl = 0, vu = 0, abstol = 0;
  int found = 0, info = 0, lwork = -1, liwork = -1, iquery = 0;
  double query = 0;
  int* isuppz = reinterpret_cast<int*>(sup_t.f32());
  double* w = reinterpret_cast<double*>(w_t.f32());
  dsyevr_("V", "I", "U", &K, c, &K, &vl, &vu, &il, &iu, &abstol, &found, w, z, &K, isuppz, &query, &lwork, &iquery,
          &liwork, &info, 1, 1, 1);
  LOOM_CHECK(info == 0, "galore: LAPACK dsyevr workspace query failed for '{}' (info {})", what, info);
  lwork = int(query) + 1;
  liwork = iquery + 1;
  Tensor work_t = doubles(lwork), iwork_t = Tensor::empty({liwork}, DType::i32, MemTag::workspace, pool);
  dsyevr_("V", "I", "U", &K, c, &K, &vl, &vu, &il, &iu, &abstol, &found, w, z, &K, isuppz,
          reinterpret_cast<double*>(work_t.f32()), &lwork, iwork_t.i32(), &liwork, &info, 1, 1, 1);
  if (info != 0 || found != int(r))
    throw Error(fmt::format("galore: the SVD of the gradient of '{}' [{}, {}] failed (LAPACK dsyevr info {}, {} of {} "
                            "vectors)",
                            what, m, n, info, found, r));
  // Eigenvalues ascend: the largest singular value's vector is the last column of Z.
  for (int64_t j = 0; j < r; ++j) {
    const double* v = z + (r - 1 - j) * k;
    if (left)
      for (int64_t i = 0; i < m; ++i) out[i * r + j] = float(v[i]);  // P [m, r]
    else
      for (int64_t i = 0; i < n; ++i) out[j * n + i] = float(v[i]);  // Q [r, n]
  }
}

GaLore::GaLore(std::vector<FlatSegment> segments, int64_t begin, int64_t end, const AdamWConfig& cfg,
               MemoryPool& state_pool, MemoryPool& work_pool)
    : FlatOptimizer(segments, begin, end, cfg, "galore"), work_pool_(work_pool) {
  int64_t most = 0;
  for (const FlatSegment& seg : segments_) {
    State st;
    st.shapes = galore_shapes(seg.name, seg.shape, cfg_.galore_rank, seg.row_blocks);
    if (st.shapes.low_rank) {
      LOOM_CHECK(seg.end - seg.begin == shape_numel(seg.shape) && seg.in_norm,
                 "galore: matrix '{}' is not whole in this rank's range [{}, {}) (GaLore needs ZeRO stage 0 and no "
                 "tensor parallelism)",
                 seg.name, begin, end);
      for (const GaLorePart& part : st.shapes.parts) {
        PartState ps;
        ps.exp_avg = Tensor::zeros(part.moments, DType::f32, MemTag::optimizer, state_pool);
        ps.exp_avg_sq = Tensor::zeros(part.moments, DType::f32, MemTag::optimizer, state_pool);
        if (part.low_rank) {
          ps.projector = Tensor::zeros(part.projector, DType::f32, MemTag::optimizer, state_pool);
          most = std::max(most, shape_numel(part.moments));
        }
        st.parts.push_back(std::move(ps));
      }
    } else {
      st.exp_avg = Tensor::zeros({seg.end - seg.begin}, DType::f32, MemTag::optimizer, state_pool);
      st.exp_avg_sq = Tensor::zeros({seg.end - seg.begin}, DType::f32, MemTag::optimizer, state_pool);
    }
    states_.push_back(std::move(st));
  }
  if (most > 0) {
    work_r_ = Tensor::zeros({most}, DType::f32, MemTag::workspace, work_pool_);
    work_d_ = Tensor::zeros({most}, DType::f32, MemTag::workspace, work_pool_);
  }
}

int64_t GaLore::state_bytes() const {
  int64_t n = 0;
  for (const State& s : states_) {
    if (s.exp_avg.defined()) n += int64_t(s.exp_avg.nbytes() + s.exp_avg_sq.nbytes());
    for (const PartState& ps : s.parts)
      n += int64_t(ps.exp_avg.nbytes() + ps.exp_avg_sq.nbytes() + (ps.projector.defined() ? ps.projector.nbytes() : 0));
  }
  return n;
}

void GaLore::refresh_projectors(const float* grad_shard, int rank, int ranks,
                                const std::function<void(Tensor&, int)>& share) {
  LOOM_CHECK(refresh_due(), "galore: step {} takes no new projectors", t_ + 1);
  LOOM_CHECK(0 <= rank && rank < ranks, "galore: rank {} of {}", rank, ranks);
  int64_t i = 0;
  for (size_t k = 0; k < states_.size(); ++k) {
    State& s = states_[k];
    if (!s.shapes.low_rank) continue;
    const FlatSegment& seg = segments_[k];
    const int64_t n = seg.shape[1];
    for (size_t j = 0; j < s.parts.size(); ++j) {
      const GaLorePart& part = s.shapes.parts[j];
      if (!part.low_rank) continue;
      const int owner = int(i++ % ranks);
      if (owner == rank) {
        top_singular_vectors(grad_shard + seg.begin + part.row0 * n, part.rows, n, cfg_.galore_rank, part.left,
                             s.parts[j].projector.f32(), work_pool_, galore_state_name("", seg.name, part));
        ++refreshes_;
      }
      share(s.parts[j].projector, owner);
    }
  }
  refreshed_for_ = t_ + 1;
}

StepStats GaLore::step(float* param_shard, const float* grad_shard, double global_norm, double lr) {
  // A holder alone (no refresh_projectors before this step): it computes them all.
  if (std::isfinite(global_norm) && refresh_due() && refreshed_for_ != t_ + 1)
    refresh_projectors(grad_shard, 0, 1, [](Tensor&, int) {});
  const StepStats st = begin_step(global_norm, "galore");
  for (size_t k = 0; k < states_.size(); ++k) {
    State& s = states_[k];
    const FlatSegment& seg = segments_[k];
    const cpu::AdamWArgs a = segment_args(lr, seg.decay, st);
    float* w = param_shard + seg.begin;
    const float* g = grad_shard + seg.begin;
    if (!s.shapes.low_rank) {
      cpu::adamw_update(w, g, s.exp_avg.f32(), s.exp_avg_sq.f32(), seg.end - seg.begin, a);
      continue;
    }
    const int64_t n = seg.shape[1], r = cfg_.galore_rank;
    for (size_t j = 0; j < s.parts.size(); ++j) {
      const GaLorePart& part = s.shapes.parts[j];
      PartState& ps = s.parts[j];
      const int64_t m = part.rows;
      float* wp = w + part.row0 * n;
      const float* gp = g + part.row0 * n;
      if (!part.low_rank) {  // (a block no wider than the rank: AdamW)
        cpu::adamw_update(wp, gp, ps.exp_avg.f32(), ps.exp_avg_sq.f32(), m * n, a);
        continue;
      }
      const float* P = ps.projector.f32();
      const int64_t kn = shape_numel(part.moments);
      float* R = work_r_.f32();
      float* D = work_d_.f32();
      if (part.left) cpu::gemm(true, false, r, n, m, 1.0f, P, r, gp, n, 0.0f, R, n);  // P^T G [r, n]
      else cpu::gemm(false, true, m, r, n, 1.0f, gp, n, P, n, 0.0f, R, r);             // G Q^T [m, r]
      // Adam in the subspace: from D = 0 with lr 1 and no decay the kernel leaves D = -N.
      std::fill(D, D + kn, 0.0f);
      cpu::AdamWArgs sub = a;
      sub.lr = 1.0;
      sub.weight_decay = 0.0;
      cpu::adamw_update(D, R, ps.exp_avg.f32(), ps.exp_avg_sq.f32(), kn, sub);
      if (a.weight_decay > 0) {
        const float decay = float(1.0 - a.lr * a.weight_decay);
        for (int64_t i = 0; i < m * n; ++i) wp[i] *= decay;
      }
      const float alpha = float(a.lr * cfg_.galore_scale);
      if (part.left) cpu::gemm(false, false, m, n, r, alpha, P, r, D, n, 1.0f, wp, n);  // W += alpha P (-N)
      else cpu::gemm(false, false, m, n, r, alpha, D, r, P, n, 1.0f, wp, n);            // W += alpha (-N) Q
    }
  }
  return st;
}

}  // namespace loom::optim
