#include "model/reference_util.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "core/backend.h"
#include "core/memory.h"
#include "model/gpt.h"
#include "optim/adamw.h"
#include "train/safetensors.h"
#include "train/step_runner.h"

namespace loom::test {

namespace {

int64_t meta_int(const train::SafetensorsReader& r, const std::string& key) { return std::stoll(r.meta(key)); }
double meta_double(const train::SafetensorsReader& r, const std::string& key) { return std::stod(r.meta(key)); }

// ||a - b|| / ||b|| over n elements, in double.
double rel_norm(const float* a, const float* b, int64_t n) {
  double d = 0, s = 0;
  for (int64_t i = 0; i < n; ++i) {
    double x = double(a[i]) - double(b[i]);
    d += x * x;
    s += double(b[i]) * double(b[i]);
  }
  return s > 0 ? std::sqrt(d / s) : std::sqrt(d);
}

}  // namespace

void check_gpt_reference(const std::string& path, const ReferenceTolerance& tol, Device device) {
  train::SafetensorsReader r(path);
  ASSERT_EQ(r.meta("format"), "loom-gpt-reference") << path;
  ASSERT_EQ(r.meta("version"), kReferenceVersion) << path << ": regenerate with scripts/torch_reference.py";

  model::GPTConfig cfg;
  cfg.name = r.meta("model");
  cfg.n_layer = meta_int(r, "n_layer");
  cfg.n_head = meta_int(r, "n_head");
  cfg.n_embd = meta_int(r, "n_embd");
  cfg.vocab_size = meta_int(r, "vocab_size");
  cfg.block_size = meta_int(r, "block_size");
  // The architecture options (a Llama-family dump, scripts/torch_llama_reference.py); a GPT-2
  // dump has none.
  const auto& m = r.metadata();
  auto has = [&](const char* key) { return m.count(key) != 0; };
  if (has("norm")) cfg.norm = model::norm_from_name(r.meta("norm"), path);
  if (has("mlp")) cfg.mlp = model::mlp_from_name(r.meta("mlp"), path);
  if (has("position")) cfg.position = model::position_from_name(r.meta("position"), path);
  if (has("n_kv_head")) cfg.n_kv_head = meta_int(r, "n_kv_head");
  if (has("ffn_hidden")) cfg.ffn_hidden = meta_int(r, "ffn_hidden");
  if (has("bias")) cfg.bias = r.meta("bias") == "true";
  if (has("tied_embeddings")) cfg.tied_embeddings = r.meta("tied_embeddings") == "true";
  if (has("rope_theta")) cfg.rope_theta = meta_double(r, "rope_theta");
  if (has("ln_eps")) cfg.ln_eps = float(meta_double(r, "ln_eps"));
  cfg.validate(path);
  const int64_t B = meta_int(r, "batch"), T = meta_int(r, "seq"), steps = meta_int(r, "steps");
  const int64_t V = cfg.vocab_size, Vp = cfg.padded_vocab();

  MemoryPool pool("reference");
  std::unique_ptr<Backend> be = device == Device::cpu ? make_backend(device, {.pool = &pool}) : make_backend(device);
  model::GPT gpt(cfg, *be);
  for (model::Parameter* p : gpt.parameters()) {
    const std::vector<float> v = r.read_f32("param." + p->spec.name);
    ASSERT_EQ(int64_t(v.size()), p->spec.numel()) << p->spec.name;
    be->upload(p->value.raw(), DType::f32, v.data(), p->spec.numel());
  }
  gpt.refresh_compute();
  auto host = [&](const Tensor& t) {
    std::vector<float> v(static_cast<size_t>(t.numel()));
    be->download(v.data(), t.raw(), t.dtype(), t.numel());
    return v;
  };
  MemoryPool io("reference-io");
  Tensor tokens = r.load("tokens", MemTag::workspace, io);
  Tensor targets = r.load("targets", MemTag::workspace, io);
  ASSERT_EQ(tokens.shape(), (Shape{B, T}));

  // Forward: loss and logits.
  const float loss = gpt.forward(tokens, targets);
  const float ref_loss = r.read_f32("loss").at(0);
  const double loss_err = std::fabs(double(loss) - ref_loss) / std::fabs(double(ref_loss));
  EXPECT_LE(loss_err, tol.loss_rel) << "loss " << loss << " vs reference " << ref_loss;

  std::vector<float> ref_logits = r.read_f32("logits");  // f32 [B, T, V]
  ASSERT_EQ(int64_t(ref_logits.size()), B * T * V);
  std::vector<float> logits(size_t(B * T * V));  // loom's [B, T, Vp] without the padding columns
  const std::vector<float> lpv = host(gpt.logits());
  const float* lp = lpv.data();
  for (int64_t i = 0; i < B * T; ++i)
    for (int64_t j = 0; j < V; ++j) logits[size_t(i * V + j)] = lp[i * Vp + j];
  double pad_max = 0;
  for (int64_t i = 0; i < B * T; ++i)
    for (int64_t j = V; j < Vp; ++j) pad_max = std::max(pad_max, double(std::fabs(lp[i * Vp + j])));
  EXPECT_EQ(pad_max, 0.0) << "padding logits must be zero (wte padding rows are zero)";
  const double logits_err = rel_norm(logits.data(), ref_logits.data(), B * T * V);
  EXPECT_LE(logits_err, tol.logits_rel);

  // Backward: every parameter gradient.
  gpt.backward();
  double worst = 0, sum_sq = 0;
  std::string worst_name;
  for (model::Parameter* p : gpt.parameters()) {
    std::vector<float> ref = r.read_f32("grad." + p->spec.name);
    ASSERT_EQ(int64_t(ref.size()), p->spec.numel()) << p->spec.name;
    const std::vector<float> g = host(p->grad);
    for (float x : g) sum_sq += double(x) * x;
    const double e = rel_norm(g.data(), ref.data(), p->spec.numel());
    EXPECT_LE(e, tol.grad_rel) << "gradient of " << p->spec.name;
    if (e > worst) {
      worst = e;
      worst_name = p->spec.name;
    }
  }
  optim::AdamWConfig oc;
  oc.lr = meta_double(r, "lr");
  oc.beta1 = meta_double(r, "beta1");
  oc.beta2 = meta_double(r, "beta2");
  oc.eps = meta_double(r, "eps");
  oc.weight_decay = meta_double(r, "weight_decay");
  oc.max_norm = float(meta_double(r, "max_norm"));
  const double norm = std::sqrt(sum_sq);
  const double ref_norm = std::stod(r.meta("grad_norm"));
  EXPECT_LE(std::fabs(norm - ref_norm) / ref_norm, tol.grad_norm_rel) << "global gradient norm";

  // Training: the losses of `steps` AdamW steps on the same batch.
  std::vector<float> ref_steps = r.read_f32("step_losses");
  ASSERT_EQ(int64_t(ref_steps.size()), steps);
  double step_err = 0;
  std::string losses;
  std::unique_ptr<optim::AdamW> opt;
  std::unique_ptr<train::StepRunner> run;
  if (device == Device::cpu)
    opt = std::make_unique<optim::AdamW>(gpt.parameters(), oc, pool);
  else
    run = std::make_unique<train::StepRunner>(gpt, train::StepOptions{.B = B, .T = T, .beta1 = oc.beta1,
                                                                      .beta2 = oc.beta2, .eps = oc.eps,
                                                                      .weight_decay = oc.weight_decay,
                                                                      .grad_clip = oc.max_norm});
  for (int64_t s = 0; s < steps; ++s) {
    float l = 0;
    if (opt) {
      gpt.zero_grad();
      l = gpt.forward(tokens, targets, {.fuse_backward = true});
      gpt.backward();
      opt->step();
    } else {
      l = run->train_step(tokens.i32(), targets.i32(), oc.lr, s + 1);
    }
    EXPECT_LE(std::fabs(double(l) - ref_steps[size_t(s)]), tol.step_loss_abs) << "step " << s;
    step_err = std::max(step_err, std::fabs(double(l) - ref_steps[size_t(s)]));
    losses += fmt::format(" {:.5f}", l);
  }
  std::printf("[reference %s on %s] loss %.7f (ref %.7f, rel err %.2e); logits rel err %.2e; worst grad rel err %.2e (%s);"
              " grad norm %.6f (ref %.6f); %lld AdamW step losses%s, max abs err %.2e\n",
              cfg.name.c_str(), be->name().c_str(), double(loss), double(ref_loss), loss_err, logits_err, worst, worst_name.c_str(), norm,
              ref_norm, (long long)steps, losses.c_str(), step_err);
}

}  // namespace loom::test
