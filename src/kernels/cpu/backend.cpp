#include "kernels/cpu/backend.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include <omp.h>

#include "core/error.h"
#include "kernels/cpu/adamw.h"
#include "kernels/cpu/crossentropy.h"
#include "kernels/cpu/embedding.h"
#include "kernels/cpu/gelu.h"
#include "kernels/cpu/layernorm.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/residual.h"
#include "kernels/cpu/rope.h"
#include "kernels/cpu/swiglu.h"

namespace loom::cpu {

namespace {

const float* f(const void* p) { return static_cast<const float*>(p); }
float* f(void* p) { return static_cast<float*>(p); }

}  // namespace

AttnArgs CpuBackend::attn_args(const AttnShape& s) { return attn_args_of<AttnArgs>(s); }

namespace {

class CpuAdamW final : public AdamWPlan {
 public:
  explicit CpuAdamW(std::vector<AdamWTensor> t) : t_(std::move(t)) {
    for (const AdamWTensor& x : t_) {
      LOOM_CHECK(x.param && x.grad && x.m && x.v && x.n >= 0, "adamw plan: a tensor without param, grad or moments");
      LOOM_CHECK(!x.compute || x.compute == x.param, "adamw plan: the CPU computes in f32 (no separate compute copy)");
    }
  }
  void set_hyper(const AdamWHyper& h) override {
    LOOM_CHECK(h.grad_scale > 0 && std::isfinite(h.grad_scale), "adamw: grad_scale {} must be positive", h.grad_scale);
    h_ = h;
  }
  void launch() override {
    const AdamWHyper& h = h_;
    if (h.global_norm >= 0 || !std::isfinite(h.global_norm)) {
      norm_ = h.global_norm;  // the caller's, over every rank's shard
      if (!std::isfinite(norm_)) return;  // the update is skipped
    } else {
      double sq = 0;
      for (const AdamWTensor& x : t_) sq += sum_squares(x.grad, x.n);
      norm_ = double(h.grad_scale) * std::sqrt(sq);
      LOOM_CHECK(std::isfinite(norm_), "adamw: gradient norm is {} at step {}", norm_, h.step);
    }
    const float clip = clip_scale(norm_, h.max_norm);
    for (const AdamWTensor& x : t_) {
      AdamWArgs a;
      a.lr = h.lr;
      a.beta1 = h.beta1;
      a.beta2 = h.beta2;
      a.eps = h.eps;
      a.weight_decay = x.weight_decay;
      a.step = h.step;
      a.grad_scale = h.grad_scale * clip;
      adamw_update(x.param, x.grad, x.m, x.v, x.n, a);
    }
  }
  double grad_norm() override { return norm_; }

 private:
  std::vector<AdamWTensor> t_;
  AdamWHyper h_;
  double norm_ = 0;
};

void convert(void* dst, DType dt, const void* src, DType st, int64_t n) {
  if (dt == st) {
    std::memcpy(dst, src, size_t(n) * dtype_size(dt));
  } else if (dt == DType::f32 && st == DType::bf16) {
    bf16_to_f32(static_cast<float*>(dst), static_cast<const bf16*>(src), n);
  } else if (dt == DType::bf16 && st == DType::f32) {
    f32_to_bf16(static_cast<bf16*>(dst), static_cast<const float*>(src), n);
  } else {
    LOOM_FAIL("copy: no conversion from {} to {}", dtype_name(st), dtype_name(dt));
  }
}

}  // namespace

CpuBackend::CpuBackend(const BackendOptions& opt) : pool_(opt.pool ? opt.pool : &default_cpu_pool()) {
  LOOM_CHECK(host_memory(pool_->device()), "cpu backend: pool '{}' is not a host pool", pool_->name());
  LOOM_CHECK(opt.attention == AttnKernel::automatic || opt.attention == AttnKernel::tiled,
             "cpu backend: attention kernel '{}' runs on CUDA only (the CPU has 'tiled')", attn_kernel_name(opt.attention));
  attn_ws_ = std::make_unique<AttnWorkspace>(*pool_);
  LOOM_CHECK(opt.matmul == DType::f32 || opt.matmul == DType::bf16,
             "cpu backend: matmuls in {} (f32, or bf16 with f32 accumulation)", dtype_name(opt.matmul));
  if (opt.matmul == DType::bf16) bf16_ = std::make_unique<Bf16Matmul>(*pool_);
}

bool CpuBackend::supports(Op op, DType dtype) const {
  // Copies also move i32 (token ids, targets) between host and device, without conversion.
  if (op == Op::copy) return dtype == DType::f32 || dtype == DType::bf16 || dtype == DType::i32;
  return dtype == DType::f32;
}

void CpuBackend::check(Op op, DType dtype) const {
  LOOM_CHECK(supports(op, dtype), "cpu backend: {} in {} is not supported (f32 only)", op_name(op), dtype_name(dtype));
}

void CpuBackend::linear_forward(const LinearForward& a) {
  check(Op::linear, a.dtype);
  auto mm = [&](float* out) {
    if (bf16_) bf16_->forward(out, f(a.inp), f(a.weight), f(a.bias), a.M, a.K, a.N);
    else matmul_forward(out, f(a.inp), f(a.weight), f(a.bias), a.M, a.K, a.N);
  };
  if (!a.gelu) {
    mm(f(a.out));
    if (a.residual) residual_forward(f(a.out), f(a.out), f(a.residual), a.M * a.N);
    return;
  }
  LOOM_CHECK(!a.residual, "linear_forward: a residual with gelu");
  LOOM_CHECK(a.pre_gelu, "linear_forward: gelu needs pre_gelu");
  mm(f(a.pre_gelu));
  cpu::gelu_forward(f(a.out), f(a.pre_gelu), a.M * a.N);
}

void CpuBackend::linear_backward(const LinearBackward& a) {
  check(Op::linear, a.dtype);
  LOOM_CHECK(!(a.gelu_pre && a.accumulate_dinp), "linear_backward: gelu_pre with accumulate_dinp");
  if (bf16_)
    bf16_->backward(f(a.dinp), a.dweight, a.dbias, f(a.dout), f(a.inp), f(a.weight), a.M, a.K, a.N,
                    a.accumulate_dinp);
  else
    matmul_backward(f(a.dinp), a.dweight, a.dbias, f(a.dout), f(a.inp), f(a.weight), a.M, a.K, a.N, a.accumulate_dinp);
  if (a.gelu_pre && a.dinp) cpu::gelu_backward(f(a.dinp), f(a.gelu_pre), f(a.dinp), a.M * a.K);
}

int64_t CpuBackend::linear_workspace_bytes(const std::vector<LinearShape>& shapes) const {
  return bf16_ ? bf16_->workspace_bytes(shapes) : 0;
}

void CpuBackend::layernorm_forward(const LayerNormForward& a) {
  check(a.rms ? Op::rmsnorm : Op::layernorm, a.dtype);
  LOOM_CHECK(!a.rms || (!a.mean && !a.bias), "rmsnorm_forward: no mean and no bias (mean and bias must be null)");
  const float* x = f(a.inp);
  if (a.residual_b) {
    LOOM_CHECK(a.residual_out, "layernorm_forward: residual_b without residual_out");
    residual_forward(f(a.residual_out), f(a.inp), f(a.residual_b), a.N * a.C);
    x = f(a.residual_out);
  }
  if (a.rms) cpu::rmsnorm_forward(f(a.out), a.rstd, x, f(a.weight), a.N, a.C, a.eps);
  else cpu::layernorm_forward(f(a.out), a.mean, a.rstd, x, f(a.weight), f(a.bias), a.N, a.C, a.eps);
}

void CpuBackend::layernorm_backward(const LayerNormBackward& a) {
  check(a.rms ? Op::rmsnorm : Op::layernorm, a.dtype);
  if (a.rms) {
    LOOM_CHECK(!a.dbias && !a.mean, "rmsnorm_backward: no mean and no bias (mean and dbias must be null)");
    cpu::rmsnorm_backward(f(a.dinp), a.dweight, f(a.dout), f(a.inp), f(a.weight), a.rstd, a.N, a.C, a.accumulate);
    return;
  }
  cpu::layernorm_backward(f(a.dinp), a.dweight, a.dbias, f(a.dout), f(a.inp), f(a.weight), a.mean, a.rstd, a.N, a.C,
                          a.accumulate);
}

void CpuBackend::rope(const Rope& a) {
  check(Op::rope, a.dtype);
  LOOM_CHECK(a.inv_freq, "rope: inv_freq is null");
  cpu::rope_apply(f(a.x), a.B, a.T, a.NH, a.HS, a.stride, a.inv_freq, a.pos0, a.positions, a.inverse);
}

void CpuBackend::swiglu_forward(DType dtype, void* out, const void* inp, int64_t N, int64_t H) {
  check(Op::swiglu, dtype);
  cpu::swiglu_forward(f(out), f(inp), N, H);
}

void CpuBackend::swiglu_backward(DType dtype, void* dinp, const void* dout, const void* inp, int64_t N, int64_t H) {
  check(Op::swiglu, dtype);
  cpu::swiglu_backward(f(dinp), f(dout), f(inp), N, H);
}

int64_t CpuBackend::attention_workspace_bytes(DType dtype, const AttnShape& s, int threads) const {
  check(Op::attention, dtype);
  return attention_training_workspace_bytes(attn_args(s), threads > 0 ? threads : omp_get_max_threads());
}

void CpuBackend::prepare_attention(DType dtype, const AttnShape& s) {
  attn_ws_->reserve(attention_workspace_bytes(dtype, s));
}

void CpuBackend::attention_forward(const AttentionForward& a) {
  check(Op::attention, a.dtype);
  const AttnArgs args = attn_ws_->use(attn_args(a.shape), false);
  cpu::attention_forward(f(a.out), a.lse, f(a.q), f(a.k), f(a.v), args);
}

void CpuBackend::attention_backward(const AttentionBackward& a) {
  check(Op::attention, a.dtype);
  const AttnArgs args = attn_ws_->use(attn_args(a.shape), true);
  cpu::attention_backward(f(a.dq), f(a.dk), f(a.dv), f(a.dout), f(a.q), f(a.k), f(a.v), f(a.out), a.lse, args);
}

void CpuBackend::attention_merge(const AttentionMerge& a) {
  check(Op::attention, a.dtype);
  LOOM_CHECK(a.B >= 0 && a.NH >= 0 && a.HS >= 0 && a.Tq >= 0, "attention_merge: negative sizes");
  const int64_t C = a.NH * a.HS, B = a.B, NH = a.NH, HS = a.HS, Tq = a.Tq;
  const float* part = f(a.part);
#pragma omp parallel for collapse(2) schedule(static) if (B * NH * Tq * HS > (1 << 16))
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < NH; ++h)
      for (int64_t t = 0; t < Tq; ++t) {
        float* l = a.lse + b * a.lse_batch + h * Tq + t;
        float* od = a.out + b * a.o_batch + t * a.o_row + h * HS;
        const float* pd = part + (b * Tq + t) * C + h * HS;
        const double lb = a.part_lse[(b * NH + h) * Tq + t];
        const double la = a.init ? -std::numeric_limits<double>::infinity() : double(*l);
        if (!a.init && std::isinf(lb) && lb < 0) continue;  // no visible key in this block
        if (std::isinf(la) && la < 0) {
          std::memcpy(od, pd, size_t(HS) * sizeof(float));
          *l = float(lb);
          continue;
        }
        const double m = std::max(la, lb), wa = std::exp(la - m), wb = std::exp(lb - m), sum = wa + wb;
        const double ca = wa / sum, cb = wb / sum;
        for (int64_t d = 0; d < HS; ++d) od[d] = float(ca * double(od[d]) + cb * double(pd[d]));
        *l = float(m + std::log(sum));
      }
}

void CpuBackend::crossentropy(const CrossEntropy& a) {
  check(Op::crossentropy, a.dtype);
  if (a.dlogits) {
    crossentropy_forward_backward(a.losses, f(a.dlogits), f(a.logits), a.targets, a.dloss, a.N, a.V, a.Vp);
  } else {
    LOOM_CHECK(a.losses, "crossentropy: neither losses nor dlogits");
    crossentropy_forward(a.losses, f(a.logits), a.targets, a.N, a.V, a.Vp);
  }
}

void CpuBackend::vocab_crossentropy(const VocabCrossEntropy& a) {
  check(Op::crossentropy, a.dtype);
  const int64_t N = a.N, Vs = a.Vs;
  const int64_t nv = std::clamp<int64_t>(a.V - a.v0, 0, Vs);  // real columns of this shard
  const float* logits = f(a.logits);
  float* mx = a.stats;        // [N] row max over the whole vocabulary (after the max pass's reduction)
  float* sums = a.stats + N;  // [2N]: sum of exp(l - max), target logit
  // The single device's fused kernel's arithmetic (kernels/cpu/crossentropy.h), on each shard.
  switch (a.pass) {
    case VocabCrossEntropy::Pass::max:
#pragma omp parallel for schedule(static)
      for (int64_t n = 0; n < N; ++n) mx[n] = row_max(logits + n * Vs, nv);
      return;
    case VocabCrossEntropy::Pass::sums:
#pragma omp parallel for schedule(static)
      for (int64_t n = 0; n < N; ++n) {
        const float* l = logits + n * Vs;
        sums[n] = float(row_sum_exp(l, nv, mx[n]));
        const int64_t t = int64_t(a.targets[n]) - a.v0;
        sums[N + n] = (a.targets[n] >= 0 && t >= 0 && t < nv) ? l[t] : 0.0f;
      }
      return;
    case VocabCrossEntropy::Pass::finish: break;
  }
  float* dlogits = f(a.dlogits);
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const bool counted = a.targets[n] >= 0;
    const double lse = double(mx[n]) + std::log(double(sums[n]));
    const float loss = counted ? float(lse - double(sums[N + n])) : 0.0f;
    if (a.losses) a.losses[n] = loss;
    if (!dlogits) continue;
    const float* l = logits + n * Vs;
    float* d = dlogits + n * Vs;
    if (!counted) {
      std::memset(d, 0, size_t(Vs) * sizeof(float));
      continue;
    }
    // d = dloss exp(l - max) / sum, the target column dloss (p_t - 1) from the loss as on one device.
    const int64_t t = int64_t(a.targets[n]) - a.v0;
    scaled_exp(d, l, nv, mx[n], float(double(a.dloss) / double(sums[n])));
    if (t >= 0 && t < nv) d[t] = float(double(a.dloss) * std::expm1(-double(loss)));
    for (int64_t v = nv; v < Vs; ++v) d[v] = 0.0f;
  }
}

void CpuBackend::embedding_forward(const EmbeddingForward& a) {
  check(Op::embedding, a.dtype);
  cpu::embedding_forward(f(a.out), a.tokens, f(a.wte), f(a.wpe), a.B, a.T, a.C, a.V,
                         {.pos0 = a.pos0, .positions = a.positions, .v0 = a.vocab_begin, .Vs = a.vocab_rows});
}

void CpuBackend::embedding_backward(const EmbeddingBackward& a) {
  check(Op::embedding, a.dtype);
  cpu::embedding_backward(a.dwte, a.dwpe, f(a.dout), a.tokens, a.B, a.T, a.C, a.V,
                          {.pos0 = a.pos0, .positions = a.positions, .v0 = a.vocab_begin, .Vs = a.vocab_rows});
}

void CpuBackend::gelu_forward(DType dtype, void* out, const void* inp, int64_t n) {
  check(Op::gelu, dtype);
  cpu::gelu_forward(f(out), f(inp), n);
}

void CpuBackend::gelu_backward(DType dtype, void* dinp, const void* inp, const void* dout, int64_t n) {
  check(Op::gelu, dtype);
  cpu::gelu_backward(f(dinp), f(inp), f(dout), n);
}

void CpuBackend::add(DType dtype, void* out, const void* a, const void* b, int64_t n) {
  check(Op::add, dtype);
  residual_forward(f(out), f(a), f(b), n);
}

void CpuBackend::add_to_host(float* host, const float* src, int64_t n) {
  LOOM_CHECK(n >= 0, "add_to_host: negative size {}", n);
  add_f32(host, src, n);
}

void CpuBackend::sum(const float* x, int64_t n, float scale, float* out) {
  LOOM_CHECK(n >= 0, "sum: negative size {}", n);
  double s = 0;
  for (int64_t i = 0; i < n; ++i) s += x[i];
  *out = float(double(scale) * s);
}

std::unique_ptr<AdamWPlan> CpuBackend::plan_adamw(const std::vector<AdamWTensor>& tensors) {
  return std::make_unique<CpuAdamW>(tensors);
}

void CpuBackend::copy(const Copy& a) {
  check(Op::copy, a.dst_dtype);
  check(Op::copy, a.src_dtype);
  LOOM_CHECK(a.n >= 0, "copy: negative size {}", a.n);
  convert(a.dst, a.dst_dtype, a.src, a.src_dtype, a.n);
}

void CpuBackend::copy_strided(const StridedCopy& a) {
  check(Op::copy, a.dst_dtype);
  check(Op::copy, a.src_dtype);
  check_strided_copy(a);
  const size_t de = dtype_size(a.dst_dtype), se = dtype_size(a.src_dtype);
  const int64_t n = a.batches * a.rows;
#pragma omp parallel for schedule(static) if (n * a.cols > (1 << 16))
  for (int64_t i = 0; i < n; ++i) {
    const int64_t b = i / std::max<int64_t>(a.rows, 1), r = i % std::max<int64_t>(a.rows, 1);
    char* dst = static_cast<char*>(a.dst) + size_t(b * a.dst_batch + r * a.dst_row) * de;
    const char* src = static_cast<const char*>(a.src) + size_t(b * a.src_batch + r * a.src_row) * se;
    if (!a.accumulate) {
      convert(dst, a.dst_dtype, src, a.src_dtype, a.cols);
    } else if (a.src_dtype == DType::f32) {
      float* d = reinterpret_cast<float*>(dst);
      const float* x = reinterpret_cast<const float*>(src);
      for (int64_t c = 0; c < a.cols; ++c) d[c] += x[c];
    } else {
      float* d = reinterpret_cast<float*>(dst);
      const bf16* x = reinterpret_cast<const bf16*>(src);
      for (int64_t c = 0; c < a.cols; ++c) d[c] += bf16_to_f32(x[c]);
    }
  }
}

void CpuBackend::sum_squares(const std::vector<Range>& ranges, double* sums) {
  for (size_t i = 0; i < ranges.size(); ++i) sums[i] = cpu::sum_squares(ranges[i].x, ranges[i].n);
}

void CpuBackend::fill_zero(void* dst, int64_t bytes) {
  LOOM_CHECK(bytes >= 0, "fill_zero: negative size {}", bytes);
  std::memset(dst, 0, size_t(bytes));
}

}  // namespace loom::cpu

// Registration (core/backend.h). The symbol below is named on the link line of every program that
// links loom_lib (CMakeLists.txt), so this file, and with it the registration, is never dropped.
extern "C" {
int loom_cpu_backend_anchor = [] {
  loom::register_backend(loom::Device::cpu, [](const loom::BackendOptions& opt) -> std::unique_ptr<loom::Backend> {
    return std::make_unique<loom::cpu::CpuBackend>(opt);
  });
  return 1;
}();
}
