// Shared by the MPI test of the pipeline executor and the driver it launches under mpirun: one
// deterministic tiny-GPT training run on a world communicator (any backend), and the launcher.
#pragma once
#include <string>
#include <vector>

#include "comm/comm.h"
#include "parallel/pipeline/schedule.h"

namespace loom::parallel::pipeline::testing {

// Trains the tiny GPT for `steps` steps with pipeline schedule `spec` over world.size() ranks
// (pp = spec.stages, tensor parallel tp, dp = world.size() / (pp tp)); returns the per-step
// losses (the same on every rank).
std::vector<float> train_tiny(comm::Comm& world, const ScheduleSpec& spec, int steps, int tp = 1);

// The losses as "loss <step> <hex bits of the f32>" lines, for bitwise comparison across processes.
std::string loss_lines(const std::vector<float>& losses);

struct MpirunResult {
  bool skipped = false;  // no MPI build, no mpirun or no driver: output says why
  int status = -1;       // exit status of mpirun (128 + signal if it was killed)
  std::string output;    // stdout and stderr of every rank and of mpirun
};
// Runs `mpirun -n n <driver next to this executable> args` (oversubscribed; as root when needed),
// killed after limit_s seconds.
MpirunResult run_mpirun(const std::string& driver, int n, const std::string& args, int limit_s);

}  // namespace loom::parallel::pipeline::testing
