// Tokens/s and bytes communicated per training step of tp=2, tp=2+sp and cp=2 against dp=2 on
// the threads backend (two ranks as threads of this process), for a small GPT:
//
//   bench_parallel [--layers 4 --embd 256 --heads 8 --vocab 8192 --batch 4 --seq 256 --steps 5]
//
// Each layout trains the same global batch [batch, seq] per step (dp splits the batch, cp the
// sequence, tp the layers). Bytes are what each rank would send with ring algorithms
// (parallel::CountingComm), beside the Megatron formula 8 b s h (t-1)/t per layer (x 4 bytes).
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "comm/threads.h"
#include "core/rng.h"
#include "model/gpt.h"
#include "parallel/data/flat_layout.h"
#include "parallel/data/data_parallel.h"
#include "parallel/mesh.h"
#include "parallel/tensor/counting_comm.h"

using namespace loom;

namespace {

struct Layout {
  const char* name;
  int dp, cp, tp;
  bool sp;
};

struct Args {
  int64_t layers = 4, embd = 256, heads = 8, vocab = 8192, batch = 4, seq = 256;
  int steps = 5;
};

}  // namespace

int main(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    const int64_t v = std::atoll(argv[i + 1]);
    if (k == "--layers") a.layers = v;
    else if (k == "--embd") a.embd = v;
    else if (k == "--heads") a.heads = v;
    else if (k == "--vocab") a.vocab = v;
    else if (k == "--batch") a.batch = v;
    else if (k == "--seq") a.seq = v;
    else if (k == "--steps") a.steps = int(v);
    else {
      std::fprintf(stderr, "bench_parallel: unknown option %s\n", k.c_str());
      return 2;
    }
  }
  model::GPTConfig cfg = model::gpt_preset("gpt2-tiny");
  cfg.name = "bench";
  cfg.n_layer = a.layers, cfg.n_embd = a.embd, cfg.n_head = a.heads, cfg.vocab_size = a.vocab;
  cfg.block_size = a.seq;
  std::printf("model: %s, global batch [%lld, %lld], %d timed steps after 1 warm-up, 2 ranks\n", cfg.str().c_str(),
              (long long)a.batch, (long long)a.seq, a.steps);
  std::printf("%-10s %12s %16s %16s %22s\n", "layout", "tokens/s", "tp bytes/step", "cp+dp bytes/step",
              "8bsh(t-1)/t*4*L bytes");
  for (const Layout& l : {Layout{"dp=2", 2, 1, 1, false}, Layout{"tp=2", 1, 1, 2, false},
                          Layout{"tp=2+sp", 1, 1, 2, true}, Layout{"cp=2", 1, 2, 1, false}}) {
    double seconds = 0, tp_bytes = 0, other_bytes = 0;
    comm::run_ranks(2, [&](comm::Comm& world) {
      parallel::MeshComms mc(parallel::Mesh::standard(1, l.dp, l.cp, l.tp), world);
      parallel::CountingComm tpc(mc["tp"]), cpc(mc["cp"]), dpc(mc["dp"]), dcpc(mc.get({"dp", "cp"}));
      MemoryPool pool("rank");
      model::GPT m(cfg, pool, 1337, {.groups = {&tpc, &cpc}, .sp = l.sp});
      // The data-parallel reduction over dp x cp: cp partial sums added, dp replicas averaged (each
      // rank's loss scaled by 1 / dp); a parameter replicated over tp counts on tp rank 0. Every
      // reduction at the end of the backward (no overlap), as the collectives are what is counted.
      parallel::DataParallelOptions dpo;
      dpo.overlap = false;
      dpo.norm_group = &tpc;
      for (const model::Parameter* p : m.parameters()) dpo.in_norm.push_back(p->shard.split || mc.coord("tp") == 0);
      parallel::DataParallel opt(m, dcpc, {}, dpo);
      const int64_t Bl = a.batch / l.dp;
      Tensor tok = Tensor::empty({Bl, a.seq}, DType::i32, MemTag::workspace, pool);
      Tensor tgt = Tensor::empty({Bl, a.seq}, DType::i32, MemTag::workspace, pool);
      for (int64_t i = 0; i < tok.numel(); ++i) {
        tok.i32()[i] = int32_t(uniform_at(uint64_t(mc.coord("dp")), 1, uint64_t(i)) * float(a.vocab));
        tgt.i32()[i] = int32_t(uniform_at(uint64_t(mc.coord("dp")), 2, uint64_t(i)) * float(a.vocab));
      }
      auto step = [&] {
        opt.zero_grad();
        m.forward(tok, tgt, {.fuse_backward = true, .dloss_scale = 1.0f / float(l.dp)});
        m.backward();
        opt.step(-1.0);
      };
      step();
      world.barrier();
      tpc.reset(), cpc.reset(), dpc.reset(), dcpc.reset();
      const auto t0 = std::chrono::steady_clock::now();
      for (int s = 0; s < a.steps; ++s) step();
      world.barrier();
      const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (world.rank() == 0) {
        seconds = dt;
        tp_bytes = tpc.counts().wire_bytes / a.steps;
        other_bytes = (cpc.counts().wire_bytes + dpc.counts().wire_bytes + dcpc.counts().wire_bytes) / a.steps;
      }
    });
    const double t = l.tp, formula = l.tp > 1 ? 4.0 * 8 * a.batch * a.seq * a.embd * (t - 1) / t * a.layers : 0;
    std::printf("%-10s %12.0f %16.0f %16.0f %22.0f\n", l.name, double(a.batch * a.seq * a.steps) / seconds, tp_bytes,
                other_bytes, formula);
  }
  return 0;
}
