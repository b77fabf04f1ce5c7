#include "train/stop.h"

#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
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

int g_pipe[2] = {-1, -1};  // the handler writes the signal it took for a run, the notice thread reads it

// Runs on loom's receiving thread (the one thread of loom's that does not block the signals, and
// computes nothing) or on a thread a library started before main (OpenBLAS's). Async-signal-safe
// throughout: the first signal while a run listens sets the flag and wakes the notice; any other
// (a second, or one while no run listens) takes the signal's default action from here: the
// handler is reset and the signal raised again, delivered once the handler returns.
extern "C" void on_stop_signal(int sig) {
  const int saved = errno;
  int none = 0;
  if (g_listeners.load() > 0 && g_received.compare_exchange_strong(none, sig)) {
    const char c = char(sig);
    ssize_t ignored = ::write(g_pipe[1], &c, 1);
    (void)ignored;
    errno = saved;
    return;
  }
  ::signal(sig, SIG_DFL);
  ::raise(sig);
  errno = saved;
}

// The receiving thread: the signals are unblocked here alone among loom's threads; it sleeps in
// read() (restarted after each handler) and prints the notice of a signal a run took. (Printing can
// block on a full stderr pipe: nothing else waits on this thread, a second signal included.)
void receive_signals() {
  const sigset_t set = stop_set();
  ::pthread_sigmask(SIG_UNBLOCK, &set, nullptr);
  for (;;) {
    char c = 0;
    const ssize_t n = ::read(g_pipe[0], &c, 1);
    if (n != 1) {
      if (n < 0 && errno == EINTR) continue;
      return;  // (the pipe cannot close while the process runs)
    }
    char msg[160];
    const int len = std::snprintf(msg, sizeof msg,
                                  "\nloom: %s: the run stops at the end of this step, with its checkpoint (again to "
                                  "stop at once)\n",
                                  stop_reason_name(c).c_str());
    ssize_t ignored = ::write(2, msg, size_t(std::clamp(len, 0, int(sizeof msg) - 1)));
    (void)ignored;
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
  if (::pipe2(g_pipe, O_CLOEXEC) != 0)
    throw Error(fmt::format("cannot make the stop signals' pipe: {}", std::strerror(errno)));
  // Threads that libraries started before main (OpenBLAS's) do not block the signals, and the
  // kernel may give them one: a handler there passes it on to the receiving thread.
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
