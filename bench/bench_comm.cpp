// all_reduce bus bandwidth of the comm backends: busbw = 2 (n - 1) / n * bytes / time, the
// figure that is comparable across world sizes (each rank sends and receives that much in a ring).
//
//   bench_comm                                  threads backend, worlds 2 and 4, 1/16/128 MB f32
//   bench_comm --worlds 2,8 --sizes 1,64 --dtype bf16 --iters 20
//   mpirun -n 2 bench_comm --mpi                mpi backend, one rank per process
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "comm/comm.h"
#include "comm/threads.h"
#ifdef LOOM_HAVE_MPI
#include "comm/mpi_comm.h"
#endif
#include "core/error.h"

namespace {

using loom::DType;
using loom::comm::Comm;
using Clock = std::chrono::steady_clock;

struct Result {
  double seconds = 0;  // median time of one all_reduce
};

// Times `iters` all_reduces of `bytes` (after `warmup` untimed ones); every rank returns the
// median over iterations of the slowest rank's time (a barrier separates iterations).
Result time_all_reduce(Comm& c, size_t bytes, DType dt, int warmup, int iters) {
  int64_t count = int64_t(bytes / loom::dtype_size(dt));
  std::vector<char> buf(bytes);
  if (dt == DType::f32) {
    for (int64_t i = 0; i < count; ++i) reinterpret_cast<float*>(buf.data())[i] = float(i % 251) * 0.25f;
  } else {
    for (int64_t i = 0; i < count; ++i) reinterpret_cast<loom::bf16*>(buf.data())[i] = loom::f32_to_bf16(float(i % 251));
  }
  for (int i = 0; i < warmup; ++i) c.all_reduce(buf.data(), count, dt);
  std::vector<float> times;
  for (int i = 0; i < iters; ++i) {
    c.barrier();
    auto t0 = Clock::now();
    c.all_reduce(buf.data(), count, dt);
    float t = std::chrono::duration<float>(Clock::now() - t0).count();
    c.all_reduce(&t, 1, DType::f32, loom::comm::ReduceOp::max);
    times.push_back(t);
  }
  std::sort(times.begin(), times.end());
  return {times[times.size() / 2]};
}

void report(const char* backend, int n, size_t bytes, DType dt, const Result& r) {
  double algbw = double(bytes) / r.seconds / 1e9;
  double busbw = n > 1 ? algbw * 2.0 * (n - 1) / n : 0.0;
  std::printf("%-8s %5d %8.0f MB %5s %11.3f ms %9.2f GB/s %9.2f GB/s\n", backend, n, double(bytes) / (1 << 20),
              std::string(loom::dtype_name(dt)).c_str(), r.seconds * 1e3, algbw, busbw);
  std::fflush(stdout);
}

void header() {
  std::printf("%-8s %5s %11s %5s %14s %14s %14s\n", "backend", "world", "size", "dtype", "time (median)", "algbw",
              "busbw");
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"all_reduce bus bandwidth of the comm backends"};
  bool mpi = false;
  std::vector<int> worlds{2, 4};
  std::vector<double> sizes_mb{1, 16, 128};
  std::string dtype = "f32";
  int iters = 10, warmup = 2;
  app.add_flag("--mpi", mpi, "use the mpi backend (run under mpirun; the world is mpirun's -n)");
  app.add_option("--worlds", worlds, "threads backend: world sizes")->delimiter(',');
  app.add_option("--sizes", sizes_mb, "buffer sizes in MB (2^20 bytes)")->delimiter(',');
  app.add_option("--dtype", dtype, "f32 or bf16")->check(CLI::IsMember({"f32", "bf16"}));
  app.add_option("--iters", iters, "timed iterations (the median is reported)")->check(CLI::PositiveNumber);
  app.add_option("--warmup", warmup, "untimed iterations first")->check(CLI::NonNegativeNumber);
  CLI11_PARSE(app, argc, argv);
  DType dt = dtype == "f32" ? DType::f32 : DType::bf16;
  auto bytes_of = [&](double mb) {
    size_t b = size_t(mb * (1 << 20));
    return b / 4 * 4;
  };
  try {
    if (mpi) {
#ifdef LOOM_HAVE_MPI
      return loom::comm::run_mpi(&argc, &argv, [&](Comm& c) {
        if (c.rank() == 0) header();
        for (double mb : sizes_mb) {
          Result r = time_all_reduce(c, bytes_of(mb), dt, warmup, iters);
          if (c.rank() == 0) report("mpi", c.size(), bytes_of(mb), dt, r);
        }
      });
#else
      std::fprintf(stderr, "bench_comm: built without MPI\n");
      return 2;
#endif
    }
    header();
    for (int n : worlds) {
      for (double mb : sizes_mb) {
        Result res;
        loom::comm::run_ranks(n, [&](Comm& c) {
          Result r = time_all_reduce(c, bytes_of(mb), dt, warmup, iters);
          if (c.rank() == 0) res = r;
        });
        report("threads", n, bytes_of(mb), dt, res);
      }
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_comm: %s\n", e.what());
    return 1;
  }
  return 0;
}
