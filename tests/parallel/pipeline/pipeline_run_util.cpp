#include "parallel/pipeline/pipeline_run_util.h"

#include <sys/wait.h>
#include <unistd.h>

#include <bit>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>

#include <fmt/format.h>

#include "core/error.h"
#include "core/memory.h"
#include "core/tensor.h"
#include "model/config.h"
#include "parallel/mesh.h"
#include "parallel/pipeline/executor.h"

namespace loom::parallel::pipeline::testing {

std::vector<float> train_tiny(comm::Comm& world, const ScheduleSpec& spec, int steps, int tp) {
  LOOM_CHECK(world.size() % (spec.stages * tp) == 0, "train_tiny: {} ranks is not a multiple of p x tp = {}",
             world.size(), spec.stages * tp);
  const int dp = world.size() / (spec.stages * tp);
  constexpr int64_t kBatch = 8, kT = 8;  // per data-parallel replica
  model::GPTConfig cfg;
  cfg.name = "pipeline-mpi-tiny";
  cfg.n_layer = 4;
  cfg.n_head = 2;
  cfg.n_embd = 32;
  cfg.vocab_size = 97;
  cfg.block_size = 16;
  Mesh mesh = Mesh::standard(spec.stages, dp, 1, tp);
  auto pp = split_comm(mesh, world, {"pp"});
  auto dpc = split_comm(mesh, world, {"dp"});
  auto tpc = split_comm(mesh, world, {"tp"});
  MemoryPool pool("rank" + std::to_string(world.rank()));
  ExecutorOptions o;
  o.schedule = spec;
  o.adamw.lr = 1e-2;
  o.adamw.max_norm = 0.5f;
  o.tp = tp;
  PipelineExecutor ex(cfg, o, *pp, dpc.get(), pool, {tpc.get(), nullptr});
  std::mt19937 rng(4321);
  std::vector<float> losses;
  for (int s = 0; s < steps; ++s) {
    // The global batch i32 [dp * kBatch, kT] is drawn on every rank; each replica takes its rows.
    Tensor x = Tensor::empty({dp * kBatch, kT}, DType::i32, MemTag::activations, pool);
    Tensor y = Tensor::empty({dp * kBatch, kT}, DType::i32, MemTag::activations, pool);
    for (int64_t i = 0; i < x.numel(); ++i) {
      x.i32()[i] = int32_t(rng() % uint32_t(cfg.vocab_size));
      y.i32()[i] = int32_t(rng() % uint32_t(cfg.vocab_size));
    }
    losses.push_back(ex.step(x.slice0(dpc->rank() * kBatch, kBatch), y.slice0(dpc->rank() * kBatch, kBatch)).loss);
  }
  return losses;
}

std::string loss_lines(const std::vector<float>& losses) {
  std::string out;
  for (size_t s = 0; s < losses.size(); ++s)
    out += fmt::format("loss {} {:08x} ({:.7f})\n", s, std::bit_cast<uint32_t>(losses[s]), losses[s]);
  return out;
}

namespace {
std::string find_in_path(const std::string& name) {
  const char* path = std::getenv("PATH");
  if (!path) return "";
  const std::string p = path;
  size_t start = 0;
  while (start <= p.size()) {
    size_t end = p.find(':', start);
    if (end == std::string::npos) end = p.size();
    const std::filesystem::path cand = std::filesystem::path(p.substr(start, end - start)) / name;
    if (!cand.empty() && ::access(cand.c_str(), X_OK) == 0) return cand.string();
    start = end + 1;
  }
  return "";
}
}  // namespace

MpirunResult run_mpirun(const std::string& driver_name, int n, const std::string& args, int limit_s) {
  MpirunResult r;
#ifndef LOOM_HAVE_MPI
  r.skipped = true;
  r.output = "loom was built without MPI";
  return r;
#else
  const std::string mpirun = find_in_path("mpirun");
  if (mpirun.empty()) {
    r.skipped = true;
    r.output = "mpirun not found in PATH; install OpenMPI to run the MPI pipeline tests";
    return r;
  }
  std::error_code ec;
  const auto self = std::filesystem::read_symlink("/proc/self/exe", ec);
  const auto driver = self.parent_path() / driver_name;
  if (ec || !std::filesystem::exists(driver)) {
    r.skipped = true;
    r.output = fmt::format("the MPI driver {} was not built next to the test", driver_name);
    return r;
  }
  const std::string root = ::geteuid() == 0 ? "--allow-run-as-root " : "";
  // One OpenMP thread per process, as the threads backend gives each of n ranks on a small host:
  // the same GEMM team size on both backends, and no spinning teams oversubscribing the cores.
  const std::string cmd = fmt::format("OMP_NUM_THREADS=1 timeout -k 5 {} {} {}--oversubscribe -n {} {} {} 2>&1",
                                      limit_s, mpirun, root, n, driver.string(), args);
  FILE* f = ::popen(cmd.c_str(), "r");
  if (!f) {
    r.output = "popen failed for: " + cmd;
    return r;
  }
  char buf[4096];
  size_t got;
  while ((got = std::fread(buf, 1, sizeof buf, f)) > 0) r.output.append(buf, got);
  const int st = ::pclose(f);
  if (WIFEXITED(st)) r.status = WEXITSTATUS(st);
  else if (WIFSIGNALED(st)) r.status = 128 + WTERMSIG(st);
  if (r.status == 124) r.output += fmt::format("\n[mpirun did not finish within {} s]", limit_s);
  r.output = "$ " + cmd + "\n" + r.output;
  return r;
#endif
}

}  // namespace loom::parallel::pipeline::testing
