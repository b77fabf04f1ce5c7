// Launched under mpirun by mpi_test.cpp: trains the tiny GPT with a pipeline schedule on the MPI
// backend and prints rank 0's per-step losses as bits ("loss <step> <hex>").
#include <CLI/CLI.hpp>
#include <cstdio>
#include <string>

#include "parallel/pipeline/pipeline_run_util.h"
#ifdef LOOM_HAVE_MPI
#include "comm/mpi_comm.h"
#endif

int main(int argc, char** argv) {
  CLI::App app{"MPI driver for the pipeline executor tests"};
  std::string kind = "1f1b";
  int p = 2, m = 4, steps = 3, tp = 1;
  app.add_option("--kind", kind, "schedule kind (gpipe, 1f1b, interleaved, zb-h1)");
  app.add_option("--p", p, "pipeline stages");
  app.add_option("--m", m, "micro-batches");
  app.add_option("--steps", steps, "training steps");
  app.add_option("--tp", tp, "tensor parallel ranks per stage");
  CLI11_PARSE(app, argc, argv);
#ifndef LOOM_HAVE_MPI
  std::fprintf(stderr, "pipeline mpi driver: loom was built without MPI\n");
  return 77;
#else
  using namespace loom;
  using namespace loom::parallel::pipeline;
  return comm::run_mpi(&argc, &argv, [&](comm::Comm& c) {
    ScheduleSpec spec;
    spec.kind = parse_kind(kind, "--kind");
    spec.stages = p;
    spec.virtual_stages = spec.kind == Kind::interleaved ? 2 : 1;
    spec.micro_batches = m;
    const std::vector<float> losses = testing::train_tiny(c, spec, steps, tp);
    if (c.rank() == 0) {
      std::printf("%s", testing::loss_lines(losses).c_str());
      std::printf("pipeline mpi driver OK on %d ranks\n", c.size());
      std::fflush(stdout);
    }
  });
#endif
}
