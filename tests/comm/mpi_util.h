// Launching the MPI test driver (mpi_driver_main.cpp) under mpirun from a GoogleTest test.
#pragma once
#include <string>

namespace loom::comm::testing {

struct DriverRun {
  bool skipped = false;  // no MPI build, no mpirun or no driver: output says why
  int status = -1;       // exit status of mpirun (128 + signal if it was killed)
  double seconds = 0;
  std::string output;    // stdout and stderr of every rank and of mpirun
};

// Runs `mpirun -n n <driver> args` (oversubscribed; as root when needed), killed after
// limit_s seconds.
DriverRun run_driver(int n, const std::string& args, int limit_s);

}  // namespace loom::comm::testing
