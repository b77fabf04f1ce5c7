#include "plan/cluster.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <filesystem>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <toml++/toml.h>

#include "core/error.h"
#include "plan/calibration.h"

namespace loom::plan {

namespace {

// A built-in device: its name, dense peaks (FLOP/s), efficiency, memory and bandwidth (bytes, /s).
Device device(std::string name, double peak_bf16, double peak_f32, double efficiency, double memory, double memory_bw) {
  Device d;
  d.name = std::move(name);
  d.peak_bf16 = peak_bf16, d.peak_f32 = peak_f32, d.efficiency = efficiency;
  d.memory = memory, d.memory_bw = memory_bw;
  return d;
}

Cluster builtin(const std::string& name) {
  Cluster c;
  c.name = name;
  if (name == "a100-80gb") {
    // efficiency: calibrated once, against Megatron-LM 2021's Table 1 (the value that minimises the
    // worst error over its ten rows, tests/plan/planner_test.cpp). The H100 and H200 profiles keep
    // an uncalibrated 0.5 until measured runs calibrate them.
    c.device = device("A100 80GB SXM", 312e12, 19.5e12, 0.63, 80e9, 2.0e12);
    c.per_node = 8;
    c.intra = {300e9, 5e-6};
    c.inter = {25e9, 10e-6};
    c.host = {25e9, 10e-6};
    c.host_memory_bw = 409.6e9 / 8;
    c.host_memory = 2e12 / 8;
  } else if (name == "h100-sxm") {
    c.device = device("H100 SXM", 989e12, 67e12, 0.5, 80e9, 3.35e12);
    c.per_node = 8;
    c.intra = {450e9, 5e-6};
    c.inter = {50e9, 10e-6};
    c.host = {50e9, 10e-6};
    c.host_memory_bw = 614.4e9 / 8;
    c.host_memory = 2e12 / 8;
  } else if (name == "h200") {  // an H100 SXM's compute and links with more, faster memory
    c = builtin("h100-sxm");
    c.name = name;
    c.device.name = "H200";
    c.device.memory = 141e9;
    c.device.memory_bw = 4.8e12;
  } else if (name == "cpu") {
    // A modest host's defaults; `loom calibrate` replaces them with measured ones.
    c.device = device("cpu", 100e9, 100e9, 0.6, 16e9, 20e9);
    c.per_node = 64;
    c.shared_host = true;
    c.cores = omp_get_max_threads();
    c.intra = {5e9, 20e-6};
    c.inter = {1e9, 50e-6};
  } else {
    throw Error(fmt::format("cluster '{}': not a built-in (a100-80gb, h100-sxm, h200, cpu) nor a file", name));
  }
  return c;
}

}  // namespace

Cluster read_cluster(const std::string& path) {
  toml::table t;
  try {
    t = toml::parse_file(path);
  } catch (const toml::parse_error& e) {
    throw Error(fmt::format("{}: {} (line {})", path, e.description(), e.source().begin.line));
  }
  std::string base = "a100-80gb";
  if (auto b = t["base"]) {
    if (!b.is_string()) throw Error(fmt::format("{}: base must be the name of a built-in", path));
    base = b.as_string()->get();
  }
  Cluster c;
  try {
    c = builtin(base);
  } catch (const Error&) {
    throw Error(fmt::format("{}: base '{}' is not a built-in cluster (a100-80gb, h100-sxm, h200, cpu)", path, base));
  }
  c.name = std::filesystem::path(path).stem().string();
  // Each field within what hardware has (by orders of magnitude either way): a rate of 1e-300
  // gave step times of 300 digits.
  const std::map<std::string, std::pair<double, double>> ranges{
      {"peak_tflops_bf16", {1e-3, 1e6}}, {"peak_tflops_f32", {1e-3, 1e6}}, {"efficiency", {1e-3, 1}},
      {"gemm_half", {1e-3, 1e15}},       {"memory_gb", {1e-3, 1e6}},       {"memory_gbs", {1e-3, 1e6}},
      {"intra_gbs", {1e-3, 1e6}},        {"inter_gbs", {1e-3, 1e6}},
      {"host_gbs", {1e-3, 1e6}},         {"host_memory_gbs", {1e-3, 1e6}}, {"host_memory_gb", {1e-3, 1e9}},
      {"intra_latency_us", {1e-3, 1e7}}, {"inter_latency_us", {1e-3, 1e7}}, {"host_latency_us", {1e-3, 1e7}}};
  auto number = [&](const toml::node& v, const std::string& field) -> double {
    double x = 0;
    if (v.is_integer()) x = double(v.as_integer()->get());
    else if (v.is_floating_point()) x = v.as_floating_point()->get();
    else throw Error(fmt::format("{}: {} must be a number", path, field));
    if (!(x > 0) || !std::isfinite(x)) throw Error(fmt::format("{}: {} must be positive and finite, got {}", path, field, x));
    const auto it = ranges.find(field.substr(field.find('.') + 1));
    if (it != ranges.end() && (x < it->second.first || x > it->second.second))
      throw Error(fmt::format("{}: {} must be from {:g} to {:g}, got {:g}", path, field, it->second.first,
                              it->second.second, x));
    return x;
  };
  for (auto&& [k, v] : t) {
    const std::string key(k.str());
    if (key == "base") continue;
    const toml::table* tab = v.as_table();
    if (!tab || (key != "device" && key != "cluster"))
      throw Error(fmt::format("{}: unknown entry '{}' (tables: [device], [cluster]; key: base)", path, key));
    for (auto&& [fk, fv] : *tab) {
      const std::string f(fk.str()), field = key + "." + f;
      if (key == "device" && f == "name") {
        if (!fv.is_string()) throw Error(fmt::format("{}: device.name must be a string", path));
        c.device.name = fv.as_string()->get();
      } else if (key == "device" && f == "peak_tflops_bf16") c.device.peak_bf16 = number(fv, field) * 1e12;
      else if (key == "device" && f == "peak_tflops_f32") c.device.peak_f32 = number(fv, field) * 1e12;
      else if (key == "device" && f == "efficiency") c.device.efficiency = number(fv, field);
      else if (key == "device" && f == "gemm_half") c.device.gemm_half = number(fv, field);
      else if (key == "device" && f == "memory_gb") c.device.memory = number(fv, field) * 1e9;
      else if (key == "device" && f == "memory_gbs") c.device.memory_bw = number(fv, field) * 1e9;
      else if (key == "cluster" && f == "gpus_per_node") {
        const double n = number(fv, field);  // 8 or 8.0
        if (n != std::floor(n) || n > double(1 << 20))
          throw Error(fmt::format("{}: {} must be a whole number from 1 to 2^20, got {}", path, field, n));
        c.per_node = int(n);
      }
      else if (key == "cluster" && f == "intra_gbs") c.intra.bandwidth = number(fv, field) * 1e9;
      else if (key == "cluster" && f == "intra_latency_us") c.intra.latency = number(fv, field) * 1e-6;
      else if (key == "cluster" && f == "inter_gbs") c.inter.bandwidth = number(fv, field) * 1e9;
      else if (key == "cluster" && f == "inter_latency_us") c.inter.latency = number(fv, field) * 1e-6;
      else if (key == "cluster" && f == "host_gbs") c.host.bandwidth = number(fv, field) * 1e9;
      else if (key == "cluster" && f == "host_latency_us") c.host.latency = number(fv, field) * 1e-6;
      else if (key == "cluster" && f == "host_memory_gbs") c.host_memory_bw = number(fv, field) * 1e9;
      else if (key == "cluster" && f == "host_memory_gb") c.host_memory = number(fv, field) * 1e9;
      else
        throw Error(fmt::format("{}: unknown field {} (device: name, peak_tflops_bf16, peak_tflops_f32, efficiency, "
                                "gemm_half, memory_gb, memory_gbs; cluster: gpus_per_node, intra_gbs, intra_latency_us, "
                                "inter_gbs, inter_latency_us, host_gbs, host_latency_us, host_memory_gbs, "
                                "host_memory_gb)",
                                path, field));
    }
  }
  if (c.device.efficiency > 1)
    throw Error(fmt::format("{}: device.efficiency must be a share of peak in (0, 1], got {}", path, c.device.efficiency));
  return c;
}

std::string cluster_for_gpu(const std::string& gpu_name) {
  // By whole words of the name ("NVIDIA RTX A1000" is no A100).
  std::vector<std::string> words;
  std::string w;
  for (const char ch : gpu_name + " ") {
    if (ch == ' ' || ch == '-' || ch == '_') {
      if (!w.empty()) words.push_back(w);
      w.clear();
    } else {
      w += ch;
    }
  }
  const auto has = [&](const char* x) { return std::find(words.begin(), words.end(), x) != words.end(); };
  if (has("H200")) return "h200";
  if (has("H100")) return "h100-sxm";
  if (has("A100")) return "a100-80gb";
  return "";
}

Cluster cluster_named(const std::string& name) {
  if (std::filesystem::exists(name) && !std::filesystem::is_directory(name)) return read_cluster(name);
  Cluster c = builtin(name);
  if (name == "cpu") {  // this host's measured rates, where `loom calibrate` has run
    if (const auto p = cached_profile(omp_get_max_threads())) {
      c.device.name = fmt::format("{} ({} threads, calibrated {})", p->cpu, p->threads, p->date);
      c.cores = p->threads;
      c.crowded_sync = p->crowded_sync;
      c.wake = p->wake;
      c.crowded_wake = p->crowded_wake;
      c.balance = p->balance;
      c.device.kernels = p->kernels;
      c.device.linear = p->linear;
      c.device.blocks = p->blocks;
      c.device.peak_f32 = p->gemm_peak;
      c.device.peak_bf16 = p->gemm_peak;
      c.device.efficiency = p->gemm_typical > 0 ? p->gemm_typical / p->gemm_peak : 1.0;
      if (p->memory_bw > 0) c.device.memory_bw = p->memory_bw;
      if (p->allreduce_bw > 0) c.intra = {p->allreduce_bw, p->allreduce_latency};
      // The size effect: a product with n = 64 x 128 outputs runs at gemm_small, a large one at
      // gemm_typical, so gemm_typical x n / (n + half) = gemm_small.
      if (p->gemm_small > 0 && p->gemm_typical > p->gemm_small)
        c.device.gemm_half = 64.0 * 128.0 * (p->gemm_typical / p->gemm_small - 1.0);
    } else {
      c.device.name = "cpu (uncalibrated defaults: run `loom calibrate` for this host's rates)";
    }
  }
  return c;
}

}  // namespace loom::plan
