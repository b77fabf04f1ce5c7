// Helpers for the CPU kernel tests: deterministic random inputs (never all zeros), a comparison
// that reports the worst element, and a scoped OpenMP thread count.
#pragma once
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "core/rng.h"

namespace loom::test {

// Uniform in [lo, hi), a pure function of (seed, i).
inline std::vector<float> random_vec(int64_t n, uint64_t seed, float lo = -1.f, float hi = 1.f) {
  std::vector<float> v(static_cast<size_t>(n));
  fill_uniform(v.data(), n, lo, hi, seed, /*stream=*/0x6b65726e656cULL, 0);
  return v;
}

inline std::vector<double> to_double(const std::vector<float>& v) { return {v.begin(), v.end()}; }

// Checks |got - want| <= atol + rtol * |want| element-wise and reports the worst violation.
inline ::testing::AssertionResult all_close(const float* got, const double* want, int64_t n, double atol,
                                            double rtol) {
  int64_t worst = -1;
  double worst_excess = 0.0, max_abs = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    const double err = std::fabs(double(got[i]) - want[i]);
    if (!std::isfinite(double(got[i]))) return ::testing::AssertionFailure() << "non-finite at " << i;
    max_abs = std::max(max_abs, err);
    const double excess = err - (atol + rtol * std::fabs(want[i]));
    if (excess > worst_excess) {
      worst_excess = excess;
      worst = i;
    }
  }
  if (worst >= 0)
    return ::testing::AssertionFailure() << "element " << worst << ": got " << got[worst] << ", want "
                                         << want[worst] << " (atol " << atol << ", rtol " << rtol
                                         << ", max abs err " << max_abs << ")";
  return ::testing::AssertionSuccess() << "max abs err " << max_abs;
}

inline ::testing::AssertionResult all_close(const std::vector<float>& got, const std::vector<double>& want,
                                            double atol, double rtol) {
  if (got.size() != want.size()) return ::testing::AssertionFailure() << "size mismatch";
  return all_close(got.data(), want.data(), int64_t(got.size()), atol, rtol);
}

// Sets the calling thread's OpenMP team size for a scope.
class ScopedThreads {
 public:
  explicit ScopedThreads(int n) : old_(omp_get_max_threads()) { omp_set_num_threads(n); }
  ~ScopedThreads() { omp_set_num_threads(old_); }
  ScopedThreads(const ScopedThreads&) = delete;
  ScopedThreads& operator=(const ScopedThreads&) = delete;

 private:
  int old_;
};

}  // namespace loom::test
