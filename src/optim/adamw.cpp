#include "optim/adamw.h"

#include <cmath>

#include "kernels/cpu/adamw.h"

namespace loom::optim {

void AdamWConfig::validate() const {
  auto check = [](bool ok, const char* field, double v) {
    if (!ok) throw Error(fmt::format("adamw config: {} is out of range ({})", field, v));
  };
  check(lr >= 0 && std::isfinite(lr), "lr", lr);
  check(beta1 >= 0 && beta1 < 1, "beta1", beta1);
  check(beta2 >= 0 && beta2 < 1, "beta2", beta2);
  check(eps > 0, "eps", eps);
  check(weight_decay >= 0 && std::isfinite(weight_decay), "weight_decay", weight_decay);
  check(std::isfinite(max_norm), "max_norm", max_norm);
  check(galore_rank >= 0, "galore_rank", double(galore_rank));
  check(galore_update_every >= 1, "galore_update_every", double(galore_update_every));
  check(galore_scale > 0 && std::isfinite(galore_scale), "galore_scale", galore_scale);
}

AdamW::AdamW(std::vector<model::Parameter*> params, const AdamWConfig& cfg, MemoryPool& pool)
    : cfg_(cfg), params_(std::move(params)) {
  cfg_.validate();
  for (model::Parameter* p : params_) {
    LOOM_CHECK(p && p->value.defined() && p->grad.defined(), "adamw: parameter '{}' is not allocated",
               p ? p->spec.name : "?");
    m_.push_back(Tensor::zeros(p->spec.shape, DType::f32, MemTag::optimizer, pool));
    v_.push_back(Tensor::zeros(p->spec.shape, DType::f32, MemTag::optimizer, pool));
  }
}

int64_t AdamW::state_bytes() const {
  int64_t n = 0;
  for (model::Parameter* p : params_) n += 2 * p->spec.numel() * int64_t(sizeof(float));
  return n;
}

double AdamW::grad_sum_squares() const {
  double s = 0;
  for (model::Parameter* p : params_) s += cpu::sum_squares(p->grad.f32(), p->grad.numel());
  return s;
}

StepStats AdamW::step(double lr) { return step_with_norm(std::sqrt(grad_sum_squares()), lr); }

StepStats AdamW::step_with_norm(double grad_norm, double lr) {
  if (!std::isfinite(grad_norm)) throw Error(fmt::format("adamw: gradient norm is {} at step {}", grad_norm, t_ + 1));
  ++t_;
  StepStats st;
  st.grad_norm = grad_norm;
  st.clip_scale = cpu::clip_scale(grad_norm, cfg_.max_norm);
  st.step = t_;
  for (size_t i = 0; i < params_.size(); ++i) {
    model::Parameter* p = params_[i];
    cpu::AdamWArgs a;
    a.lr = lr < 0 ? cfg_.lr : lr;
    a.beta1 = cfg_.beta1;
    a.beta2 = cfg_.beta2;
    a.eps = cfg_.eps;
    a.weight_decay = p->spec.decay() ? cfg_.weight_decay : 0.0;
    a.step = t_;
    a.grad_scale = st.clip_scale;
    cpu::adamw_update(p->value.f32(), p->grad.f32(), m_[i].f32(), v_[i].f32(), p->value.numel(), a);
  }
  return st;
}

}  // namespace loom::optim
