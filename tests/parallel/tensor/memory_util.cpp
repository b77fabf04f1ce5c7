#include "parallel/tensor/memory_util.h"

#include <gtest/gtest.h>

#include "comm/threads.h"
#include "core/rng.h"
#include "model/gpt.h"
#include "parallel/mesh.h"

namespace loom::testing_tp {

double layer_formula(double s, double b, double h, double a, int t, bool sp) {
  if (sp) return 4 * s * b * h * (16 + 4 / h + a / h) / t;
  return 4 * s * b * h * (4 + 12.0 / t + 4 / h + a / (h * t));
}

void check_activation_formula(const model::GPTConfig& cfg, const MemCase& mc, int64_t S) {
  const int64_t b = 1;
  comm::RunOptions one;
  one.threads_per_rank = 1;
  comm::run_ranks(mc.tp * mc.cp, [&](comm::Comm& c) {
    parallel::MeshComms comms(parallel::Mesh::standard(1, 1, mc.cp, mc.tp), c);
    MemoryPool pool("rank");
    model::GPT m(cfg, pool, 1337, {.groups = {&comms["tp"], &comms["cp"]}, .sp = mc.sp});
    Tensor tok = Tensor::empty({b, S}, DType::i32, MemTag::workspace, pool);
    for (int64_t i = 0; i < tok.numel(); ++i)
      tok.i32()[i] = int32_t(uniform_at(7, 1, uint64_t(i)) * float(cfg.vocab_size));
    m.forward(tok, tok);
    const double s = double(S) / mc.cp, h = double(cfg.n_embd), a = double(cfg.n_head);
    const int tsp = mc.sp ? mc.tp : 1;
    const double Vs = double(m.parallel().vocab_rows(cfg));
    const double expect = 4 * s * b + 4 * s * b * h / tsp +
                          double(cfg.n_layer) * layer_formula(s, b, h, a, mc.tp, mc.sp) +
                          4 * s * b * (h + 2) / tsp + 4 * s * b * (Vs + 1) + 4 * s * b;
    EXPECT_EQ(double(pool.current(MemTag::activations)), expect);
    EXPECT_EQ(pool.current(MemTag::activations), m.saved_activation_bytes(b, S));
    EXPECT_EQ(double(m.block(0).saved_activation_bytes(b, S)), layer_formula(s, b, h, a, mc.tp, mc.sp));
    if (mc.sp) {  // Korthikanti's tp + sp claim: every per-layer activation divided by t
      EXPECT_EQ(double(m.block(0).saved_activation_bytes(b, S)) * mc.tp, layer_formula(s, b, h, a, 1, false));
    }
    if (c.rank() == 0)
      std::printf("  %s tp=%d cp=%d sp=%d: per layer %s, total saved activations %s per rank\n", cfg.name.c_str(),
                  mc.tp, mc.cp, int(mc.sp), format_bytes(m.block(0).saved_activation_bytes(b, S)).c_str(),
                  format_bytes(pool.current(MemTag::activations)).c_str());
  }, one);
}

}  // namespace loom::testing_tp
