// Small pieces shared by the trainers (single device / data parallel, and the mesh trainer).
#pragma once
#include <chrono>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <memory>

#include "data/loader.h"
#include "model/config.h"
#include "train/config.h"

namespace loom::train {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t);

// "1h02m", "3m05s", "42s" ("?" for a negative or non-finite time).
std::string human_time(double seconds);

// Cross-entropy (nats per token) of the add-one smoothed unigram distribution of `train`,
// measured on `val` (or on train when there is no validation split): the loss of the best
// predictor that ignores context, printed as the baseline a model must beat.
double unigram_loss(const data::Loader& train, const data::Loader* val, int64_t vocab);

// The data of a run and the model it configures: the train split, the validation split when
// DIR/val_*.bin exist, and the model config (vocabulary from the data unless set), validated
// against the data; errors name `config_path` and the field.
struct RunData {
  data::Loader train;
  std::unique_ptr<data::Loader> val;
  model::GPTConfig model;
};
RunData open_run_data(const TrainConfig& cfg, const std::string& config_path);

// Writes the loss-curve PNG `png` (train loss, validation loss, the unigram baseline as a line)
// and returns the line to print about it and the metrics file.
std::string write_loss_curve(const std::string& png, const std::string& metrics_path, const std::string& title,
                             const std::vector<std::pair<double, double>>& train,
                             const std::vector<std::pair<double, double>>& val, double unigram);

}  // namespace loom::train
