#include "parallel/data/param_set_util.h"

#include <algorithm>

#include <cmath>

#include "core/rng.h"

namespace loom::test {

const std::vector<ParamSpec>& param_set() {
  static const std::vector<ParamSpec> s = {{"w1", {9, 10}, 12, true},
                                           {"b1", {10}, 0, true},
                                           {"w2", {10, 23}, 0, true},
                                           {"b2", {23}, 0, true},
                                           {"extra", {17}, 0, false}};
  return s;
}

optim::AdamWConfig clipping_adamw() {
  optim::AdamWConfig a;
  a.lr = 1e-2;
  a.weight_decay = 0.1;
  a.max_norm = 0.5f;
  return a;
}

std::vector<std::unique_ptr<model::Parameter>> make_param_set(MemoryPool& pool) {
  std::vector<std::unique_ptr<model::Parameter>> ps;
  for (const ParamSpec& s : param_set()) {
    auto p = std::make_unique<model::Parameter>();
    p->spec.name = s.name;
    p->spec.shape = s.shape;
    p->spec.alloc_rows = s.alloc_rows;
    p->spec.init = model::Init::normal;
    p->spec.std = 0.5f;
    p->allocate(pool);
    p->initialise(42);
    ps.push_back(std::move(p));
  }
  return ps;
}

std::vector<model::Parameter*> raw(const std::vector<std::unique_ptr<model::Parameter>>& ps) {
  std::vector<model::Parameter*> r;
  for (auto& p : ps) r.push_back(p.get());
  return r;
}

float grad_at(uint64_t seed, int s, int r, size_t k, int64_t j) {
  return uniform_at(seed + uint64_t(s), uint64_t(r * 16 + int(k)), uint64_t(j)) * 2.0f - 1.0f;
}

double rel_dist(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b) {
  double d = 0, n = 0;
  for (size_t k = 0; k < b.size(); ++k)
    for (size_t j = 0; j < b[k].size(); ++j)
      d += (double(a[k][j]) - b[k][j]) * (double(a[k][j]) - b[k][j]), n += double(b[k][j]) * b[k][j];
  return std::sqrt(d / n);
}

void gather_moments(const parallel::MomentPart& part, comm::Comm& dp, int64_t numel, float* exp_avg,
                    float* exp_avg_sq) {
  const int64_t mine = part.end - part.begin;
  std::vector<int64_t> counts(static_cast<size_t>(dp.size()));
  dp.all_gather(&mine, counts.data(), 2 * int64_t(dp.size()), DType::u32);  // an int64 as two words
  int64_t sum = 0;
  for (int64_t c : counts) sum += c;
  if (sum == numel * dp.size()) {  // every rank holds all of it
    std::copy_n(part.exp_avg, numel, exp_avg);
    std::copy_n(part.exp_avg_sq, numel, exp_avg_sq);
    return;
  }
  float none = 0;
  dp.all_gather_v(mine ? part.exp_avg : &none, exp_avg, counts, DType::f32);
  dp.all_gather_v(mine ? part.exp_avg_sq : &none, exp_avg_sq, counts, DType::f32);
}

void load_moments(const parallel::MomentPart& part, const float* exp_avg, const float* exp_avg_sq) {
  std::copy(exp_avg + part.begin, exp_avg + part.end, part.exp_avg);
  std::copy(exp_avg_sq + part.begin, exp_avg_sq + part.end, part.exp_avg_sq);
}

}  // namespace loom::test
