// The data-parallel path of `loom bench train` (taken when --dp > 1, --zero > 0 or --offload).
#pragma once
#include <cstdint>
#include <string>

namespace loom::cli {

struct BenchDpOptions {
  std::string model = "gpt2-tiny";
  int dp = 2, zero = 0, steps = 10, warmup = 2;
  int64_t batch = 8, seq = 64;
  double bucket_mb = 25;
  bool offload = false;
  std::string trace;
};

int bench_train_dp(const BenchDpOptions& o);

}  // namespace loom::cli
