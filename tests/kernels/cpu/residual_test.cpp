#include "kernels/cpu/residual.h"

#include <gtest/gtest.h>

#include <vector>

#include "core/dtype.h"
#include "kernels/cpu/kernel_test_util.h"

using namespace loom;
using loom::test::random_vec;

// Element-wise float adds are exact to compare: the kernel (and core's add_f32) must give a[i] + b[i]
// bitwise.
TEST(Residual, ForwardAndAccumulate) {
  for (int64_t n : {1, 13, 1001, 100003}) {  // the last one takes the multithreaded path
    auto a = random_vec(n, 1), b = random_vec(n, 2);
    std::vector<float> out(static_cast<size_t>(n)), want(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) want[size_t(i)] = a[size_t(i)] + b[size_t(i)];
    cpu::residual_forward(out.data(), a.data(), b.data(), n);
    EXPECT_EQ(out, want) << "n=" << n;
    auto acc = a;
    add_f32(acc.data(), b.data(), n);  // (core's host add: Backend::add_to_host's)
    EXPECT_EQ(acc, want) << "n=" << n;
  }
}

TEST(Residual, OutputMayAliasAnInput) {
  const int64_t n = 777;
  auto a = random_vec(n, 3), b = random_vec(n, 4);
  std::vector<float> want(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) want[size_t(i)] = a[size_t(i)] + b[size_t(i)];
  auto a2 = a, b2 = b;
  cpu::residual_forward(a2.data(), a2.data(), b.data(), n);
  cpu::residual_forward(b2.data(), a.data(), b2.data(), n);
  EXPECT_EQ(a2, want);
  EXPECT_EQ(b2, want);
}
