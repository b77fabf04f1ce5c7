// The mpi backend: one rank per process, over OpenMPI (`mpirun -n 4 loom train CONFIG --comm mpi`,
// on one host or many through mpirun's host files). Exists when loom is built with MPI
// (LOOM_HAVE_MPI); this header declares it either way, so guard uses with that macro.
//
// Reductions run the ring of comm.h over nonblocking point-to-point messages (not MPI_Allreduce),
// so the results are bit-identical to the threads backend's. Partial sums travel in f32 (bf16
// inputs are sent as bf16 on the first step only) and bf16 results are rounded once. Gathers are
// rings too; broadcast and barrier are MPI's nonblocking collectives. Every wait polls its
// requests against the communicator's timeout. Ring messages travel in 1 MiB pieces, each combined
// on arrival; the staging buffers (two f32 partial chunks, about 2/n of the largest reduction, plus
// its bf16 input chunk) are kept by the communicator between calls, tagged MemTag::comm.
//
// Failure: MPI cannot cancel a collective half way, so a timeout or an MPI error prints the rank,
// the call and the ranks it waited for to stderr and aborts the whole job (MPI_Abort); mpirun
// then ends every process with a non-zero status. run_mpi() does the same for an exception that
// leaves a rank's function, and mpirun itself ends the job when a process dies. Argument errors
// found before anything is sent throw loom::Error as on every backend.
#pragma once
#include <functional>
#include <memory>
#include <string>

#include "comm/comm.h"

namespace loom::comm {

// Initialises MPI (asking for MPI_THREAD_MULTIPLE) if it is not yet, and finalises it on
// destruction if it initialised it.
class MpiSession {
 public:
  MpiSession(int* argc, char*** argv);
  ~MpiSession();
  MpiSession(const MpiSession&) = delete;
  MpiSession& operator=(const MpiSession&) = delete;
  int rank() const { return rank_; }
  int size() const { return size_; }
  // Processes of the job on this host (MPI_COMM_TYPE_SHARED).
  int local_size() const { return local_size_; }
  // Whether MPI granted MPI_THREAD_MULTIPLE (needed to use communicators from several threads).
  bool thread_multiple() const { return thread_multiple_; }

 private:
  bool owner_ = false;
  bool thread_multiple_ = false;
  int rank_ = 0;
  int size_ = 1;
  int local_size_ = 1;
};

// This process's place among the job's processes on its host (0 .. local_size - 1): which of
// the host's GPUs it takes. MPI must be initialised; collective over MPI_COMM_WORLD.
int mpi_local_rank();

// A communicator over MPI_COMM_WORLD (MPI must be initialised).
std::unique_ptr<Comm> mpi_world(CommOptions opts = {});

// Prints msg to stderr and aborts every process of the job with `code`.
[[noreturn]] void mpi_abort(const std::string& msg, int code = 1);

// Initialises MPI, runs fn on the world communicator and finalises; returns 0. When fn throws,
// prints "loom: rank R of N failed: ..." and aborts the job (every process exits non-zero).
int run_mpi(int* argc, char*** argv, const std::function<void(Comm&)>& fn, CommOptions opts = {});

}  // namespace loom::comm
