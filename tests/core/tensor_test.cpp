#include <gtest/gtest.h>

#include "core/memory.h"
#include "core/rng.h"
#include "core/tensor.h"

using namespace loom;

TEST(MemoryPool, TagsCurrentAndPeak) {
  MemoryPool pool("t");
  {
    Tensor a = Tensor::empty({10, 10}, DType::f32, MemTag::params, pool);
    Tensor b = Tensor::empty({5}, DType::bf16, MemTag::activations, pool);
    EXPECT_EQ(pool.current(MemTag::params), 400);
    EXPECT_EQ(pool.current(MemTag::activations), 10);
    EXPECT_EQ(pool.total_current(), 410);
  }
  EXPECT_EQ(pool.current(MemTag::params), 0);
  EXPECT_EQ(pool.peak(MemTag::params), 400);
  EXPECT_EQ(pool.total_peak(), 410);
  pool.reset_peaks();
  EXPECT_EQ(pool.peak(MemTag::params), 0);
}

// Allocations are counted per tag (a loop that reuses its buffers shows as a count that stops
// growing); reset_peaks leaves the counts.
TEST(MemoryPool, CountsAllocationsPerTag) {
  MemoryPool pool("t");
  for (int i = 0; i < 3; ++i) Tensor w = Tensor::empty({8}, DType::f32, MemTag::workspace, pool);
  Tensor a = Tensor::empty({4}, DType::f32, MemTag::activations, pool);
  Tensor view = a.slice0(1, 2);  // a view allocates nothing
  EXPECT_EQ(pool.allocations(MemTag::workspace), 3);
  EXPECT_EQ(pool.allocations(MemTag::activations), 1);
  EXPECT_EQ(pool.allocations(MemTag::params), 0);
  EXPECT_EQ(pool.total_allocations(), 4);
  pool.reset_peaks();
  EXPECT_EQ(pool.stats().allocations[size_t(MemTag::workspace)], 3);
  EXPECT_EQ(pool.stats().total_allocations, 4);
}

TEST(Tensor, ViewAndSliceShareStorage) {
  MemoryPool pool("t");
  Tensor a = Tensor::zeros({4, 3}, DType::f32, MemTag::workspace, pool);
  Tensor s = a.slice0(1, 2);
  s.f32()[0] = 7.f;
  EXPECT_EQ(a.f32()[3], 7.f);
  EXPECT_EQ(a.view({12}).numel(), 12);
  EXPECT_THROW(a.view({5}), Error);
  EXPECT_THROW(a.slice0(3, 2), Error);
  EXPECT_EQ(pool.current(MemTag::workspace), 48);
}

TEST(DType, Bf16RoundToNearestEven) {
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(1.0f)), 1.0f);
  // 1 + 2^-8 is exactly halfway between bf16 1.0 and 1 + 2^-7: rounds to even (1.0).
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(1.0f + 1.0f / 256)), 1.0f);
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(1.0f + 3.0f / 256)), 1.0f + 4.0f / 256);
  float nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(nan))));
}

TEST(Rng, PureFunctionOfSeedStreamIndex) {
  std::vector<float> full(1000), part(300);
  fill_normal(full.data(), 1000, 0.f, 1.f, 42, stream_of("h.0.w"), 0);
  fill_normal(part.data(), 300, 0.f, 1.f, 42, stream_of("h.0.w"), 500);
  for (int i = 0; i < 300; ++i) EXPECT_EQ(full[500 + i], part[i]);
  double s = 0, s2 = 0;
  for (float x : full) { s += x; s2 += double(x) * x; }
  EXPECT_NEAR(s / 1000, 0.0, 0.12);
  EXPECT_NEAR(s2 / 1000, 1.0, 0.15);
  EXPECT_NE(normal_at(42, stream_of("a"), 0), normal_at(42, stream_of("b"), 0));
}
