#include "parallel/data/zero1.h"

#include <algorithm>
#include <cstring>
#include <set>

#include "core/error.h"

namespace loom::parallel {

Zero1Optimizer::Zero1Optimizer(std::vector<model::Parameter*> params, comm::Comm& dp, const optim::AdamWConfig& adam,
                               MemoryPool& pool, Zero1Options opt)
    : params_(std::move(params)), dp_(dp), rank_(dp.rank()), world_(dp.size()) {
  LOOM_CHECK(opt.replicas >= 0 && opt.replicas <= world_ && (opt.replicas == 0 || world_ % opt.replicas == 0),
             "zero-1: replicas = {} must divide the group's {} ranks", opt.replicas, world_);
  replicas_ = opt.replicas ? opt.replicas : world_;
  LOOM_CHECK(opt.in_norm.empty() || opt.in_norm.size() == params_.size(),
             "zero-1: {} in_norm flags for {} parameters", opt.in_norm.size(), params_.size());
  std::set<const model::Parameter*> seen;
  for (const model::Parameter* p : params_)
    LOOM_CHECK(!p || seen.insert(p).second, "zero-1: parameter '{}' is listed twice", p->spec.name);
  lay_ = FlatLayout::build(params_, world_);  // checks every parameter is allocated

  values_ = flatten_parameters(lay_, /*grad=*/false, MemTag::params, pool);
  grads_ = flatten_parameters(lay_, /*grad=*/true, MemTag::grads, pool);
  opt_ = std::make_unique<optim::ShardedAdamW>(lay_.segments(opt.in_norm), shard_begin(), shard_begin() + lay_.shard,
                                               adam, pool);
}

const FlatParam& Zero1Optimizer::flat(size_t i) const {
  LOOM_CHECK(i < lay_.params.size(), "zero-1: parameter index {} out of range ({} parameters)", i,
             lay_.params.size());
  return lay_.params[i];
}

void Zero1Optimizer::zero_grad() { grads_.zero_(); }

double Zero1Optimizer::reduce_gradients() {
  float* mine = grads_.f32() + shard_begin();
  if (world_ > 1) dp_.reduce_scatter(grads_.f32(), mine, lay_.n_pad, DType::f32);
  if (replicas_ > 1) {
    const float inv = 1.0f / float(replicas_);
    for (int64_t i = 0; i < lay_.shard; ++i) mine[i] *= inv;
  }
  return opt_->grad_sum_squares(mine);
}

optim::StepStats Zero1Optimizer::step(double global_norm, double lr) {
  float* mine = values_.f32() + shard_begin();
  optim::StepStats st = opt_->step(mine, grads_.f32() + shard_begin(), global_norm, lr);
  if (world_ > 1) dp_.all_gather(mine, values_.f32(), lay_.n_pad, DType::f32);
  return st;
}

void Zero1Optimizer::gather_moments(size_t i, float* exp_avg, float* exp_avg_sq) {
  const FlatParam& f = flat(i);
  const std::vector<int64_t> counts = lay_.shard_counts(f.offset, f.offset + f.numel);
  // This rank's part starts at the later of the parameter's and the shard's first element.
  const int64_t local = std::clamp<int64_t>(f.offset - shard_begin(), 0, lay_.shard);
  dp_.all_gather_v(opt_->exp_avg().f32() + local, exp_avg, counts, DType::f32);
  dp_.all_gather_v(opt_->exp_avg_sq().f32() + local, exp_avg_sq, counts, DType::f32);
}

void Zero1Optimizer::load_moments(size_t i, const float* exp_avg, const float* exp_avg_sq) {
  const FlatParam& f = flat(i);
  const int64_t b = std::max(f.offset, shard_begin()), e = std::min(f.offset + f.numel, shard_begin() + lay_.shard);
  if (b >= e) return;
  std::memcpy(opt_->exp_avg().f32() + (b - shard_begin()), exp_avg + (b - f.offset), size_t(e - b) * sizeof(float));
  std::memcpy(opt_->exp_avg_sq().f32() + (b - shard_begin()), exp_avg_sq + (b - f.offset),
              size_t(e - b) * sizeof(float));
}

void Zero1Optimizer::scatter_moments(size_t i, float* exp_avg, float* exp_avg_sq, int root) {
  const FlatParam& f = flat(i);
  LOOM_CHECK(root >= 0 && root < world_, "zero-1: scatter root {} is not a rank of the {} dp ranks", root, world_);
  dp_.broadcast(exp_avg, f.numel, DType::f32, root);
  dp_.broadcast(exp_avg_sq, f.numel, DType::f32, root);
  load_moments(i, exp_avg, exp_avg_sq);
}

}  // namespace loom::parallel
