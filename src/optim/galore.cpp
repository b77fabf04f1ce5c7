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

GaLoreShapes galore_shapes(const std::string& name, const Shape& shape, int64_t rank) {
  GaLoreShapes g;
  if (rank <= 0 || shape.size() != 2 || name.rfind("h.", 0) != 0) return g;
  const int64_t m = shape[0], n = shape[1];
  if (rank >= std::min(m, n)) return g;  // no smaller subspace: plain AdamW
  g.low_rank = true;
  g.left = m < n;
  g.moments = g.left ? Shape{rank, n} : Shape{m, rank};
  g.projector = g.left ? Shape{m, rank} : Shape{rank, n};
  return g;
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
    : FlatOptimizer(cfg, begin, end), work_pool_(work_pool) {
  cfg_.validate();
  LOOM_CHECK(0 <= begin && begin <= end, "galore: bad range [{}, {})", begin, end);
  int64_t prev = 0, most = 0;
  for (const FlatSegment& s : segments) {
    LOOM_CHECK(s.begin >= prev && s.end >= s.begin, "galore: segment '{}' [{}, {}) is out of order", s.name, s.begin,
               s.end);
    prev = s.end;
    const int64_t b = std::max(s.begin, begin), e = std::min(s.end, end);
    if (b >= e) continue;
    State st;
    st.seg = {b - begin, e - begin, s.decay, s.name, s.in_norm, s.shape};
    st.shapes = galore_shapes(s.name, s.shape, cfg_.galore_rank);
    if (st.shapes.low_rank) {
      LOOM_CHECK(b == s.begin && e == s.end && s.end - s.begin == shape_numel(s.shape) && s.in_norm,
                 "galore: matrix '{}' is not whole in this rank's range [{}, {}) (GaLore needs ZeRO stage 0 and no "
                 "tensor parallelism)",
                 s.name, begin, end);
      st.exp_avg = Tensor::zeros(st.shapes.moments, DType::f32, MemTag::optimizer, state_pool);
      st.exp_avg_sq = Tensor::zeros(st.shapes.moments, DType::f32, MemTag::optimizer, state_pool);
      st.projector = Tensor::zeros(st.shapes.projector, DType::f32, MemTag::optimizer, state_pool);
      most = std::max(most, shape_numel(st.shapes.moments));
    } else {
      st.exp_avg = Tensor::zeros({e - b}, DType::f32, MemTag::optimizer, state_pool);
      st.exp_avg_sq = Tensor::zeros({e - b}, DType::f32, MemTag::optimizer, state_pool);
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
  for (const State& s : states_)
    n += int64_t(s.exp_avg.nbytes() + s.exp_avg_sq.nbytes() + (s.projector.defined() ? s.projector.nbytes() : 0));
  return n;
}

double GaLore::grad_sum_squares(const float* grad_shard) const {
  double s = 0;
  for (const State& st : states_)
    if (st.seg.in_norm) s += cpu::sum_squares(grad_shard + st.seg.begin, st.seg.end - st.seg.begin);
  return s;
}

void GaLore::refresh_projectors(const float* grad_shard, int rank, int ranks,
                                const std::function<void(Tensor&, int)>& share) {
  LOOM_CHECK(refresh_due(), "galore: step {} takes no new projectors", t_ + 1);
  LOOM_CHECK(0 <= rank && rank < ranks, "galore: rank {} of {}", rank, ranks);
  int64_t i = 0;
  for (State& s : states_) {
    if (!s.shapes.low_rank) continue;
    const int owner = int(i++ % ranks);
    if (owner == rank) {
      top_singular_vectors(grad_shard + s.seg.begin, s.seg.shape[0], s.seg.shape[1], cfg_.galore_rank, s.shapes.left,
                           s.projector.f32(), work_pool_, s.seg.name);
      ++refreshes_;
    }
    share(s.projector, owner);
  }
  refreshed_for_ = t_ + 1;
}

StepStats GaLore::step(float* param_shard, const float* grad_shard, double global_norm, double lr) {
  const StepStats st = begin_step(global_norm, "galore");
  const bool refresh = (t_ - 1) % cfg_.galore_update_every == 0 && refreshed_for_ != t_;
  for (State& s : states_) {
    const cpu::AdamWArgs a = segment_args(lr, s.seg.decay, st);
    float* w = param_shard + s.seg.begin;
    const float* g = grad_shard + s.seg.begin;
    if (!s.shapes.low_rank) {
      cpu::adamw_update(w, g, s.exp_avg.f32(), s.exp_avg_sq.f32(), s.seg.end - s.seg.begin, a);
      continue;
    }
    const int64_t m = s.seg.shape[0], n = s.seg.shape[1], r = cfg_.galore_rank;
    float* P = s.projector.f32();
    if (refresh) {
      top_singular_vectors(g, m, n, r, s.shapes.left, P, work_pool_, s.seg.name);
      ++refreshes_;
    }
    const int64_t k = shape_numel(s.shapes.moments);
    float* R = work_r_.f32();
    float* D = work_d_.f32();
    if (s.shapes.left) cpu::gemm(true, false, r, n, m, 1.0f, P, r, g, n, 0.0f, R, n);   // P^T G [r, n]
    else cpu::gemm(false, true, m, r, n, 1.0f, g, n, P, n, 0.0f, R, r);                  // G Q^T [m, r]
    // Adam in the subspace: from D = 0 with lr 1 and no decay the kernel leaves D = -N.
    std::fill(D, D + k, 0.0f);
    cpu::AdamWArgs sub = a;
    sub.lr = 1.0;
    sub.weight_decay = 0.0;
    cpu::adamw_update(D, R, s.exp_avg.f32(), s.exp_avg_sq.f32(), k, sub);
    if (a.weight_decay > 0) {
      const float decay = float(1.0 - a.lr * a.weight_decay);
      for (int64_t i = 0; i < m * n; ++i) w[i] *= decay;
    }
    const float alpha = float(a.lr * cfg_.galore_scale);
    if (s.shapes.left) cpu::gemm(false, false, m, n, r, alpha, P, r, D, n, 1.0f, w, n);  // W += alpha P (-N)
    else cpu::gemm(false, false, m, n, r, alpha, D, r, P, n, 1.0f, w, n);                // W += alpha (-N) Q
  }
  return st;
}

}  // namespace loom::optim
