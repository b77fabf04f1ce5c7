// Dynamic loss scaling for fp16 training (Micikevicius et al. 2017; the rule Megatron-LM and
// DeepSpeed use): the loss gradient is multiplied by `scale` so that small activation gradients
// stay above f16's smallest normal value, and the parameter gradients are divided by it again
// before the norm, clipping and the update. A step whose scaled gradients overflowed (a gradient
// norm that is not finite while the loss is finite) is skipped and the scale halved; after
// `window` clean steps in a row the scale doubles. Host bookkeeping only: the engine applies it.
#pragma once
#include <cmath>
#include <cstdint>
#include <string>

#include "core/error.h"

namespace loom::train {

class LossScaler {
 public:
  // init > 0, window >= 1, 0 < min <= init (checked by the config; here as a contract).
  LossScaler(double init, int64_t window, double min) : scale_(init), window_(window), min_(min) {
    LOOM_CHECK(std::isfinite(init) && init > 0 && window >= 1 && min > 0 && min <= init,
               "loss scaler: need init > 0, window >= 1 and 0 < min <= init (init {}, window {}, min {})", init, window,
               min);
  }

  double scale() const { return scale_; }         // the state (what a checkpoint keeps)
  int64_t clean_steps() const { return clean_; }  // clean steps since the last change of the scale

  // The scale a step runs at, taken once per step: scale(), or (once) the boost of an injected
  // overflow on top, which is used up whatever the step's outcome.
  double step_scale() {
    const double s = scale_ * boost_;
    boost_ = 1;
    return s;
  }

  // After a step: `overflowed` when its scaled gradients were not finite (the
  // engine skipped the update). Returns the scale the next step uses. Throws when an overflow
  // would take the scale below `min` (what): the gradients overflow f16 even unscaled.
  double update(bool overflowed, const std::string& what) {
    if (overflowed) {
      clean_ = 0;
      if (scale_ / 2 < min_)
        throw Error(fmt::format("{}: the gradients overflow f16 even at loss scale {} (train.loss_scale_min = {}): "
                                "lower optim.lr, or train in bf16",
                                what, scale_, min_));
      scale_ /= 2;
      return scale_;
    }
    if (++clean_ >= window_) {
      clean_ = 0;
      scale_ *= 2;
    }
    return scale_;
  }

  // A checkpoint's state (scale > 0, clean >= 0).
  void restore(double scale, int64_t clean) {
    LOOM_CHECK(std::isfinite(scale) && scale > 0 && clean >= 0, "loss scaler: bad state scale {} clean steps {}",
               scale, clean);
    scale_ = scale;
    clean_ = clean;
  }

  // An injected overflow (LOOM_FAULT_INJECT kind=overflow, on every rank of the job): the next
  // step alone runs at a scale 2^16 times larger, as a run started with a far too large scale
  // would (Megatron-LM starts at 2^32); its update() then applies to scale(), the state.
  void inject_overflow() { boost_ = 65536.0; }

 private:
  double scale_;
  int64_t window_;
  double min_;
  double boost_ = 1;
  int64_t clean_ = 0;
};

}  // namespace loom::train
