// Saved activations and tensor-parallel traffic against closed forms.
//
// Saved activations per transformer layer, bytes, loom's f32 kernels (s sequence, b batch, h
// hidden, a heads, t tensor-parallel size; Korthikanti et al. 2022 give the 16-bit forms with
// dropout masks and the materialised attention matrix 5as/h; loom keeps no dropout and a
// flash-style attention whose only per-head activation is the log-sum-exp, a s b floats):
//
//   no parallelism   4 s b h (16 + 4/h + a/h)                     [paper: sbh(34 + 5as/h)]
//   tp               4 s b h (4 + 12/t + 4/h + a/(h t))           [paper: sbh(10 + 24/t + 5as/(ht))]
//   tp + sp          4 s b h (16 + 4/h + a/h) / t                 [paper: sbh(34 + 5as/h) / t]
//   cp               the same with s / cp
//
// (16 = ln1, res2, ln2, out (4) + qkv 3, atty 1, fch 4, fch_gelu 4; 4/h = the two LayerNorms'
// mean and rstd.) Embedding: 4 s b (tokens) + 4 s b h / t_sp; head: 4 s b (h + 2) / t_sp
// (ln_f and its statistics) + 4 s b (Vp / t + 1) (logits shard, losses) + 4 s b (targets), with
// t_sp = t under sp and 1 otherwise. The test measures the pools' activation bytes after forward.
//
// Traffic on the tp group during forward + backward, elements (x 4 bytes), N = s b tokens:
//   tp        (t-1)/t (N h (8 L + 4) + 6 N)   : 8 N h (t-1)/t per layer (4 all-reduces)
//   tp + sp   (t-1)/t (N h (10 L + 5) + 6 N)  : 10 N h (t-1)/t per layer: the 8 of tp as
//             all-gathers and reduce-scatters, plus the two all-gathers that recompute the
//             gathered LayerNorm outputs in backward instead of keeping them.
// (+4 N h + 6 N, resp. 5 N h + 6 N: embedding, lm_head input and the cross-entropy statistics.)
#include <gtest/gtest.h>
#include <omp.h>

#include "comm/threads.h"
#include "core/backend.h"
#include "core/dtype.h"
#include "core/rng.h"
#include "model/gpt.h"
#include "parallel/mesh.h"
#include "parallel/tensor/counting_comm.h"
#include "parallel/tensor/memory_util.h"

using namespace loom;

namespace {

comm::RunOptions one_thread() {
  comm::RunOptions o;
  o.threads_per_rank = 1;
  return o;
}

void fill_batch(Tensor& tok, int64_t V) {
  for (int64_t i = 0; i < tok.numel(); ++i) tok.i32()[i] = int32_t(uniform_at(7, 1, uint64_t(i)) * float(V));
}

using testing_tp::MemCase;

class ActivationMemory : public testing::TestWithParam<MemCase> {};

// The closed forms at a small width (the long suite checks GPT-2 124M's shapes).
TEST_P(ActivationMemory, SmallModelFollowsTheClosedForm) {
  model::GPTConfig cfg = model::gpt_preset("gpt2-tiny");
  cfg.name = "small";
  cfg.n_embd = 128;
  cfg.n_head = 4;
  testing_tp::check_activation_formula(cfg, GetParam(), 64);
}

INSTANTIATE_TEST_SUITE_P(Layouts, ActivationMemory,
                         testing::Values(MemCase{1, 1, false}, MemCase{2, 1, false}, MemCase{4, 1, false},
                                         MemCase{2, 1, true}, MemCase{4, 1, true}, MemCase{1, 2, false},
                                         MemCase{2, 2, true}));

// A tp rank's workspace peak over two training steps equals what its model declares
// (GPT::workspace_bytes), with and without sp, in f32 and, where the CPU has bf16 dot products,
// with the linear layers' products in bf16 (the backend's bf16 copies and oneDNN's scratch: c_proj's
// bias on tp rank 0 only).
TEST(TensorParallelMemory, WorkspacePeakEqualsTheDeclaration) {
  const model::GPTConfig cfg = model::gpt_preset("gpt2-tiny");
  const int64_t B = 2, T = 32;
  std::vector<DType> matmuls{DType::f32};
  if (cpu_bf16_missing().empty()) matmuls.push_back(DType::bf16);
  for (DType mm : matmuls)
    for (bool sp : {false, true}) {
      comm::run_ranks(2, [&](comm::Comm& c) {
        MemoryPool pool("rank"), io("io");
        auto be = make_backend(Device::cpu, {.pool = &pool, .matmul = mm});
        model::GPT m(cfg, *be, 1337, {.groups = {&c, nullptr}, .sp = sp});
        Tensor tok = Tensor::empty({B, T}, DType::i32, MemTag::workspace, io);
        fill_batch(tok, cfg.vocab_size);
        for (int step = 0; step < 2; ++step) {
          m.zero_grad();
          m.forward(tok, tok, {.fuse_backward = true});
          m.backward();
        }
        EXPECT_EQ(pool.peak(MemTag::workspace), m.workspace_bytes(B, T, omp_get_max_threads()))
            << dtype_name(mm) << " matmuls, sp=" << sp << ", tp rank " << c.rank();
      }, one_thread());
    }
}

TEST(TensorParallelTraffic, BytesPerStepFollowTheClosedForm) {
  model::GPTConfig cfg = model::gpt_preset("gpt2-tiny");
  const int64_t B = 2, T = 64;
  for (int t : {2, 4})
    for (bool sp : {false, true}) {
      comm::run_ranks(t, [&](comm::Comm& c) {
        parallel::CountingComm tpc(c);
        MemoryPool pool("rank");
        model::GPT m(cfg, pool, 1337, {.groups = {&tpc, nullptr}, .sp = sp});
        Tensor tok = Tensor::empty({B, T}, DType::i32, MemTag::workspace, pool);
        fill_batch(tok, cfg.vocab_size);
        tpc.reset();
        m.forward(tok, tok, {.fuse_backward = true});
        m.backward();
        const double N = double(B * T), h = double(cfg.n_embd), L = double(cfg.n_layer), f = (t - 1.0) / t;
        const double elems = sp ? f * (N * h * (10 * L + 5) + 6 * N) : f * (N * h * (8 * L + 4) + 6 * N);
        EXPECT_NEAR(tpc.counts().wire_bytes, 4 * elems, 1e-9 * elems) << "t=" << t << " sp=" << sp;
        if (c.rank() == 0)
          std::printf("  t=%d sp=%d: %.0f bytes per step on the wire per rank; per layer 8bsh(t-1)/t = %.0f bytes\n", t,
                      sp, tpc.counts().wire_bytes, 4 * 8 * N * h * f);
      }, one_thread());
    }
}

}  // namespace
