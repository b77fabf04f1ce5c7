#include "core/threads.h"

#include <omp.h>

#include <algorithm>

namespace loom {

int set_omp_threads(int n) {
  omp_set_dynamic(0);
  n = std::max(1, std::min(n, omp_get_thread_limit()));
  omp_set_num_threads(n);
  return n;
}

int settle_omp_threads() { return set_omp_threads(omp_get_max_threads()); }

}  // namespace loom
