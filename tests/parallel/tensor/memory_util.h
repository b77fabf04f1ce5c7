// The saved-activation closed forms of memory_comm_test.cpp, checked against the pools of a
// model::GPT over tp / cp groups at any config (the default suite uses a small width, the long suite GPT-2 124M).
#pragma once
#include "model/config.h"

namespace loom::testing_tp {

struct MemCase {
  int tp, cp;
  bool sp;
};

// Bytes of one transformer layer's saved activations by the closed form (see the test file).
double layer_formula(double s, double b, double h, double a, int t, bool sp);
// Runs tp * cp ranks, one forward at [1, S], and checks the pools' activation bytes exactly.
void check_activation_formula(const model::GPTConfig& cfg, const MemCase& mc, int64_t S);

}  // namespace loom::testing_tp
