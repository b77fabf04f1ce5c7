// Counter-based random numbers (Philox4x32-10). A value is a pure function of (seed, stream,
// index), so any shard of a tensor can draw exactly its own elements of the full tensor, and
// dropout masks or data order never depend on the parallel layout.
#pragma once
#include <array>
#include <cstdint>
#include <string_view>

namespace loom {

// Four independent 32-bit words for counter (stream, index) under key seed.
std::array<uint32_t, 4> philox4x32(uint64_t seed, uint64_t stream, uint64_t index);

// A stable 64-bit hash of a name (FNV-1a), used as the stream of a named parameter.
uint64_t stream_of(std::string_view name);

// Uniform in [0, 1) and standard normal, as pure functions of (seed, stream, index).
float uniform_at(uint64_t seed, uint64_t stream, uint64_t index);
// The same draw in double precision: 53 random bits in [0, 1) (uniform_at rounds it to a float,
// which is 1 for the top 2^-25 of the interval).
double uniform_double_at(uint64_t seed, uint64_t stream, uint64_t index);
float normal_at(uint64_t seed, uint64_t stream, uint64_t index);

// Fill out[i] = mean + std * normal_at(seed, stream, first + i), i in [0, n).
void fill_normal(float* out, int64_t n, float mean, float std, uint64_t seed, uint64_t stream, uint64_t first);
void fill_uniform(float* out, int64_t n, float lo, float hi, uint64_t seed, uint64_t stream, uint64_t first);

}  // namespace loom
