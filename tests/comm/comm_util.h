// Checks shared by the threads tests and the MPI driver, so both backends are held to the same
// contract: each function runs one collective on `c` (every rank calls it) and throws loom::Error
// describing the first wrong element. Expected values are computed independently of the backends:
// deterministic inputs per (seed, rank, element), folded in the order comm.h documents.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "comm/comm.h"

namespace loom::comm::testing {

// Element i of rank r's input: a float with a spread of exponents, so sums depend on their order.
float input_value(uint64_t seed, int rank, int64_t i);
// buf (f32 or bf16 [count]) = the inputs of `rank` (bf16: rounded).
void fill_input(void* buf, DType dt, int64_t count, uint64_t seed, int rank);
// out (dt) [end - begin] = elements [begin, end) of the reduction over n ranks of the inputs,
// folded in the order owner+1, owner+2, ..., owner (mod n) as for a chunk owned by `owner`.
void expected_reduction(void* out, DType dt, int n, int owner, ReduceOp op, uint64_t seed, int64_t begin,
                        int64_t end);
uint64_t hash_bytes(const void* p, size_t bytes);
// Throws unless every rank of c passes the same hash.
void check_same_on_all_ranks(Comm& c, uint64_t hash, const std::string& what);

void check_all_reduce(Comm& c, int64_t count, DType dt, ReduceOp op, uint64_t seed);
// Equal chunks (count divisible by c.size()) and, with `uneven`, explicit counts; in place too.
void check_reduce_scatter(Comm& c, int64_t per_rank, DType dt, ReduceOp op, uint64_t seed, bool uneven);
void check_all_gather(Comm& c, int64_t per_rank, DType dt, uint64_t seed, bool uneven);
void check_broadcast(Comm& c, int64_t count, DType dt, int root, uint64_t seed);
// Ring exchanges with sendrecv and ordered send/recv pairs with several tags.
void check_point_to_point(Comm& c, int64_t count, DType dt, uint64_t seed);
// Splits by parity (reversed keys), checks ranks and an all_reduce inside each part.
void check_split(Comm& c, uint64_t seed);

struct CheckPlan {
  std::vector<int64_t> counts;
  std::vector<DType> dtypes{DType::f32, DType::bf16};
  uint64_t seed = 1;
};
// Every check above for every count and dtype of the plan.
void check_collectives(Comm& c, const CheckPlan& plan);

}  // namespace loom::comm::testing
