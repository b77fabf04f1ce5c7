// Saved activations of GPT-2 124M's shapes (n_embd 768, 12 heads, vocabulary 50257; two layers,
// s = 64) against the closed forms stated in memory_comm_test.cpp, measured by the pools.
#include <gtest/gtest.h>

#include "parallel/tensor/memory_util.h"

using namespace loom;
using testing_tp::MemCase;

class ActivationMemory124M : public testing::TestWithParam<MemCase> {};

TEST_P(ActivationMemory124M, FollowsTheClosedForm) {
  model::GPTConfig cfg = model::gpt_preset("gpt2-124m");
  cfg.n_layer = 2;  // the formula is per layer; two layers keep the run short
  testing_tp::check_activation_formula(cfg, GetParam(), 64);
}

INSTANTIATE_TEST_SUITE_P(Layouts, ActivationMemory124M,
                         testing::Values(MemCase{1, 1, false}, MemCase{2, 1, false}, MemCase{4, 1, false},
                                         MemCase{2, 1, true}, MemCase{4, 1, true}, MemCase{1, 2, false},
                                         MemCase{2, 2, true}));
