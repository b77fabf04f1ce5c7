// The program the MPI tests launch under mpirun: runs the shared collective checks on the mpi
// backend, or plays a failing rank (throws, is killed, hangs) so the tests can watch the others.
//
//   mpirun -n 3 test_comm_mpi_driver collectives --counts 0,1,7919
//   mpirun -n 3 test_comm_mpi_driver hash --count 1000003 --dtype bf16
//   mpirun -n 3 test_comm_mpi_driver throw --rank 1
//   mpirun -n 3 test_comm_mpi_driver kill --rank 1
//   mpirun -n 2 test_comm_mpi_driver hang --rank 1 --timeout-ms 2000
#include <csignal>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>

#include "comm_util.h"
#include "core/error.h"
#ifdef LOOM_HAVE_MPI
#include "comm/mpi_comm.h"
#endif

int main(int argc, char** argv) {
  CLI::App app{"MPI test driver for loom's comm backends"};
  app.require_subcommand(1);
  app.fallthrough();  // --timeout-ms may follow the subcommand
  std::vector<int64_t> counts{0, 1, 7919};
  std::vector<std::string> dtypes{"f32", "bf16"};
  uint64_t seed = 1;
  int bad_rank = 1;
  int64_t timeout_ms = 60000;
  auto* coll = app.add_subcommand("collectives", "check every collective");
  coll->add_option("--counts", counts, "element counts")->delimiter(',');
  coll->add_option("--dtypes", dtypes, "f32, bf16")->delimiter(',');
  coll->add_option("--seed", seed, "input seed");
  bool all_reduce_only = false;
  coll->add_flag("--all-reduce-only", all_reduce_only, "only all_reduce (sum), for the largest sizes");
  auto* hsh = app.add_subcommand("hash", "print a hash of one all_reduce of the test inputs");
  int64_t hash_count = 1000;
  std::string hash_dtype = "f32";
  hsh->add_option("--count", hash_count, "element count");
  hsh->add_option("--dtype", hash_dtype, "f32 or bf16")->check(CLI::IsMember({"f32", "bf16"}));
  hsh->add_option("--seed", seed, "input seed");
  auto* thr = app.add_subcommand("throw", "one rank throws while the others are in an all_reduce");
  auto* kil = app.add_subcommand("kill", "one rank is killed while the others are in an all_reduce");
  auto* hng = app.add_subcommand("hang", "one rank sleeps while the others wait in an all_reduce");
  for (auto* s : {thr, kil, hng}) s->add_option("--rank", bad_rank, "the failing rank");
  app.add_option("--timeout-ms", timeout_ms, "communicator timeout");
  CLI11_PARSE(app, argc, argv);

#ifndef LOOM_HAVE_MPI
  std::fprintf(stderr, "mpi driver: loom was built without MPI\n");
  return 77;
#else
  using namespace loom;
  comm::CommOptions opts;
  opts.timeout = std::chrono::milliseconds(timeout_ms);
  return comm::run_mpi(&argc, &argv, [&](comm::Comm& c) {
    if (coll->parsed()) {
      comm::testing::CheckPlan plan;
      plan.counts = counts;
      plan.seed = seed;
      plan.dtypes.clear();
      for (auto& d : dtypes) {
        LOOM_CHECK(d == "f32" || d == "bf16", "--dtypes: unknown dtype '{}'", d);
        plan.dtypes.push_back(d == "f32" ? DType::f32 : DType::bf16);
      }
      if (all_reduce_only) {
        for (DType dt : plan.dtypes) {
          for (int64_t n : plan.counts) comm::testing::check_all_reduce(c, n, dt, comm::ReduceOp::sum, seed);
        }
      } else {
        comm::testing::check_collectives(c, plan);
      }
      if (c.rank() == 0) std::printf("collectives OK on %d ranks\n", c.size());
      return;
    }
    if (hsh->parsed()) {
      DType dt = hash_dtype == "f32" ? DType::f32 : DType::bf16;
      std::vector<char> buf(size_t(hash_count) * dtype_size(dt));
      comm::testing::fill_input(buf.data(), dt, hash_count, seed, c.rank());
      c.all_reduce(buf.data(), hash_count, dt);
      comm::testing::check_same_on_all_ranks(c, comm::testing::hash_bytes(buf.data(), buf.size()), "hash");
      if (c.rank() == 0) {
        std::printf("all_reduce hash %016llx\n", (unsigned long long)comm::testing::hash_bytes(buf.data(), buf.size()));
      }
      return;
    }
    std::vector<float> x(1000, 1.f);
    c.all_reduce(x.data(), 1000, DType::f32);  // everybody is up
    if (c.rank() == bad_rank) {
      if (thr->parsed()) throw Error(fmt::format("rank {} raised on purpose", bad_rank));
      if (kil->parsed()) std::raise(SIGKILL);
      if (hng->parsed()) std::this_thread::sleep_for(std::chrono::seconds(120));
    }
    c.all_reduce(x.data(), 1000, DType::f32);
    std::printf("rank %d passed the collective it should not have passed\n", c.rank());
  }, opts);
#endif
}
