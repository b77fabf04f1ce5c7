// The device arena allocator and tagged device pools.
#include <gtest/gtest.h>

#include "core/tensor.h"
#include "cuda_test_util.h"
#include "kernels/cuda/allocator.cuh"

using namespace loom;
using namespace loom::test;

TEST(ArenaAllocator, CarvesReusesAndCoalesces) {
  LOOM_REQUIRE_GPU();
  cuda::ArenaAllocator a(size_t(1) << 20);
  void* p1 = a.allocate(1000);
  void* p2 = a.allocate(3000);
  void* p3 = a.allocate(100);
  EXPECT_EQ(a.arena_count(), 1u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(p1) % cuda::ArenaAllocator::kAlign, 0u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(p2) % cuda::ArenaAllocator::kAlign, 0u);
  // Memory is usable device memory.
  LOOM_CUDA_CHECK(cudaMemset(p2, 1, 3000));
  a.deallocate(p1, 1000);
  a.deallocate(p2, 3000);
  // The two freed neighbours coalesce: a 4000-byte request fits where they were.
  void* p4 = a.allocate(4000);
  EXPECT_EQ(p4, p1);
  // A request larger than an arena gets its own.
  void* big = a.allocate(size_t(3) << 20);
  EXPECT_EQ(a.arena_count(), 2u);
  EXPECT_GE(a.reserved_bytes(), (size_t(1) << 20) + (size_t(3) << 20));
  a.deallocate(big, size_t(3) << 20);
  a.release_unused();
  EXPECT_EQ(a.arena_count(), 1u);
  EXPECT_THROW(a.deallocate(reinterpret_cast<char*>(p3) + 256, 100), Error);
  EXPECT_THROW(a.deallocate(p3, 5000), Error);
  a.deallocate(p3, 100);
  a.deallocate(p4, 4000);
}

TEST(ArenaAllocator, OutOfMemoryIsAnError) {
  LOOM_REQUIRE_GPU();
  cuda::ArenaAllocator a(size_t(1) << 20);
  EXPECT_THROW(a.allocate(size_t(1) << 50), Error);
  void* p = a.allocate(512);  // still usable afterwards
  EXPECT_NE(p, nullptr);
  a.deallocate(p, 512);
}

TEST(DevicePool, TagsDeviceBytes) {
  LOOM_REQUIRE_GPU();
  MemoryPool& pool = cuda::device_pool();
  EXPECT_EQ(pool.device(), Device::cuda);
  const int64_t act0 = pool.current(MemTag::activations);
  {
    Tensor t = Tensor::empty({128, 64}, DType::bf16, MemTag::activations, pool);
    EXPECT_EQ(t.device(), Device::cuda);
    EXPECT_EQ(pool.current(MemTag::activations) - act0, 128 * 64 * 2);
    cudaPointerAttributes attr{};
    LOOM_CUDA_CHECK(cudaPointerGetAttributes(&attr, t.raw()));
    EXPECT_EQ(attr.type, cudaMemoryTypeDevice) << "plain device memory, never managed";
  }
  EXPECT_EQ(pool.current(MemTag::activations), act0);
}
