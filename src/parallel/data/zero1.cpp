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

MomentPart Zero1Optimizer::moment_part(size_t i) {
  const FlatParam& f = flat(i);
  const int64_t b = std::max(f.offset, shard_begin()), e = std::min(f.offset + f.numel, shard_begin() + lay_.shard);
  if (b >= e) return {};
  return {b - f.offset, e - f.offset, opt_->exp_avg().f32() + (b - shard_begin()),
          opt_->exp_avg_sq().f32() + (b - shard_begin())};
}

}  // namespace loom::parallel
