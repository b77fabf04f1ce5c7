#include "train/run_util.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.h"
#include "data/shard.h"
#include "train/plot.h"

namespace loom::train {

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

std::string human_time(double s) {
  if (!std::isfinite(s) || s < 0) return "?";
  int64_t t = int64_t(s + 0.5);
  if (t >= 3600) return fmt::format("{}h{:02d}m", t / 3600, (t / 60) % 60);
  if (t >= 60) return fmt::format("{}m{:02d}s", t / 60, t % 60);
  return fmt::format("{}s", t);
}

double unigram_loss(const data::Loader& train, const data::Loader* val, int64_t vocab) {
  std::vector<double> count(size_t(vocab), 1.0);
  double total = double(vocab);
  std::vector<int32_t> buf(1 << 16);
  for (const auto& f : train.files()) {
    data::Shard s(f, false);
    for (uint64_t i = 0; i < s.size(); i += buf.size()) {
      uint64_t n = std::min<uint64_t>(buf.size(), s.size() - i);
      s.read(i, n, buf.data());
      for (uint64_t j = 0; j < n; ++j) count[size_t(buf[j])] += 1;
      total += double(n);
    }
  }
  double nll = 0, n = 0;
  for (const auto& f : val ? val->files() : train.files()) {
    data::Shard s(f, false);
    for (uint64_t i = 0; i < s.size(); i += buf.size()) {
      uint64_t m = std::min<uint64_t>(buf.size(), s.size() - i);
      s.read(i, m, buf.data());
      for (uint64_t j = 0; j < m; ++j) nll -= std::log(count[size_t(buf[j])] / total);
      n += double(m);
    }
  }
  return n > 0 ? nll / n : NAN;
}

RunData open_run_data(const TrainConfig& cfg, const std::string& config_path) {
  RunData r{data::Loader(cfg.data_dir, "train", cfg.seq_len, cfg.seed), nullptr, {}};
  if (!data::list_shards(cfg.data_dir, "val").empty())
    r.val = std::make_unique<data::Loader>(cfg.data_dir, "val", cfg.seq_len, cfg.seed);
  r.model = cfg.model(int64_t(r.train.vocab_size()));
  r.model.validate(config_path.empty() ? "model config" : config_path + ": [model]");
  LOOM_CHECK(int64_t(r.train.vocab_size()) <= r.model.vocab_size,
             "{}: model.vocab_size {} is smaller than the data's vocabulary {}", config_path, r.model.vocab_size,
             r.train.vocab_size());
  LOOM_CHECK(cfg.seq_len <= r.model.block_size, "{}: data.seq_len {} exceeds model.block_size {}", config_path,
             cfg.seq_len, r.model.block_size);
  return r;
}

std::string write_loss_curve(const std::string& png, const std::string& metrics_path, const std::string& title,
                             const std::vector<std::pair<double, double>>& train,
                             const std::vector<std::pair<double, double>>& val, double unigram) {
  std::vector<Series> series{{"train loss", train, 0.12, 0.4, 0.8}};
  if (!val.empty()) series.push_back({"val loss", val, 0.85, 0.33, 0.1});
  if (std::isfinite(unigram) && !train.empty())
    series.push_back({"unigram baseline", {{train.front().first, unigram}, {train.back().first, unigram}}, 0.5, 0.5, 0.5});
  std::string why;
  if (plot_png(png, title, series, "loss (nats/token)", &why)) return fmt::format("wrote {} and {}", metrics_path, png);
  return fmt::format("wrote {} ({})", metrics_path, why);
}

}  // namespace loom::train
