#include "parallel/tensor/mappings.h"

#include <cstring>

#include "core/error.h"

namespace loom::parallel::tp {

comm::Range sp_rows(int64_t N, int size, int rank) { return comm::chunk_range(N, size, rank); }

std::vector<int64_t> sp_counts(int64_t N, int64_t C, int size) {
  std::vector<int64_t> counts(static_cast<size_t>(size), 0);
  for (int r = 0; r < size; ++r) counts[size_t(r)] = sp_rows(N, size, r).size() * C;
  return counts;
}

void copy_backward(comm::Comm* g, float* dx, int64_t n) {
  if (group_size(g) > 1) g->all_reduce(dx, n, DType::f32);
}

void reduce_forward(comm::Comm* g, float* x, int64_t n) {
  if (group_size(g) > 1) g->all_reduce(x, n, DType::f32);
}

void gather_rows_forward(comm::Comm* g, const float* local, float* full, int64_t N, int64_t C) {
  if (group_size(g) == 1) {
    if (local != full) std::memcpy(full, local, size_t(N * C) * sizeof(float));
    return;
  }
  auto counts = sp_counts(N, C, g->size());
  g->all_gather_v(local, full, counts, DType::f32);
}

void gather_rows_backward(comm::Comm* g, const float* dfull, float* dlocal, int64_t N, int64_t C) {
  if (group_size(g) == 1) {
    if (dlocal != dfull) std::memcpy(dlocal, dfull, size_t(N * C) * sizeof(float));
    return;
  }
  auto counts = sp_counts(N, C, g->size());
  g->reduce_scatter_v(dfull, dlocal, counts, DType::f32);
}

void scatter_rows_forward(comm::Comm* g, const float* partial, float* local, int64_t N, int64_t C) {
  gather_rows_backward(g, partial, local, N, C);
}

void scatter_rows_backward(comm::Comm* g, const float* dlocal, float* dfull, int64_t N, int64_t C) {
  gather_rows_forward(g, dlocal, dfull, N, C);
}

}  // namespace loom::parallel::tp
