#include "train/step_runner.h"

#include <cmath>

#include "core/error.h"

namespace loom::train {

StepRunner::StepRunner(model::GPT& gpt, const StepOptions& opt)
    : gpt_(gpt), be_(gpt.backend()), opt_(opt), params_(gpt.parameters()) {
  const model::GPTConfig& cfg = gpt.config();
  LOOM_CHECK(opt.B > 0 && opt.T > 0 && opt.T <= cfg.block_size,
             "step runner: need B > 0 and 0 < T <= block_size {} (B={} T={})", cfg.block_size, opt.B, opt.T);
  LOOM_CHECK(std::isfinite(opt.grad_clip) && opt.weight_decay >= 0, "step runner: bad grad_clip {} or weight_decay {}",
             opt.grad_clip, opt.weight_decay);
  std::vector<AdamWTensor> ts;
  for (model::Parameter* p : params_) {
    for (std::vector<Tensor>* mv : {&m_, &v_}) {
      mv->push_back(be_.empty(p->value_full.shape(), DType::f32, MemTag::optimizer));
      be_.fill_zero(mv->back().raw(), int64_t(mv->back().nbytes()));
    }
    ts.push_back({.param = p->value_full.f32(),
                  .compute = p->compute_full.defined() ? p->compute_full.raw() : nullptr,
                  .grad = p->grad_full.f32(),
                  .m = m_.back().f32(),
                  .v = v_.back().f32(),
                  .n = p->value_full.numel(),
                  .weight_decay = p->spec.decay() ? float(opt.weight_decay) : 0.0f});
  }
  adamw_ = be_.plan_adamw(ts);
  tokens_ = be_.empty({opt.B, opt.T}, DType::i32, MemTag::activations);
  targets_ = be_.empty({opt.B, opt.T}, DType::i32, MemTag::activations);
  loss_ = be_.empty({1}, DType::f32, MemTag::activations);
}

StepRunner::~StepRunner() {
  try {
    be_.synchronize();
  } catch (...) {
  }
}

int64_t StepRunner::upload(const int32_t* tokens, const int32_t* targets) {
  const model::GPTConfig& cfg = gpt_.config();
  const int64_t n = opt_.B * opt_.T, V = cfg.vocab_size;
  int64_t counted = 0;
  for (int64_t i = 0; i < n; ++i) {
    LOOM_CHECK(tokens[i] >= 0 && tokens[i] < V, "model '{}': token id {} at index {} is outside the vocabulary [0, {})",
               cfg.name, tokens[i], i, V);
    LOOM_CHECK(targets[i] >= -1 && targets[i] < V, "model '{}': target {} at index {} is outside [-1, {})", cfg.name,
               targets[i], i, V);
    counted += targets[i] >= 0;
  }
  be_.copy({.dst = tokens_.raw(), .dst_dtype = DType::i32, .src = tokens, .src_dtype = DType::i32, .src_host = true, .n = n});
  be_.copy({.dst = targets_.raw(), .dst_dtype = DType::i32, .src = targets, .src_dtype = DType::i32, .src_host = true, .n = n});
  return counted;
}

void StepRunner::enqueue_micro() {
  gpt_.forward(tokens_, targets_,
               {.fuse_backward = true, .dloss_scale = loss_scale_, .counted = counted_, .loss_out = loss_.f32()});
  gpt_.backward();
}

void StepRunner::enqueue(Kind k) {
  be_.step_begins();
  if (k == kStep) gpt_.zero_grad();
  enqueue_micro();
  if (k == kStep) adamw_->launch();
}

void StepRunner::run(Kind k) {
  if (graphs_[k] && (graph_epochs_[k][0] != be_.memory_epoch() || graph_epochs_[k][1] != gpt_.activation_epoch())) {
    graphs_[k].reset();
    warmed_[k] = false;  // (an eager run first: it may take the memory anew)
  }
  // Eagerly: without graphs, the first time (allocations, plans, tuning), and while an observer
  // that cannot be captured profiles the ops (a replay would not report them). One that can is
  // captured with the ops: a graph captured under another observer (or none) is captured again.
  OpObserver* obs = be_.observer();
  if (!opt_.graphs || !be_.can_capture() || (obs && !obs->in_graph()) || !warmed_[k]) {
    enqueue(k);
    warmed_[k] = true;
    return;
  }
  if (!graphs_[k] || graph_counted_[k] != counted_ || graph_scale_[k] != loss_scale_ ||
      graph_observer_sets_[k] != be_.observer_sets()) {
    graphs_[k].reset();
    be_.begin_capture();
    try {
      enqueue(k);
    } catch (...) {
      try {
        be_.end_capture();
      } catch (...) {
      }
      throw;
    }
    graphs_[k] = be_.end_capture();
    graph_counted_[k] = counted_;
    graph_scale_[k] = loss_scale_;
    graph_observer_sets_[k] = be_.observer_sets();
    graph_epochs_[k][0] = be_.memory_epoch();
    graph_epochs_[k][1] = gpt_.activation_epoch();
  }
  graphs_[k]->replay();
  ++graph_launches_;
}

float StepRunner::read_loss() {
  float v = 0;
  be_.download(&v, loss_.raw(), DType::f32, 1);
  return v;
}

float StepRunner::forward(const int32_t* tokens, const int32_t* targets) {
  counted_ = upload(tokens, targets);
  gpt_.forward(tokens_, targets_, {.counted = counted_, .loss_out = loss_.f32()});
  return read_loss();
}

float StepRunner::forward_backward(const int32_t* tokens, const int32_t* targets) {
  counted_ = upload(tokens, targets);
  loss_scale_ = 1.0f;
  gpt_.zero_grad();
  enqueue_micro();
  return read_loss();
}

float StepRunner::train_step(const int32_t* tokens, const int32_t* targets, double lr, int64_t step, float loss_scale) {
  LOOM_CHECK(std::isfinite(loss_scale) && loss_scale > 0, "step runner: loss scale {} must be positive", loss_scale);
  counted_ = upload(tokens, targets);
  loss_scale_ = loss_scale;
  adamw_->set_hyper({.lr = lr, .beta1 = opt_.beta1, .beta2 = opt_.beta2, .eps = opt_.eps, .step = step,
                     .max_norm = opt_.grad_clip, .grad_scale = 1.0f / loss_scale});
  run(kStep);
  const float loss = read_loss();
  grad_norm_ = float(adamw_->grad_norm());
  return loss;
}

void StepRunner::zero_grad() { gpt_.zero_grad(); }

float StepRunner::accumulate(const int32_t* tokens, const int32_t* targets, float loss_scale) {
  LOOM_CHECK(std::isfinite(loss_scale) && loss_scale > 0, "step runner: loss scale {} must be positive", loss_scale);
  counted_ = upload(tokens, targets);
  loss_scale_ = loss_scale;
  run(kMicro);
  return read_loss();
}

float StepRunner::optimizer_step(double lr, int64_t step, float grad_scale) {
  adamw_->set_hyper({.lr = lr, .beta1 = opt_.beta1, .beta2 = opt_.beta2, .eps = opt_.eps, .step = step,
                     .max_norm = opt_.grad_clip, .grad_scale = grad_scale});
  adamw_->launch();
  grad_norm_ = float(adamw_->grad_norm());
  return grad_norm_;
}

size_t StepRunner::index_of(const std::string& name) const {
  for (size_t i = 0; i < params_.size(); ++i)
    if (params_[i]->spec.name == name) return i;
  throw Error(fmt::format("model '{}' has no parameter named '{}'", gpt_.config().name, name));
}

std::vector<float> StepRunner::get(const Tensor& t, int64_t n) const {
  std::vector<float> v(static_cast<size_t>(n));
  be_.download(v.data(), t.raw(), DType::f32, n);
  return v;
}

void StepRunner::put(const Tensor& t, const float* values, int64_t n) { be_.upload(t.raw(), DType::f32, values, n); }

std::vector<float> StepRunner::parameter(const std::string& name) const {
  const model::Parameter* p = params_[index_of(name)];
  return get(p->value, p->spec.numel());
}

std::vector<float> StepRunner::gradient(const std::string& name) const {
  const model::Parameter* p = params_[index_of(name)];
  return get(p->grad, p->spec.numel());
}

std::vector<float> StepRunner::exp_avg(const std::string& name) const {
  const size_t i = index_of(name);
  return get(m_[i], params_[i]->spec.numel());
}

std::vector<float> StepRunner::exp_avg_sq(const std::string& name) const {
  const size_t i = index_of(name);
  return get(v_[i], params_[i]->spec.numel());
}

void StepRunner::set_parameter(const std::string& name, const float* values) {
  model::Parameter* p = params_[index_of(name)];
  put(p->value, values, p->spec.numel());
  p->refresh_compute(be_);
}

void StepRunner::set_exp_avg(const std::string& name, const float* values) {
  const size_t i = index_of(name);
  put(m_[i], values, params_[i]->spec.numel());
}

void StepRunner::set_exp_avg_sq(const std::string& name, const float* values) {
  const size_t i = index_of(name);
  put(v_[i], values, params_[i]->spec.numel());
}

}  // namespace loom::train
