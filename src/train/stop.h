// Stopping a run early and cleanly: between two steps, with a checkpoint of the last one, on a
// signal (SIGINT, SIGTERM, or SIGUSR1: what Slurm's `--signal` sends before a job's time limit and
// what Open MPI's mpirun forwards to its processes) or at train.time_limit_min (Megatron-LM's
// --exit-signal-handler and --exit-duration-in-mins).
//
// No signal handler runs on a thread that computes. start_signal_thread, called first in main,
// blocks the three signals in every thread loom starts, one of them a thread of its own that
// computes nothing and waits for them (sigwait); threads that libraries started before main
// (OpenBLAS's) do not block them and run a handler that does the same. A handler on a computing
// thread would interrupt it, and oneDNN's JIT GEMM kernels (2.6, Debian's; fixed upstream in 2026)
// point the stack register into the heap while they run: the signal's frame is then written over
// heap memory (measured: about one signal in four during training steps corrupted the heap and
// the process aborted).
//
// While a run listens (a StopSignals is alive), the first signal sets a process-wide flag (and a
// line on stderr says so) and the ranks agree on it in one collective after each step
// (agree_stop), so every rank of the mesh stops after the same step and writes its part of the
// same checkpoint. A second signal, or one while no run listens, takes the signal's default action
// at once, from the handler (the process ends by it).
#pragma once
#include <chrono>
#include <string>

#include "comm/comm.h"

namespace loom::train {

// Why a run stopped before train.steps: 0 (it did not), a signal's number, or this.
inline constexpr int kStopTimeLimit = 1000;
// "SIGTERM", "train.time_limit_min", ...
std::string stop_reason_name(int reason);
// The exit status of `loom train` for a run stopped for `reason`: 128 + the signal's number, as a
// shell reports a process a signal ended (a script does not take the run for finished); 0 for the
// time limit (the invocation did what was asked of it, as Megatron-LM's time limit exits).
int stop_exit_status(int reason);

// Blocks SIGINT, SIGTERM and SIGUSR1 in the calling thread and in every thread created after it,
// and starts the thread that waits for them. Call it before the process creates any other thread
// (first in main); once. A program that does not call it keeps the signals' default actions, and
// its runs stop only at train.time_limit_min.
void start_signal_thread();
// Whether start_signal_thread has run in this process.
bool signal_thread_started();

// While one is alive the process's run listens for the signals (see above). Nested and concurrent
// instances share one flag.
class StopSignals {
 public:
  StopSignals();
  ~StopSignals();
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;
  // The first signal received while a run listened (0: none).
  static int received();
};

// Sends `sig` (SIGINT, SIGTERM or SIGUSR1) to this process as `kill` from outside would (the
// fault injection's signals), and returns once it is received. Throws when the process has no
// receiving thread (the signal would end it).
void send_stop_signal_to_self(int sig);

// Collective over `world`: why the job stops (this rank's reason: the signal received, else
// kStopTimeLimit when `time_limit_min` > 0 and that many minutes have passed since `started`); a
// signal on any rank outranks the time limit (between two signals, the larger number).
int agree_stop(comm::Comm& world, double time_limit_min, std::chrono::steady_clock::time_point started);

}  // namespace loom::train
