// The Llama family's element-wise kernels on the GPU (kernels/cuda/llama.cuh): each vector kernel
// (16-byte accesses) against the element kernel (any alignment, chosen here by an 8-byte aligned
// buffer), which must give the same bits; both against double. The backend parity suite checks
// small shapes against the CPU ops; here the model's shapes.
//   RoPE: SmolLM-135M's query and key heads in one qkv row (9 + 3 heads of 64 in a row of 960),
//   rows that leave the last block part-filled, explicit positions (context parallelism's) and the
//   inverse.
//   SwiGLU: SmolLM's and TinyLlama's widths (1536; 5632, more groups of 8 columns than a block
//   has threads) and small ones, the backward also in place (dinp = inp, as the model calls it).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "core/backend.h"
#include "cuda_test_util.h"
#include "kernels/cuda/llama.cuh"

using namespace loom;
using namespace loom::test;

namespace {

struct RopeCase {
  int64_t B, T, NH, HS, stride, pos0;
  bool positions, inverse;
};

// x [B T, stride] at `offset` elements into a buffer (an offset of 4 leaves it 8-byte aligned: the
// element kernel), rotated once; returns the B T stride elements.
std::vector<dbf16> rotated(const RopeCase& c, const std::vector<dbf16>& x, int64_t offset,
                           const std::vector<double>& inv, const DeviceBuffer<int32_t>* pos) {
  DeviceBuffer<dbf16> buf(x.size() + size_t(offset));
  std::vector<dbf16> host(buf.size());
  std::memcpy(static_cast<void*>(host.data() + offset), x.data(), x.size() * sizeof(dbf16));
  buf.upload(host);
  cuda::rope(buf.get() + offset, c.B, c.T, c.NH, c.HS, c.stride, inv.data(), c.pos0, pos ? pos->get() : nullptr,
             c.inverse, nullptr);
  const auto all = buf.download();
  return std::vector<dbf16>(all.begin() + offset, all.end());
}

TEST(CudaRope, VectorAndElementKernelsAgreeBitForBit) {
  LOOM_REQUIRE_GPU();
  const RopeCase cases[] = {
      {2, 1024, 12, 64, 960, 0, false, false},  // SmolLM-135M: q and k of one qkv row
      {2, 1024, 12, 64, 960, 0, false, true},   // its backward
      {3, 37, 4, 128, 1024, 5, false, false},   // head size 128; 111 rows: the last block part-filled
      {1, 50, 2, 16, 48, 1000, false, false},   // the smallest vector head; a late start
      {2, 64, 6, 64, 512, 0, true, false},      // explicit positions (a context-parallel chunk)
      {1, 9, 3, 256, 1024, 3, false, true},     // the largest head: two rows per block
  };
  for (const RopeCase& c : cases) {
    SCOPED_TRACE(::testing::Message() << "B=" << c.B << " T=" << c.T << " NH=" << c.NH << " HS=" << c.HS
                                      << " stride=" << c.stride << (c.positions ? " positions" : "")
                                      << (c.inverse ? " inverse" : ""));
    const std::vector<float> xf = random_bf16_values(size_t(c.B * c.T * c.stride), 31);
    const std::vector<dbf16> x = to_device_bf16(xf);
    const std::vector<double> inv = rope_inv_freq(c.HS, 10000.0);
    std::vector<int32_t> positions(static_cast<size_t>(c.T));
    for (int64_t t = 0; t < c.T; ++t) positions[size_t(t)] = int32_t(3 * t + 17);  // not pos0 + t
    DeviceBuffer<int32_t> dpos(positions.size());
    dpos.upload(positions);
    const DeviceBuffer<int32_t>* pos = c.positions ? &dpos : nullptr;
    const auto vec = rotated(c, x, 0, inv, pos), elem = rotated(c, x, 4, inv, pos);
    int64_t differ = 0;
    for (size_t i = 0; i < vec.size(); ++i) differ += std::memcmp(&vec[i], &elem[i], sizeof(dbf16)) != 0;
    EXPECT_EQ(differ, 0) << "elements where the two kernels differ";
    // Against double: rotated heads within one bf16 rounding (2^-8 relative, on norms of pairs),
    // the rest of the row (value heads, padding) untouched.
    const std::vector<float> got = from_device_bf16(vec);
    double err = 0, ref = 0;
    int64_t moved = 0;
    for (int64_t r = 0; r < c.B * c.T; ++r) {
      const int64_t t = r % c.T;
      const double p = c.positions ? double(positions[size_t(t)]) : double(c.pos0 + t);
      for (int64_t h = 0; h < c.NH; ++h)
        for (int64_t i = 0; i < c.HS / 2; ++i) {
          const size_t lo = size_t(r * c.stride + h * c.HS + i), hi = lo + size_t(c.HS / 2);
          const double a = p * inv[size_t(i)], s = c.inverse ? -std::sin(a) : std::sin(a), co = std::cos(a);
          const double w0 = xf[lo] * co - xf[hi] * s, w1 = xf[hi] * co + xf[lo] * s;
          err += (got[lo] - w0) * (got[lo] - w0) + (got[hi] - w1) * (got[hi] - w1);
          ref += w0 * w0 + w1 * w1;
        }
      for (int64_t e = c.NH * c.HS; e < c.stride; ++e)
        moved += std::memcmp(&vec[size_t(r * c.stride + e)], &x[size_t(r * c.stride + e)], sizeof(dbf16)) != 0;
    }
    EXPECT_LE(std::sqrt(err / ref), 4e-3);
    EXPECT_EQ(moved, 0) << "elements outside the rotated heads changed";
  }
}

// SwiGLU forward and backward at `offset` elements into their buffers.
struct SwigluOut {
  std::vector<dbf16> out, din;
};
SwigluOut swiglu(const std::vector<dbf16>& gu, const std::vector<dbf16>& dy, int64_t N, int64_t H, int64_t offset) {
  const auto place = [&](const std::vector<dbf16>& v) {
    std::vector<dbf16> h(v.size() + size_t(offset));
    std::memcpy(static_cast<void*>(h.data() + offset), v.data(), v.size() * sizeof(dbf16));
    return h;
  };
  DeviceBuffer<dbf16> dgu(gu.size() + size_t(offset)), ddy(dy.size() + size_t(offset)),
      dout(dy.size() + size_t(offset)), ddin(gu.size() + size_t(offset));
  dgu.upload(place(gu));
  ddy.upload(place(dy));
  dout.poison();
  ddin.poison();
  cuda::swiglu_forward(dout.get() + offset, dgu.get() + offset, N, H, nullptr);
  cuda::swiglu_backward(ddin.get() + offset, ddy.get() + offset, dgu.get() + offset, N, H, nullptr);
  const auto o = dout.download(), d = ddin.download();
  SwigluOut r{std::vector<dbf16>(o.begin() + offset, o.end()), std::vector<dbf16>(d.begin() + offset, d.end())};
  // In place: the gradient over the forward's input.
  cuda::swiglu_backward(dgu.get() + offset, ddy.get() + offset, dgu.get() + offset, N, H, nullptr);
  const auto in_place = dgu.download();
  int64_t differ = 0;
  for (size_t i = 0; i < r.din.size(); ++i)
    differ += std::memcmp(&in_place[i + size_t(offset)], &r.din[i], sizeof(dbf16)) != 0;
  EXPECT_EQ(differ, 0) << "elements where the backward in place differs (offset " << offset << ")";
  return r;
}

TEST(CudaSwiglu, VectorAndElementKernelsAgreeBitForBit) {
  LOOM_REQUIRE_GPU();
  const std::pair<int64_t, int64_t> shapes[] = {{333, 1536}, {20, 5632}, {7, 8}, {65, 264}, {3, 2048}};
  for (const auto& [N, H] : shapes) {
    SCOPED_TRACE(::testing::Message() << "N=" << N << " H=" << H);
    const std::vector<float> guf = random_bf16_values(size_t(N * 2 * H), 41, 3.f),
                             dyf = random_bf16_values(size_t(N * H), 42);
    const std::vector<dbf16> gu = to_device_bf16(guf), dy = to_device_bf16(dyf);
    const SwigluOut vec = swiglu(gu, dy, N, H, 0), elem = swiglu(gu, dy, N, H, 4);
    int64_t differ = 0;
    for (size_t i = 0; i < vec.out.size(); ++i) differ += std::memcmp(&vec.out[i], &elem.out[i], sizeof(dbf16)) != 0;
    for (size_t i = 0; i < vec.din.size(); ++i) differ += std::memcmp(&vec.din[i], &elem.din[i], sizeof(dbf16)) != 0;
    EXPECT_EQ(differ, 0) << "elements where the two kernels differ";
    // Against double (within one bf16 rounding, on norms; NaN-poisoned outputs fail).
    const std::vector<float> out = from_device_bf16(vec.out), din = from_device_bf16(vec.din);
    double eo = 0, ro = 0, ed = 0, rd = 0;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t j = 0; j < H; ++j) {
        const double g = guf[size_t(n * 2 * H + j)], u = guf[size_t(n * 2 * H + H + j)], d = dyf[size_t(n * H + j)];
        const double s = 1.0 / (1.0 + std::exp(-g));
        const double o = g * s * u, dg = d * u * s * (1.0 + g * (1.0 - s)), du = d * g * s;
        eo += std::pow(out[size_t(n * H + j)] - o, 2);
        ro += o * o;
        ed += std::pow(din[size_t(n * 2 * H + j)] - dg, 2) + std::pow(din[size_t(n * 2 * H + H + j)] - du, 2);
        rd += dg * dg + du * du;
      }
    EXPECT_LE(std::sqrt(eo / ro), 4e-3);
    EXPECT_LE(std::sqrt(ed / rd), 4e-3);
  }
}

}  // namespace
