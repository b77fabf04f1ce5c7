#include "parallel/tensor/mappings.h"

#include "core/error.h"

namespace loom::parallel::tp {

comm::Range sp_rows(int64_t N, int size, int rank) { return comm::chunk_range(N, size, rank); }

std::vector<int64_t> sp_counts(int64_t N, int64_t C, int size) {
  std::vector<int64_t> counts(static_cast<size_t>(size), 0);
  for (int r = 0; r < size; ++r) counts[size_t(r)] = sp_rows(N, size, r).size() * C;
  return counts;
}

void copy_backward(comm::Comm* g, void* dx, int64_t n, DType dt) {
  if (group_size(g) > 1) g->all_reduce(dx, n, dt);
}

void reduce_forward(comm::Comm* g, void* x, int64_t n, DType dt) {
  if (group_size(g) > 1) g->all_reduce(x, n, dt);
}

void gather_rows_forward(comm::Comm* g, const void* local, void* full, int64_t N, int64_t C, DType dt) {
  if (group_size(g) == 1) {
    LOOM_CHECK(local == full, "gather_rows: a group of one gathers in place");
    return;
  }
  g->all_gather_v(local, full, sp_counts(N, C, g->size()), dt);
}

void gather_rows_backward(comm::Comm* g, const void* dfull, void* dlocal, int64_t N, int64_t C, DType dt) {
  if (group_size(g) == 1) {
    LOOM_CHECK(dlocal == dfull, "gather_rows backward: a group of one reduces in place");
    return;
  }
  g->reduce_scatter_v(dfull, dlocal, sp_counts(N, C, g->size()), dt);
}

void scatter_rows_forward(comm::Comm* g, const void* partial, void* local, int64_t N, int64_t C, DType dt) {
  gather_rows_backward(g, partial, local, N, C, dt);
}

void scatter_rows_backward(comm::Comm* g, const void* dlocal, void* dfull, int64_t N, int64_t C, DType dt) {
  gather_rows_forward(g, dlocal, dfull, N, C, dt);
}

}  // namespace loom::parallel::tp
