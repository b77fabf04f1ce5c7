// Element loops the backends share, so the threads and mpi backends reduce with the same
// arithmetic: accumulate in f32, combine as acc = op(acc, x), round bf16 once at the end.
// max propagates NaN (a NaN input makes the result NaN).
#pragma once
#include <cstdint>

#include "comm/comm.h"
#include "core/dtype.h"

namespace loom::comm::detail {

// acc f32 [n] = widen(x) (x: f32 or bf16 [n]).
void load_f32(float* acc, const void* x, DType dt, int64_t n);
// acc f32 [n] = op(acc, widen(x)).
void fold(float* acc, const void* x, DType dt, int64_t n, ReduceOp op);
// out f32 [n] = op(widen(a), widen(b)); a has dtype adt, b dtype bdt. out may alias a.
void combine(float* out, const void* a, DType adt, const void* b, DType bdt, int64_t n, ReduceOp op);
// out (f32 or bf16) [n] = acc, rounded to bf16 (nearest even) when dt is bf16.
void store_f32(void* out, DType dt, const float* acc, int64_t n);

}  // namespace loom::comm::detail
