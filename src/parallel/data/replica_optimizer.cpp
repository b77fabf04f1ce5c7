#include "parallel/data/replica_optimizer.h"

#include <cmath>

#include <cstring>

#include "core/error.h"
#include "kernels/cpu/adamw.h"
#include "parallel/data/flat_layout.h"

namespace loom::parallel {

ReplicaOptimizer::ReplicaOptimizer(std::vector<model::Parameter*> params, comm::Comm* group, Options opt,
                                   const optim::AdamWConfig& adam, MemoryPool& pool)
    : params_(std::move(params)), group_(group), opt_(std::move(opt)) {
  const int size = group_ ? group_->size() : 1;
  LOOM_CHECK(opt_.zero_stage == 0 || opt_.zero_stage == 1, "replica optimizer: zero_stage = {} is not 0 or 1",
             opt_.zero_stage);
  LOOM_CHECK(opt_.replicas >= 0 && opt_.replicas <= size && (opt_.replicas == 0 || size % opt_.replicas == 0),
             "replica optimizer: replicas = {} must divide the group's {} ranks", opt_.replicas, size);
  LOOM_CHECK(opt_.in_norm.empty() || opt_.in_norm.size() == params_.size(),
             "replica optimizer: in_norm has {} entries for {} parameters", opt_.in_norm.size(), params_.size());
  if (opt_.replicas == 0) opt_.replicas = size;
  if (opt_.in_norm.empty()) opt_.in_norm.assign(params_.size(), true);
  if (opt_.zero_stage == 1) {
    LOOM_CHECK(group_ != nullptr, "replica optimizer: ZeRO-1 needs a data-parallel group");
    Zero1Options zo;
    zo.replicas = opt_.replicas;
    zo.in_norm = opt_.in_norm;
    zero1_ = std::make_unique<Zero1Optimizer>(params_, *group_, adam, pool, zo);
  } else {
    // Across ranks the gradients become views of one flat buffer, reduced by one all-reduce
    // instead of one per parameter (a GPT-2 stage has about 150, many of them a few hundred
    // floats: the per-collective latency, not the bytes, would dominate).
    if (group_ && group_->size() > 1)  // (the layout checks every parameter is allocated)
      flat_grads_ = flatten_parameters(FlatLayout::build(params_, 1), /*grad=*/true, MemTag::grads, pool);
    adam_ = std::make_unique<optim::AdamW>(params_, adam, pool);
  }
}

ReplicaOptimizer::~ReplicaOptimizer() = default;

void ReplicaOptimizer::zero_grad() {
  if (zero1_) return zero1_->zero_grad();
  if (flat_grads_.defined()) return flat_grads_.zero_();
  for (model::Parameter* p : params_) p->grad_full.zero_();
}

double ReplicaOptimizer::reduce_gradients() {
  if (zero1_) return sum_over_ranks(*group_, zero1_->reduce_gradients());
  if (flat_grads_.defined()) {
    group_->all_reduce(flat_grads_);
    if (opt_.replicas > 1) {
      const float inv = 1.0f / float(opt_.replicas);
      float* g = flat_grads_.f32();
      for (int64_t j = 0, n = flat_grads_.numel(); j < n; ++j) g[j] *= inv;
    }
  }
  double sq = 0;
  for (size_t i = 0; i < params_.size(); ++i)
    // The logical elements (a padded vocabulary's rows are zero), as AdamW counts them.
    if (opt_.in_norm[i])
      for (const auto& [b, e] : params_[i]->norm_ranges()) sq += cpu::sum_squares(params_[i]->grad.f32() + b, e - b);
  return sq;
}

optim::StepStats ReplicaOptimizer::step(double global_norm, double lr) {
  // The global norm is the same on every rank: a non-finite one skips the update everywhere.
  if (!std::isfinite(global_norm)) {
    optim::StepStats st;
    st.grad_norm = global_norm;
    st.step = steps_taken();
    st.skipped = true;
    return st;
  }
  return zero1_ ? zero1_->step(global_norm, lr) : adam_->step_with_norm(global_norm, lr);
}

MomentPart ReplicaOptimizer::moment_part(size_t i) {
  if (zero1_) return zero1_->moment_part(i);
  Tensor& m = adam_->exp_avg(i);
  Tensor& v = adam_->exp_avg_sq(i);
  return {0, m.numel(), m.f32(), v.f32()};
}

int64_t ReplicaOptimizer::steps_taken() const { return zero1_ ? zero1_->steps_taken() : adam_->steps_taken(); }

void ReplicaOptimizer::set_steps_taken(int64_t t) {
  if (zero1_) zero1_->set_steps_taken(t);
  else adam_->set_steps_taken(t);
}

}  // namespace loom::parallel
