#include "plan/calibration.h"

#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "comm/threads.h"
#include "core/error.h"
#include "kernels/cpu/matmul.h"

namespace fs = std::filesystem;

namespace loom::plan {

namespace {

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

std::string today() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[16];
  std::strftime(buf, sizeof(buf), "%Y-%m-%d", &tm);
  return buf;
}

nlohmann::json to_json(const HostProfile& p) {
  return {{"cpu", p.cpu},
          {"cores", p.cores},
          {"threads", p.threads},
          {"gemm_peak_flops", p.gemm_peak},
          {"gemm_typical_flops", p.gemm_typical},
          {"gemm_small_flops", p.gemm_small},
          {"memory_bytes_per_s", p.memory_bw},
          {"allreduce_latency_s", p.allreduce_latency},
          {"allreduce_bytes_per_s", p.allreduce_bw},
          {"source", p.source},
          {"date", p.date}};
}

std::optional<HostProfile> from_json(const nlohmann::json& j) {
  try {
    HostProfile p;
    p.cpu = j.at("cpu").get<std::string>();
    p.cores = j.at("cores").get<int>();
    p.threads = j.at("threads").get<int>();
    p.gemm_peak = j.at("gemm_peak_flops").get<double>();
    p.gemm_typical = j.value("gemm_typical_flops", 0.0);
    p.gemm_small = j.value("gemm_small_flops", 0.0);
    p.memory_bw = j.value("memory_bytes_per_s", 0.0);
    p.allreduce_latency = j.value("allreduce_latency_s", 0.0);
    p.allreduce_bw = j.value("allreduce_bytes_per_s", 0.0);
    p.source = j.value("source", std::string());
    p.date = j.value("date", std::string());
    if (!(p.gemm_peak > 0) || p.threads <= 0) return std::nullopt;
    return p;
  } catch (const nlohmann::json::exception&) {
    return std::nullopt;
  }
}

nlohmann::json read_cache() {
  std::ifstream f(calibration_path());
  if (!f) return nlohmann::json::array();
  try {
    nlohmann::json j = nlohmann::json::parse(f);
    return j.is_array() ? j : nlohmann::json::array();
  } catch (const nlohmann::json::exception&) {
    return nlohmann::json::array();  // an unreadable cache is measured again, not an error
  }
}

// The best sustained rate of C[M, N] = A[M, K] B[K, N] (the kernel's own measurement, in rounds
// of at least `seconds` / 4), once two rounds agree within 2% (at most 8).
double gemm_rate(int64_t M, int64_t N, int64_t K, double seconds) {
  double best = 0, last = 0;
  for (int round = 0; round < 8; ++round) {
    const double rate = cpu::measure_gemm_gflops(M, N, K, seconds / 4) * 1e9;
    best = std::max(best, rate);
    if (round > 0 && std::abs(rate - last) <= 0.02 * std::max(rate, last)) break;
    last = rate;
  }
  return best;
}

}  // namespace

std::string host_cpu_name() {
  std::ifstream f("/proc/cpuinfo");
  for (std::string line; std::getline(f, line);)
    if (line.rfind("model name", 0) == 0) {
      const size_t colon = line.find(':');
      std::string s = colon == std::string::npos ? line : line.substr(colon + 1);
      s.erase(0, s.find_first_not_of(' '));
      return s;
    }
  return "unknown cpu";
}

int host_cores() { return int(std::max<long>(1, ::sysconf(_SC_NPROCESSORS_ONLN))); }

std::string calibration_path() {
  if (const char* d = std::getenv("LOOM_CACHE_DIR"); d && *d) return (fs::path(d) / "calibration.json").string();
  if (const char* d = std::getenv("XDG_CACHE_HOME"); d && *d) return (fs::path(d) / "loom" / "calibration.json").string();
  if (const char* h = std::getenv("HOME"); h && *h) return (fs::path(h) / ".cache" / "loom" / "calibration.json").string();
  return (fs::temp_directory_path() / "loom-calibration.json").string();
}

std::optional<HostProfile> cached_profile(int threads) {
  const std::string cpu = host_cpu_name();
  const int cores = host_cores();
  for (const auto& e : read_cache())
    if (auto p = from_json(e); p && p->cpu == cpu && p->cores == cores && p->threads == threads) return p;
  return std::nullopt;
}

void save_profile(const HostProfile& p) {
  nlohmann::json all = read_cache(), kept = nlohmann::json::array();
  for (const auto& e : all) {
    auto q = from_json(e);
    if (q && !(q->cpu == p.cpu && q->cores == p.cores && q->threads == p.threads)) kept.push_back(e);
  }
  kept.push_back(to_json(p));
  const fs::path path = calibration_path();
  std::error_code ec;
  fs::create_directories(path.parent_path(), ec);
  const std::string tmp = path.string() + fmt::format(".{}.tmp", ::getpid());
  {
    std::ofstream f(tmp, std::ios::trunc);
    if (!f) throw Error(fmt::format("{}: cannot write the calibration cache", tmp));
    f << kept.dump(2) << "\n";
    if (!f) throw Error(fmt::format("{}: cannot write the calibration cache", tmp));
  }
  fs::rename(tmp, path, ec);
  if (ec) throw Error(fmt::format("{}: cannot replace the calibration cache: {}", path.string(), ec.message()));
}

HostProfile calibrate_host(int threads, double seconds) {
  LOOM_CHECK(threads >= 1, "calibrate: threads must be at least 1, got {}", threads);
  HostProfile p;
  p.cpu = host_cpu_name();
  p.cores = host_cores();
  p.threads = threads;
  p.source = "loom calibrate";
  p.date = today();
  const int before = omp_get_max_threads();
  omp_set_num_threads(threads);
  // A transformer layer's products at 2048 tokens: qkv, attention output, MLP up and down.
  std::vector<double> rates;
  for (int64_t C : {512, 768, 1024, 2048}) {
    const int64_t M = 2048;
    for (auto [N, K] : {std::pair{3 * C, C}, std::pair{C, C}, std::pair{4 * C, C}, std::pair{C, 4 * C}})
      rates.push_back(gemm_rate(M, N, K, seconds));
  }
  std::sort(rates.begin(), rates.end());
  p.gemm_peak = rates.back();
  p.gemm_typical = rates[rates.size() / 2];
  // The same four products of a width-128 layer for 64 tokens.
  std::vector<double> small;
  for (auto [N, K] : {std::pair{384, 128}, std::pair{128, 128}, std::pair{512, 128}, std::pair{128, 512}})
    small.push_back(gemm_rate(64, N, K, seconds));
  std::sort(small.begin(), small.end());
  p.gemm_small = small[small.size() / 2];
  // Memory: a copy of 128 MiB (read and write counted), best of 5.
  {
    const size_t n = size_t(32) << 20;
    std::vector<float> src(n, 1.0f), dst(n, 0.0f);
    double best = 0;
    for (int k = 0; k < 5; ++k) {
      const auto t0 = Clock::now();
#pragma omp parallel for schedule(static)
      for (int64_t c = 0; c < 64; ++c) {
        const size_t chunk = n / 64;
        std::memcpy(dst.data() + size_t(c) * chunk, src.data() + size_t(c) * chunk, chunk * sizeof(float));
      }
      best = std::max(best, 2.0 * double(n) * sizeof(float) / since(t0));
    }
    p.memory_bw = best;
  }
  omp_set_num_threads(before);
  // The threads backend between two ranks: latency of 1 KiB all-reduces, bandwidth of 32 MiB ones.
  {
    comm::RunOptions ro;
    ro.threads_per_rank = 1;
    double lat = 0, bw = 0;
    comm::run_ranks(2, [&](comm::Comm& c) {
      std::vector<float> small(256, 1.0f), big(size_t(8) << 20, 1.0f);
      c.barrier();
      auto t0 = Clock::now();
      for (int i = 0; i < 200; ++i) c.all_reduce(small.data(), int64_t(small.size()), DType::f32);
      const double l = since(t0) / 200;
      c.barrier();
      t0 = Clock::now();
      for (int i = 0; i < 5; ++i) c.all_reduce(big.data(), int64_t(big.size()), DType::f32);
      const double b = 5.0 * double(big.size()) * sizeof(float) / since(t0);
      if (c.rank() == 0) lat = l, bw = b;
    }, ro);
    p.allreduce_latency = lat;
    p.allreduce_bw = bw;
  }
  return p;
}

}  // namespace loom::plan
