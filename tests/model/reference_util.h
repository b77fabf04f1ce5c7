// Compares loom's GPT with a PyTorch reference dump written by scripts/torch_reference.py.
#pragma once
#include <string>

#include "core/memory.h"

namespace loom::test {

struct ReferenceTolerance {
  double loss_rel = 1e-5;       // |loss - ref| / |ref|
  double logits_rel = 1e-5;     // ||l - ref|| / ||ref||
  double grad_rel = 1e-4;       // ||g - ref|| / ||ref||, every parameter
  double grad_norm_rel = 1e-4;  // |norm - ref| / ref, the global gradient norm
  double step_loss_abs = 1e-4;  // |loss_i - ref_i| for each AdamW step
};

// Loads the dump's weights into a fresh model on a backend of `device`, checks loss, logits, every
// gradient and the losses of the dump's AdamW steps (the optimizer each device's trainer runs:
// optim::AdamW on the CPU, train::StepRunner's multi-tensor AdamW, as CUDA graphs, elsewhere) with
// GoogleTest assertions, and prints the errors it measured.
void check_gpt_reference(const std::string& path, const ReferenceTolerance& tol, Device device = Device::cpu);

// The format version this loom reads (the dump's __metadata__ "version").
inline constexpr const char* kReferenceVersion = "1";

}  // namespace loom::test
