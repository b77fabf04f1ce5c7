#include "parallel/pipeline/stage_layers.h"

#include <algorithm>

#include "core/error.h"

namespace loom::parallel::pipeline {

std::vector<int64_t> cuts_from_stage_layers(const std::vector<int64_t>& layers, int64_t n_layer,
                                            const std::string& field) {
  const int64_t V = int64_t(layers.size());
  LOOM_REQUIRE(V >= 2, "{}: needs an entry per pipeline stage (at least 2), got {}", field, V);
  int64_t sum = 0;
  for (int64_t i = 0; i < V; ++i) {
    const int64_t l = layers[size_t(i)];
    LOOM_REQUIRE(l >= 0, "{}: entry {} is {} (blocks cannot be negative)", field, i, l);
    LOOM_REQUIRE(l <= n_layer, "{}: entry {} is {}, more than the model's n_layer = {} blocks", field, i, l, n_layer);
    LOOM_REQUIRE(l >= 1 || i == 0 || i == V - 1, "{}: entry {} is 0: a stage between the first (embedding) and the "
               "last (head) needs at least one block", field, i);
    sum += l;
  }
  LOOM_REQUIRE(sum == n_layer, "{}: the entries add up to {} blocks but the model has n_layer = {}", field, sum, n_layer);
  std::vector<int64_t> cuts{0};
  int64_t at = 1;  // past the embedding
  for (int64_t i = 0; i + 1 < V; ++i) cuts.push_back(at += layers[size_t(i)]);
  cuts.push_back(n_layer + 2);
  return cuts;
}

std::vector<int64_t> stage_layers_from_cuts(const std::vector<int64_t>& cuts, int64_t n_layer) {
  std::vector<int64_t> layers;
  for (size_t k = 0; k + 1 < cuts.size(); ++k) {
    const int64_t lo = std::max<int64_t>(cuts[k], 1), hi = std::min<int64_t>(cuts[k + 1], n_layer + 1);
    layers.push_back(std::max<int64_t>(hi - lo, 0));
  }
  return layers;
}

}  // namespace loom::parallel::pipeline
