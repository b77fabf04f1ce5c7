#include "comm/reduce.h"

#include <cstring>

namespace loom::comm::detail {

namespace {

inline float widen(float x) { return x; }
inline float widen(bf16 x) { return bf16_to_f32(x); }

inline float apply(float acc, float x, ReduceOp op) {
  if (op == ReduceOp::sum) return acc + x;
  return (x > acc || x != x) ? x : acc;
}

template <class A, class B>
void combine_t(float* out, const A* a, const B* b, int64_t n, ReduceOp op) {
  if (op == ReduceOp::sum) {
    for (int64_t i = 0; i < n; ++i) out[i] = widen(a[i]) + widen(b[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) out[i] = apply(widen(a[i]), widen(b[i]), ReduceOp::max);
  }
}

template <class A>
void combine_a(float* out, const A* a, const void* b, DType bdt, int64_t n, ReduceOp op) {
  if (bdt == DType::f32) {
    combine_t(out, a, static_cast<const float*>(b), n, op);
  } else {
    combine_t(out, a, static_cast<const bf16*>(b), n, op);
  }
}

}  // namespace

void load_f32(float* acc, const void* x, DType dt, int64_t n) {
  if (dt == DType::f32) {
    std::memcpy(acc, x, size_t(n) * 4);
  } else {
    const bf16* xb = static_cast<const bf16*>(x);
    for (int64_t i = 0; i < n; ++i) acc[i] = bf16_to_f32(xb[i]);
  }
}

void fold(float* acc, const void* x, DType dt, int64_t n, ReduceOp op) {
  combine(acc, acc, DType::f32, x, dt, n, op);
}

void combine(float* out, const void* a, DType adt, const void* b, DType bdt, int64_t n, ReduceOp op) {
  if (adt == DType::f32) {
    combine_a(out, static_cast<const float*>(a), b, bdt, n, op);
  } else {
    combine_a(out, static_cast<const bf16*>(a), b, bdt, n, op);
  }
}

void store_f32(void* out, DType dt, const float* acc, int64_t n) {
  if (dt == DType::f32) {
    if (out != acc) std::memmove(out, acc, size_t(n) * 4);
  } else {
    bf16* ob = static_cast<bf16*>(out);
    for (int64_t i = 0; i < n; ++i) ob[i] = f32_to_bf16(acc[i]);
  }
}

}  // namespace loom::comm::detail
