#include <gtest/gtest.h>

#include <cstring>

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

// The array conversion (vectorised, no branches) gives the scalar one's bits for every kind of
// value: ties both ways, signs, zeros, subnormals, the largest finite values (which round to
// infinity), infinities and NaNs of both signs and payloads; over the parallel threshold too.
TEST(DType, Bf16ArrayConversionEqualsTheScalarOne) {
  std::vector<uint32_t> bits = {0x3f800000u, 0x3f808000u, 0x3f818000u, 0xbf808000u, 0x00000000u, 0x80000000u,
                                0x00000001u, 0x007fffffu, 0x7f7fffffu, 0xff7fffffu, 0x7f800000u, 0xff800000u,
                                0x7fc00000u, 0xffc00001u, 0x7f800001u, 0x7fbfffffu};
  for (uint32_t i = 0; i < 300000; ++i) bits.push_back(i * 2654435761u);
  std::vector<float> in(bits.size());
  std::memcpy(in.data(), bits.data(), bits.size() * 4);
  std::vector<bf16> out(in.size());
  f32_to_bf16(out.data(), in.data(), int64_t(in.size()));
  int64_t differ = 0;
  for (size_t i = 0; i < in.size(); ++i) differ += out[i].bits != f32_to_bf16(in[i]).bits;
  EXPECT_EQ(differ, 0);
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
