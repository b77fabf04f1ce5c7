// Trains GPT-2 on one GPU (the one model, model/gpt.h, on the CUDA backend, its steps run by
// train::StepRunner as CUDA graphs) and reports tokens/s and MFU; optionally writes a
// parity dump (weights, batch, logits, gradients) for bench/nanogpt_torch.py --parity.
//
//   train_gpt2_cuda [--model gpt2-124m] [-B 16] [-T 1024] [--steps 30] [--warmup 5]
//                   [--attention flash|gemm|cudnn] [--no-graph] [--lr 6e-4] [--seed 1337] [--json]
//                   [--dump FILE] [--profile N] [--profile-graph N] [--precision bf16|fp16]
//
// --precision fp16 computes in f16 with dynamic loss scaling from 65536 (train/loss_scale.h, as
// `loom train --train.precision fp16`: a step that overflows is skipped and the scale halved; the
// steps that did are counted in the output); the measured GEMM rate is then f16's.
//
// --profile N runs N more steps op by op with CUDA events between the backend's ops (the backend
// reports each op and its FLOPs to kernels/cuda/profile.cuh) and prints each kind of op's time per
// step, its share and, for GEMMs and attention, its TFLOP/s; the parts' sum against the graphed
// step time shows the launch overhead. --profile-graph N does the same inside the step's CUDA
// graph (the events captured between the ops as graph nodes): the parts as the graphed step runs
// them, without the launch gaps that make small kernels look larger op by op.
//
// Tokens are uniform random ids (a fixed seed): the step's cost does not depend on the data.
// FLOPs per token, as nanoGPT's estimate_mfu: 6 N + 12 L H Q T with N the parameters without
// wpe (wte counted once: it is tied to the output layer), H heads of size Q, sequence length T.
// MFU is given against the H100 SXM dense bf16 datasheet peak (989 TFLOP/s) and against this
// GPU's GEMM rate in the compute dtype measured after the timed steps (cuda::measure_gemm_peak, the
// rate `loom train --train.device cuda` reports against).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/cuda/allocator.cuh"
#include "kernels/cuda/backend.cuh"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/matmul.cuh"
#include "kernels/cuda/profile.cuh"
#include "model/gpt.h"
#include "train/loss_scale.h"
#include "train/safetensors.h"
#include "train/step_runner.h"

using namespace loom;

namespace {

struct Args {
  std::string model = "gpt2-124m";
  int64_t B = 16, T = 1024, steps = 30, warmup = 5;
  std::string attention = "flash";
  bool graph = true, json = false;
  float lr = 6e-4f;
  uint64_t seed = 1337;
  std::string dump;
  int64_t profile = 0, profile_graph = 0;
  std::string precision = "bf16";
};

[[noreturn]] void usage(const std::string& msg) {
  std::fprintf(stderr,
               "train_gpt2_cuda: %s\nusage: train_gpt2_cuda [--model NAME] [-B N] [-T N] [--steps N] [--warmup N] "
               "[--attention flash|gemm|cudnn] [--no-graph] [--lr X] [--seed N] [--json] [--dump FILE] [--profile N] "
               "[--profile-graph N] [--precision bf16|fp16]\n",
               msg.c_str());
  std::exit(2);
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string k = argv[i];
    auto val = [&]() -> std::string {
      if (i + 1 >= argc) usage("option " + k + " needs a value");
      return argv[++i];
    };
    auto num = [&](const std::string& v) -> int64_t {
      char* end = nullptr;
      long long x = std::strtoll(v.c_str(), &end, 10);
      if (!end || *end || x <= 0) usage("option " + k + ": '" + v + "' is not a positive integer");
      return x;
    };
    if (k == "--model") a.model = val();
    else if (k == "-B") a.B = num(val());
    else if (k == "-T") a.T = num(val());
    else if (k == "--steps") a.steps = num(val());
    else if (k == "--warmup") a.warmup = num(val());
    else if (k == "--attention") a.attention = val();
    else if (k == "--no-graph") a.graph = false;
    else if (k == "--json") a.json = true;
    else if (k == "--lr") a.lr = std::stof(val());
    else if (k == "--seed") a.seed = uint64_t(num(val()));
    else if (k == "--dump") a.dump = val();
    else if (k == "--profile") a.profile = num(val());
    else if (k == "--profile-graph") a.profile_graph = num(val());
    else if (k == "--precision") a.precision = val();
    else usage("unknown option " + k);
  }
  if (a.attention != "flash" && a.attention != "gemm" && a.attention != "cudnn")
    usage("--attention must be flash, gemm or cudnn");
  if (a.precision != "bf16" && a.precision != "fp16") usage("--precision must be bf16 or fp16");
  if (a.profile_graph > 0 && !a.graph) usage("--profile-graph profiles the CUDA graph (not with --no-graph)");
  if (!a.dump.empty() && a.precision != "bf16")
    usage("--dump writes the bf16 model's gradients (use --precision bf16)");
  return a;
}

std::vector<int32_t> random_tokens(int64_t n, int64_t V, uint64_t seed) {
  std::mt19937_64 g(seed);
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (auto& x : t) x = int32_t(g() % uint64_t(V));
  return t;
}

void write_dump(train::StepRunner& run, const Args& a, const std::vector<int32_t>& tok, const std::vector<int32_t>& tgt) {
  model::GPT& gpt = run.model();
  const model::GPTConfig& cfg = gpt.config();
  const int64_t B = a.B, T = a.T, V = cfg.vocab_size, Vp = cfg.padded_vocab();
  const float loss = run.forward(tok.data(), tgt.data());
  std::vector<float> lp(static_cast<size_t>(gpt.logits().numel()));
  run.backend().download(lp.data(), gpt.logits().raw(), gpt.logits().dtype(), gpt.logits().numel());
  std::vector<float> logits(static_cast<size_t>(B * T * V));
  for (int64_t i = 0; i < B * T; ++i)
    std::memcpy(&logits[size_t(i * V)], &lp[size_t(i * Vp)], size_t(V) * sizeof(float));
  const float loss2 = run.forward_backward(tok.data(), tgt.data());
  std::vector<std::vector<float>> keep;
  train::SafetensorsWriter w;
  for (const model::Parameter* p : gpt.parameters()) {
    const model::ParamSpec& s = p->spec;
    keep.push_back(run.parameter(s.name));
    w.add("param." + s.name, DType::f32, s.shape, keep.back().data());
    keep.push_back(run.gradient(s.name));
    w.add("grad." + s.name, DType::f32, s.shape, keep.back().data());
  }
  w.add("tokens", DType::i32, {B, T}, tok.data());
  w.add("targets", DType::i32, {B, T}, tgt.data());
  w.add("logits", DType::f32, {B, T, V}, logits.data());
  std::vector<float> l{loss};
  w.add("loss", DType::f32, {1}, l.data());
  w.set_metadata("format", "loom-gpt-cuda-dump");
  w.set_metadata("model", cfg.name);
  w.set_metadata("n_layer", std::to_string(cfg.n_layer));
  w.set_metadata("n_head", std::to_string(cfg.n_head));
  w.set_metadata("n_embd", std::to_string(cfg.n_embd));
  w.set_metadata("vocab_size", std::to_string(cfg.vocab_size));
  w.set_metadata("block_size", std::to_string(cfg.block_size));
  w.set_metadata("attention", a.attention);
  w.write(a.dump);
  std::printf("dump %s: loss %.6f (fused-gradient pass %.6f)\n", a.dump.c_str(), loss, loss2);
}

// One line per part: ms per step, share of the profiled step, TFLOP/s where it declared FLOPs;
// then the parts' sum against the graphed step (graph_ms). With json, one JSON object instead.
void print_profile(const cuda::StepProfile& prof, double graph_ms, bool json) {
  const bool in_graph = prof.in_graph();
  if (prof.steps() == 0) {
    std::printf(json ? "{\"profile_steps\": 0}\n" : "\nno profiled step was counted\n");
    return;
  }
  const double n = double(prof.steps()), total = prof.total_ms() / n;
  if (json) {
    std::printf("{\"profile_steps\": %lld, \"in_graph\": %s, \"profile_ms\": %.4f, \"graph_step_ms\": %.4f, "
                "\"parts\": [",
                (long long)prof.steps(), in_graph ? "true" : "false", total, graph_ms);
    for (size_t i = 0; i < prof.parts().size(); ++i) {
      const auto& p = prof.parts()[i];
      std::printf("%s{\"part\": \"%s\", \"ms\": %.4f, \"tflops\": %.2f}", i ? ", " : "", p.name.c_str(), p.ms / n,
                  p.flops > 0 ? p.flops / (p.ms * 1e-3) / 1e12 : 0.0);
    }
    std::printf("]}\n");
    return;
  }
  std::printf("\nstep parts, kernel by kernel (%lld steps; CUDA events between the parts%s):\n", (long long)prof.steps(),
              in_graph ? ", captured into the step's graph" : ", op by op");
  std::printf("%-40s %10s %7s %9s\n", "part", "ms/step", "share", "TFLOP/s");
  for (const auto& p : prof.parts()) {
    const double ms = p.ms / n;
    if (p.flops > 0)
      std::printf("%-40s %10.3f %6.1f%% %9.1f\n", p.name.c_str(), ms, 100.0 * ms / total, p.flops / (p.ms * 1e-3) / 1e12);
    else
      std::printf("%-40s %10.3f %6.1f%% %9s\n", p.name.c_str(), ms, 100.0 * ms / total, "");
  }
  if (in_graph)
    std::printf("%-40s %10.3f (the graphed step: %.3f ms; the parts as the graph runs them, the event nodes "
                "between them included)\n",
                "sum", total, graph_ms);
  else
    std::printf("%-40s %10.3f (the graphed step: %.3f ms; the parts include the GPU's idle time while the host "
                "launched their kernels one by one)\n",
                "sum", total, graph_ms);
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
  try {
    model::GPTConfig cfg = model::gpt_preset(a.model);
    MemoryPool& pool = cuda::device_pool();
    const DType compute = a.precision == "fp16" ? DType::f16 : DType::bf16;
    const bool fp16 = a.precision == "fp16";
    train::LossScaler scaler(65536, 1000, 1);
    int64_t overflows = 0, updates = 0;  // updates: AdamW's step count (an overflowed step takes none)
    cuda::CudaBackend be({.pool = &pool, .attention = attn_kernel_from_name(a.attention), .compute = compute});
    // The profiles (op by op, and in the graph) outlive the runner, whose graphs hold their events.
    cuda::StepProfile prof(be.stream()), gprof(be.stream(), /*in_graph=*/true);
    model::GPT gpt(cfg, be, a.seed);
    train::StepRunner run(gpt, {.B = a.B, .T = a.T, .graphs = a.graph});
    const int64_t BT = a.B * a.T;
    auto data = random_tokens(BT + 1, cfg.vocab_size, a.seed + 1);
    std::vector<int32_t> tok(data.begin(), data.begin() + BT), tgt(data.begin() + 1, data.end());
    if (!a.dump.empty()) {
      write_dump(run, a, tok, tgt);
      return 0;
    }
    const double flops_per_token = cfg.flops_per_token(a.T);

    cudaEvent_t e0, e1;
    LOOM_CUDA_CHECK(cudaEventCreate(&e0));
    LOOM_CUDA_CHECK(cudaEventCreate(&e1));
    std::vector<double> ms;
    float first_loss = 0, last_loss = 0;
    for (int64_t s = 1; s <= a.warmup + a.steps; ++s) {
      LOOM_CUDA_CHECK(cudaEventRecord(e0, be.stream()));
      const float scale = fp16 ? float(scaler.step_scale()) : 1.f;
      const float loss = run.train_step(tok.data(), tgt.data(), a.lr, updates + 1, scale);
      const bool overflow = !std::isfinite(run.last_grad_norm());
      updates += !overflow;
      if (fp16) {
        overflows += overflow;
        scaler.update(overflow, fmt::format("step {}", s));
      }
      LOOM_CUDA_CHECK(cudaEventRecord(e1, be.stream()));
      LOOM_CUDA_CHECK(cudaEventSynchronize(e1));
      float t = 0;
      LOOM_CUDA_CHECK(cudaEventElapsedTime(&t, e0, e1));
      if (s == 1) first_loss = loss;
      last_loss = loss;
      if (!std::isfinite(loss)) {
        std::fprintf(stderr, "train_gpt2_cuda: loss is %f at step %lld\n", loss, (long long)s);
        return 1;
      }
      if (s > a.warmup) ms.push_back(t);
      if (!a.json && (s <= 3 || s % 10 == 0))
        std::printf("step %4lld loss %.4f norm %.3f %.2f ms\n", (long long)s, loss, run.last_grad_norm(), t);
    }
    // The parts of the step, kernel by kernel.
    if (a.profile > 0) {
      be.set_observer(&prof);  // the runner then launches op by op (no graph)
      for (int64_t i = 0; i < a.profile; ++i) {
        prof.start();
        run.train_step(tok.data(), tgt.data(), a.lr, updates + 1, fp16 ? float(scaler.step_scale()) : 1.f);
        updates += std::isfinite(run.last_grad_norm());
        prof.finish();
      }
      be.set_observer(nullptr);
    }
    // The same inside the graph: a first step captures the graph again with the event nodes (not
    // counted), then N replays.
    if (a.profile_graph > 0) {
      be.set_observer(&gprof);
      for (int64_t i = 0; i <= a.profile_graph; ++i) {
        gprof.start();
        run.train_step(tok.data(), tgt.data(), a.lr, updates + 1, fp16 ? float(scaler.step_scale()) : 1.f);
        updates += std::isfinite(run.last_grad_norm());
        gprof.finish();
      }
      be.set_observer(nullptr);
    }
    // Host time around the step (the token upload and loss read-back included) is what a user
    // sees; device events cover the same span since each step synchronises.
    std::vector<double> sorted = ms;
    std::sort(sorted.begin(), sorted.end());
    const double med = sorted[sorted.size() / 2];
    double mean = 0;
    for (double x : ms) mean += x;
    mean /= double(ms.size());
    const double tps = double(BT) / (med * 1e-3);
    const double tflops = tps * flops_per_token / 1e12;
    cudaDeviceProp prop{};
    LOOM_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    // The training's memory figures are taken before the GEMM measurement borrows its operands.
    const MemStats st = pool.stats();
    const std::string report = pool.report();
    const double peak_tflops = cuda::measure_gemm_peak(be.blas(), be.stream(), compute) / 1e12;
    if (a.json) {
      std::printf("{\"impl\": \"loom\", \"device\": \"%s\", \"model\": \"%s\", \"B\": %lld, \"T\": %lld, "
                  "\"attention\": \"%s\", \"graph\": %s, \"steps\": %lld, \"step_ms_median\": %.4f, "
                  "\"step_ms_mean\": %.4f, \"tokens_per_s\": %.1f, \"flops_per_token\": %.6e, \"tflops\": %.2f, "
                  "\"gemm_peak_tflops\": %.2f, \"mfu_measured\": %.4f, "
                  "\"first_loss\": %.5f, \"last_loss\": %.5f, \"peak_bytes\": %lld, \"precision\": \"%s\", "
                  "\"overflowed_steps\": %lld}\n",
                  prop.name, cfg.name.c_str(), (long long)a.B, (long long)a.T, a.attention.c_str(),
                  a.graph ? "true" : "false", (long long)a.steps, med, mean, tps, flops_per_token, tflops,
                  peak_tflops, tflops / peak_tflops, first_loss, last_loss, (long long)st.total_peak,
                  a.precision.c_str(), (long long)overflows);
    } else {
      std::printf("%s on %s: B=%lld T=%lld attention=%s graph=%d precision=%s: %.2f ms/step (median of %lld; mean "
                  "%.2f), %.0f tokens/s, %.1f TFLOP/s (MFU %.1f%% of 989, %.1f%% of the measured %s GEMM rate "
                  "%.1f TFLOP/s), loss %.4f -> %.4f\n%s",
                  cfg.name.c_str(), prop.name, (long long)a.B, (long long)a.T, a.attention.c_str(), int(a.graph),
                  a.precision.c_str(), med, (long long)a.steps, mean, tps, tflops, 100.0 * tflops / 989.0,
                  100.0 * tflops / peak_tflops, fp16 ? "f16" : "bf16", peak_tflops, first_loss, last_loss,
                  report.c_str());
      if (fp16)
        std::printf("fp16: %lld of %lld steps overflowed (skipped); loss scale now %g\n", (long long)overflows,
                    (long long)(a.warmup + a.steps), scaler.scale());
    }
    if (a.profile > 0) print_profile(prof, med, a.json);
    if (a.profile_graph > 0) print_profile(gprof, med, a.json);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train_gpt2_cuda: %s\n", e.what());
    return 1;
  }
  return 0;
}
