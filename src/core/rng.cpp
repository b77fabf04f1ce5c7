#include "core/rng.h"

#include <cmath>

namespace loom {

std::array<uint32_t, 4> philox4x32(uint64_t seed, uint64_t stream, uint64_t index) {
  uint32_t c0 = uint32_t(index), c1 = uint32_t(index >> 32), c2 = uint32_t(stream), c3 = uint32_t(stream >> 32);
  uint32_t k0 = uint32_t(seed), k1 = uint32_t(seed >> 32);
  constexpr uint32_t M0 = 0xD2511F53u, M1 = 0xCD9E8D57u, W0 = 0x9E3779B9u, W1 = 0xBB67AE85u;
  for (int r = 0; r < 10; ++r) {
    uint64_t p0 = uint64_t(M0) * c0, p1 = uint64_t(M1) * c2;
    uint32_t n0 = uint32_t(p1 >> 32) ^ c1 ^ k0, n1 = uint32_t(p1);
    uint32_t n2 = uint32_t(p0 >> 32) ^ c3 ^ k1, n3 = uint32_t(p0);
    c0 = n0; c1 = n1; c2 = n2; c3 = n3;
    k0 += W0; k1 += W1;
  }
  return {c0, c1, c2, c3};
}

uint64_t stream_of(std::string_view name) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char ch : name) { h ^= ch; h *= 1099511628211ull; }
  return h;
}

static inline double u01(uint32_t a, uint32_t b) {
  // 53-bit uniform in [0, 1)
  uint64_t x = (uint64_t(a) << 21) ^ uint64_t(b);
  x &= (1ull << 53) - 1;
  return double(x) * (1.0 / 9007199254740992.0);
}

float uniform_at(uint64_t seed, uint64_t stream, uint64_t index) {
  return float(uniform_double_at(seed, stream, index));
}

double uniform_double_at(uint64_t seed, uint64_t stream, uint64_t index) {
  auto r = philox4x32(seed, stream, index);
  return u01(r[0], r[1]);
}

float normal_at(uint64_t seed, uint64_t stream, uint64_t index) {
  auto r = philox4x32(seed, stream, index);
  double u1 = 1.0 - u01(r[0], r[1]);  // (0, 1]
  double u2 = u01(r[2], r[3]);
  return float(std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2));
}

void fill_normal(float* out, int64_t n, float mean, float std, uint64_t seed, uint64_t stream, uint64_t first) {
#pragma omp parallel for schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) out[i] = mean + std * normal_at(seed, stream, first + uint64_t(i));
}

void fill_uniform(float* out, int64_t n, float lo, float hi, uint64_t seed, uint64_t stream, uint64_t first) {
#pragma omp parallel for schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) out[i] = lo + (hi - lo) * uniform_at(seed, stream, first + uint64_t(i));
}

}  // namespace loom
