#include "parallel/tensor/vocab_parallel.h"

namespace loom::parallel::tp {

void vocab_cross_entropy(comm::Comm* g, Backend& be, float* losses, void* dlogits, const void* logits,
                         const int32_t* targets, float* stats, const VocabCEArgs& a) {
  const bool multi = g && g->size() > 1;
  using Pass = VocabCrossEntropy::Pass;
  VocabCrossEntropy op{.dtype = a.dtype, .losses = losses, .dlogits = dlogits, .logits = logits, .targets = targets,
                       .stats = stats, .dloss = a.dloss, .N = a.N, .Vs = a.Vs, .v0 = a.v0, .V = a.V};
  op.pass = Pass::max;
  be.vocab_crossentropy(op);
  if (multi) g->all_reduce(stats, a.N, DType::f32, comm::ReduceOp::max);
  op.pass = Pass::sums;
  be.vocab_crossentropy(op);
  if (multi) g->all_reduce(stats + a.N, 2 * a.N, DType::f32);
  op.pass = Pass::finish;
  be.vocab_crossentropy(op);
}

}  // namespace loom::parallel::tp
