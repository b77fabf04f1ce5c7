// A GPT's training step on its backend, run the way a device runs it fastest: the batch is checked
// and counted on the host, copied into fixed buffers of the backend's memory, and the step's ops
// (zero the gradients, forward with the fused loss gradient, backward, multi-tensor AdamW with
// global-norm clipping) are captured once as a graph where the backend can (CUDA graphs) and
// replayed every step; the mean loss is reduced on the device and read once per step.
//
// While the backend has an observer (Backend::set_observer: a step's breakdown by op) nothing
// runs as a graph, unless the observer can be captured with the ops (OpObserver::in_graph). The first call of each kind runs eagerly (it allocates the activations and scratch, plans the
// attention and tunes the GEMMs, none of which may happen in a capture); the next one captures.
// The loss gradient's scale (loss_scale / the counted targets) is part of the captured work, so a
// batch with another count of targets, or a step at another loss scale, is captured again.
//
// Loss scaling (train.precision fp16): train_step and accumulate take the loss scale S; the loss
// gradient is multiplied by S (the f16 activation gradients with it) and the update divides the
// f32 parameter gradients by S again before the norm, clipping and AdamW (its grad_scale), so the
// norm they return is the unscaled gradient's. A norm that is not finite means the scaled gradients
// overflowed: the update kernel then leaves parameters and moments as they were.
//
// AdamW moments are f32 tensors of each parameter's storage (tag optimizer) in the backend's
// memory, updated with the compute copies refreshed in the same pass.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/backend.h"
#include "core/tensor.h"
#include "model/gpt.h"

namespace loom::train {

struct StepOptions {
  int64_t B = 8, T = 1024;  // the micro-batch every call takes
  bool graphs = true;       // capture and replay where the backend can
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8;
  double weight_decay = 0.1;  // on parameters of two or more dimensions
  float grad_clip = 1.0f;     // global-norm clipping; <= 0 disables
};

class StepRunner {
 public:
  StepRunner(model::GPT& gpt, const StepOptions& opt);
  ~StepRunner();
  StepRunner(const StepRunner&) = delete;
  StepRunner& operator=(const StepRunner&) = delete;

  model::GPT& model() { return gpt_; }
  Backend& backend() { return be_; }
  const StepOptions& options() const { return opt_; }

  // tokens, targets: host i32 [B, T] (targets may hold -1: ignored); ids are checked.
  // The mean loss of a forward without gradients.
  float forward(const int32_t* tokens, const int32_t* targets);
  // Zeroes the gradients, forward and backward; no update. Returns the mean loss.
  float forward_backward(const int32_t* tokens, const int32_t* targets);
  // One optimizer step on the batch (gradients, clipping, AdamW at lr with bias correction for
  // `step`, 1-based). Returns the mean loss before the update.
  float train_step(const int32_t* tokens, const int32_t* targets, double lr, int64_t step, float loss_scale = 1.0f);
  // Gradient accumulation: zero_grad(), accumulate() per micro-batch (adds the gradient of its
  // mean loss, returns that loss), optimizer_step() with grad_scale (1 / k for the mean over k
  // micro-batches; the norm, clipping and update see the scaled gradient), which returns the
  // scaled gradient's norm before clipping. Between the last accumulate and optimizer_step the
  // gradients may be summed over replicas (Parameter::grad_full, ordered on the backend's queue).
  void zero_grad();
  float accumulate(const int32_t* tokens, const int32_t* targets, float loss_scale = 1.0f);
  float optimizer_step(double lr, int64_t step, float grad_scale = 1.0f);
  float last_grad_norm() const { return grad_norm_; }
  // Graph replays so far (what the steps ran as).
  int64_t graph_launches() const { return graph_launches_; }

  // Host f32 copies of a parameter's logical elements: its master weights, gradient and AdamW
  // moments (for checkpoints); the setters refresh what depends on them. Throw naming the name.
  std::vector<float> parameter(const std::string& name) const;
  std::vector<float> gradient(const std::string& name) const;
  std::vector<float> exp_avg(const std::string& name) const;
  std::vector<float> exp_avg_sq(const std::string& name) const;
  void set_parameter(const std::string& name, const float* values);
  void set_exp_avg(const std::string& name, const float* values);
  void set_exp_avg_sq(const std::string& name, const float* values);

 private:
  enum Kind { kStep, kMicro, kKinds };
  int64_t upload(const int32_t* tokens, const int32_t* targets);  // returns the counted targets
  void enqueue_micro();  // forward (fused loss gradient) and backward
  void enqueue(Kind k);
  void run(Kind k);  // eagerly, or captured once and replayed
  float read_loss();
  size_t index_of(const std::string& name) const;
  std::vector<float> get(const Tensor& t, int64_t n) const;
  void put(const Tensor& t, const float* values, int64_t n);

  model::GPT& gpt_;
  Backend& be_;
  StepOptions opt_;
  std::vector<model::Parameter*> params_;
  std::vector<Tensor> m_, v_;  // f32 moments of each parameter's storage (tag optimizer)
  std::unique_ptr<AdamWPlan> adamw_;
  Tensor tokens_, targets_;    // i32 [B, T] in the backend's memory (tag activations)
  Tensor loss_;                // f32 [1]
  int64_t counted_ = 0;
  std::unique_ptr<Graph> graphs_[kKinds];
  int64_t graph_counted_[kKinds] = {-1, -1};  // the count baked into each graph
  float graph_scale_[kKinds] = {0, 0};        // and the loss scale
  uint64_t graph_observer_sets_[kKinds] = {0, 0};  // and Backend::observer_sets() (the observer it holds)
  float loss_scale_ = 1.0f;                   // the loss scale of the step being enqueued
  // The backend's memory epoch and the model's activation epoch each graph was captured under: a
  // graph whose memory has since been freed or moved is dropped and the step warmed again.
  uint64_t graph_epochs_[kKinds][2] = {{0, 0}, {0, 0}};
  bool warmed_[kKinds] = {false, false};
  int64_t graph_launches_ = 0;
  float grad_norm_ = 0;
};

}  // namespace loom::train
