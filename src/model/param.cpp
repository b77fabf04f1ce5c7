#include "model/param.h"

#include "comm/comm.h"

#include <algorithm>
#include <cstring>

#include <vector>

#include "core/backend.h"
#include "core/rng.h"

namespace loom::model {

int64_t ParamSpec::alloc_numel() const {
  if (shape.empty()) return 1;
  int64_t rows = std::max(alloc_rows, shape[0]);
  return numel() / std::max<int64_t>(shape[0], 1) * rows;
}

void init_values(const ParamSpec& spec, uint64_t seed, float* out, int64_t first, int64_t n) {
  LOOM_CHECK(first >= 0 && n >= 0 && first + n <= spec.numel(), "parameter '{}': elements [{}, {}) out of range {}",
             spec.name, first, first + n, spec.numel());
  switch (spec.init) {
    case Init::normal:
      fill_normal(out, n, 0.0f, spec.std, seed, stream_of(spec.name), uint64_t(first));
      break;
    case Init::zeros:
      std::fill(out, out + n, 0.0f);
      break;
    case Init::ones:
      std::fill(out, out + n, 1.0f);
      break;
  }
}

void Parameter::allocate(MemoryPool& pool) {
  Shape full = spec.shape;
  if (!full.empty()) full[0] = std::max(spec.alloc_rows, full[0]);
  value_full = Tensor::empty(full, DType::f32, MemTag::params, pool);
  grad_full = Tensor::zeros(full, DType::f32, MemTag::grads, pool);
  // Padding rows stay zero for ever: their gradient is zero and decay keeps zero at zero.
  value_full.zero_();
  if (spec.shape.empty()) {
    value = value_full;
    grad = grad_full;
  } else {
    value = value_full.slice0(0, spec.shape[0]);
    grad = grad_full.slice0(0, spec.shape[0]);
  }
}

void Parameter::allocate(Backend& be, const Tensor& grad_storage) {
  if (be.device() == Device::cpu && be.compute_dtype() == DType::f32 && !grad_storage.defined()) {
    allocate(be.pool());
    return;
  }
  Shape full = spec.shape;
  if (!full.empty()) full[0] = std::max(spec.alloc_rows, full[0]);
  value_full = be.empty(full, DType::f32, MemTag::params);
  be.fill_zero(value_full.raw(), int64_t(value_full.nbytes()));
  if (grad_storage.defined()) {
    LOOM_CHECK(grad_storage.dtype() == DType::f32 && grad_storage.numel() >= spec.alloc_numel(),
               "parameter '{}': gradient storage of {} elements for {}", spec.name, grad_storage.numel(), spec.alloc_numel());
    grad_full = grad_storage.slice0(0, spec.alloc_numel()).view(full);
  } else {
    grad_full = be.empty(full, DType::f32, MemTag::grads);
    be.fill_zero(grad_full.raw(), int64_t(grad_full.nbytes()));
  }
  const bool scalar = spec.shape.empty();
  value = scalar ? value_full : value_full.slice0(0, spec.shape[0]);
  grad = scalar ? grad_full : grad_full.slice0(0, spec.shape[0]);
  if (be.compute_dtype() != DType::f32) {
    compute_full = be.empty(full, be.compute_dtype(), MemTag::params);
    be.fill_zero(compute_full.raw(), int64_t(compute_full.nbytes()));
    compute = scalar ? compute_full : compute_full.slice0(0, spec.shape[0]);
  }
}

ParamSpec Parameter::global() const {
  ParamSpec g = spec;
  if (!shard.global_shape.empty()) g.shape = shard.global_shape;
  return g;
}

std::vector<ShardSegment> Parameter::segments() const {
  if (!shard.split) return {{0, 0, spec.numel()}};
  return shard.segments;
}

std::vector<std::pair<int64_t, int64_t>> Parameter::norm_ranges() const {
  std::vector<std::pair<int64_t, int64_t>> out;
  int64_t at = 0;
  if (shard.split)
    for (const ShardSegment& s : shard.segments)
      if (s.replica) {
        if (s.local > at) out.push_back({at, s.local});
        at = s.local + s.n;
      }
  if (spec.numel() > at) out.push_back({at, spec.numel()});
  return out;
}

void Parameter::sum_partial_gradients(int64_t begin, int64_t end, float* grad, comm::Comm* tp,
                                      comm::Comm* shared) const {
  if (shard.sp_partial && tp && end > begin) tp->all_reduce(grad, end - begin, DType::f32);
  if (!shard.shared_group) return;
  comm::Comm& group = shared ? *shared : *shard.shared_group;
  LOOM_CHECK(group.size() == shard.shared_group->size(), "parameter '{}': a shared group of {} ranks for {}",
             spec.name, group.size(), shard.shared_group->size());
  for (const ShardSegment& s : shard.segments) {
    if (!s.shared) continue;
    const int64_t lo = std::max(begin, s.local), hi = std::min(end, s.local + s.n);
    if (lo < hi) group.all_reduce(grad + (lo - begin), hi - lo, DType::f32);
  }
}

void Parameter::initialise(uint64_t seed, Backend* be) {
  LOOM_CHECK(value.defined(), "parameter '{}' is not allocated", spec.name);
  if (value.device() == Device::cpu) {
    initialise_part(seed, 0, value_full.numel(), value_full.f32());
    if (be) refresh_compute(*be);
    return;
  }
  LOOM_CHECK(be != nullptr, "parameter '{}': initialising device memory needs its backend", spec.name);
  std::vector<float> host(size_t(value_full.numel()));
  initialise_part(seed, 0, int64_t(host.size()), host.data());
  be->upload(value_full.raw(), DType::f32, host.data(), int64_t(host.size()));
  refresh_compute(*be);
}

void Parameter::initialise_part(uint64_t seed, int64_t begin, int64_t n, float* dst) const {
  // A part of the full tensor draws exactly its elements; the rest (a vocabulary split's padding)
  // stays zero.
  std::fill(dst, dst + n, 0.0f);
  const ParamSpec full = global();
  for_each_global(begin, begin + n, [&](int64_t g, int64_t k, int64_t local) {
    init_values(full, seed, dst + (local - begin), g, k);
  });
}

void Parameter::refresh_compute(Backend& be) {
  // (A compute copy without master weights here is the only copy on the device: offloaded, the
  // masters are the host's, parallel::DataParallel.)
  if (!compute_full.defined() || !value_full.defined()) return;
  be.copy({.dst = compute_full.raw(), .dst_dtype = compute_full.dtype(), .src = value_full.raw(),
           .src_dtype = DType::f32, .n = value_full.numel()});
}

}  // namespace loom::model
