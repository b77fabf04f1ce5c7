#include "train/stop.h"

#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <thread>

#include <fmt/format.h>

#include "core/error.h"

namespace loom::train {
namespace {

std::atomic<bool> g_started{false};
std::atomic<int> g_listeners{0};  // StopSignals alive
std::atomic<int> g_received{0};

sigset_t stop_set() {
  sigset_t s;
  sigemptyset(&s);
  for (int sig : {SIGINT, SIGTERM, SIGUSR1}) sigaddset(&s, sig);
  return s;
}

// The notice of a signal a run took (written with write(2): no stdio, no allocation).
const char* notice(int sig) {
  return sig == SIGINT    ? "\nloom: SIGINT: the run stops at the end of this step, with its checkpoint (again to stop at once)\n"
         : sig == SIGTERM ? "\nloom: SIGTERM: the run stops at the end of this step, with its checkpoint (again to stop at once)\n"
                          : "\nloom: SIGUSR1: the run stops at the end of this step, with its checkpoint (again to stop at once)\n";
}

// The first signal while a run listens sets the flag (true); any other, a second or one while no
// run listens, is to take its default action (false). Async-signal-safe.
bool take_for_the_run(int sig) {
  int none = 0;
  if (g_listeners.load() == 0 || !g_received.compare_exchange_strong(none, sig)) return false;
  ssize_t ignored = ::write(2, notice(sig), std::strlen(notice(sig)));
  (void)ignored;
  return true;
}

// Runs only on a thread that a library started before main (OpenBLAS's), which does not block the
// signals: never on one of loom's. A signal not taken for the run is raised again with its default
// action, delivered once the handler returns.
extern "C" void on_stop_signal(int sig) {
  const int saved = errno;
  if (!take_for_the_run(sig)) {
    ::signal(sig, SIG_DFL);
    ::raise(sig);
  }
  errno = saved;
}

// The receiving thread: it computes nothing and waits for the signals (blocked, as in every thread
// of loom's) with sigwait; a signal not taken for the run takes its default action from here,
// unblocked in this thread alone, and ends the process.
void receive_signals() {
  const sigset_t set = stop_set();
  for (;;) {
    int sig = 0;
    if (::sigwait(&set, &sig) != 0 || take_for_the_run(sig)) continue;
    ::signal(sig, SIG_DFL);
    sigset_t one;
    sigemptyset(&one);
    sigaddset(&one, sig);
    ::pthread_sigmask(SIG_UNBLOCK, &one, nullptr);
    ::raise(sig);
    std::_Exit(128 + sig);  // (not reached: the three signals' default action ends the process)
  }
}

}  // namespace

std::string stop_reason_name(int reason) {
  switch (reason) {
    case 0: return "none";
    case SIGINT: return "SIGINT";
    case SIGTERM: return "SIGTERM";
    case SIGUSR1: return "SIGUSR1";
    case kStopTimeLimit: return "train.time_limit_min";
    default: return fmt::format("signal {}", reason);
  }
}

int stop_exit_status(int reason) { return reason == 0 || reason == kStopTimeLimit ? 0 : 128 + reason; }

void start_signal_thread() {
  if (g_started.exchange(true)) return;
  const sigset_t set = stop_set();
  if (const int e = ::pthread_sigmask(SIG_BLOCK, &set, nullptr); e != 0)
    throw Error(fmt::format("cannot block SIGINT, SIGTERM and SIGUSR1: {}", std::strerror(e)));
  // Threads that libraries started before main (OpenBLAS's) do not block the signals, and the
  // kernel may give them one: the handler there does what the receiving thread would.
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sigfillset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  for (int sig : {SIGINT, SIGTERM, SIGUSR1})
    if (::sigaction(sig, &sa, nullptr) != 0)
      throw Error(fmt::format("cannot handle {}: {}", stop_reason_name(sig), std::strerror(errno)));
  std::thread(receive_signals).detach();
}

bool signal_thread_started() { return g_started.load(); }

StopSignals::StopSignals() {
  if (g_listeners.fetch_add(1) == 0) g_received.store(0);
}

StopSignals::~StopSignals() { g_listeners.fetch_sub(1); }

int StopSignals::received() { return g_received.load(); }

void send_stop_signal_to_self(int sig) {
  LOOM_CHECK(sig == SIGINT || sig == SIGTERM || sig == SIGUSR1, "send_stop_signal_to_self: signal {} is not a stop signal",
             sig);
  // Without the receiving thread the signal would end the process: refused instead.
  LOOM_CHECK(signal_thread_started(), "{}: this program receives no stop signals (start_signal_thread)",
             stop_reason_name(sig));
  ::kill(::getpid(), sig);  // process-directed: the receiving thread takes it
  // Returns once that thread has (a step that follows is then the last), for at most 10 s.
  for (int i = 0; i < 10000 && g_received.load() == 0 && g_listeners.load() > 0; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
}

int agree_stop(comm::Comm& world, double time_limit_min, std::chrono::steady_clock::time_point started) {
  int mine = StopSignals::received();
  if (mine == 0 && time_limit_min > 0 &&
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count() >= 60.0 * time_limit_min)
    mine = kStopTimeLimit;
  if (world.size() == 1) return mine;
  // A signal on any rank outranks the time limit on another (the job was told to stop): signals
  // travel as 2000 + their number.
  float v = float(mine == 0 || mine == kStopTimeLimit ? mine : 2000 + mine);  // (small integers: exact)
  world.all_reduce(&v, 1, DType::f32, comm::ReduceOp::max);
  const int agreed = int(v);
  return agreed >= 2000 ? agreed - 2000 : agreed;
}

}  // namespace loom::train
