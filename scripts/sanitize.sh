#!/usr/bin/env bash
# Build loom's CPU code under a sanitizer and run tests with it:
#   scripts/sanitize.sh address [ctest args]  AddressSanitizer + UndefinedBehaviorSanitizer over the
#                                             default suite (ctest -LE "long|torch"): out-of-bounds
#                                             and use-after-free accesses, leaks, undefined behaviour
#   scripts/sanitize.sh thread  [gtest args]  ThreadSanitizer: data races and lock-order
#                                             inversions in loom's own threads (rank threads,
#                                             the launcher, pipeline and prefetch threads, the
#                                             checkpoint writers), over the test programs of the
#                                             threads and MPI runtimes, the parallel layouts, the
#                                             trainer
# Extra arguments go to ctest (address: e.g. -R Cli) or to each test program (thread: e.g.
# --gtest_filter='*Pipeline*'). The build goes to build-<sanitizer> (LOOM_BUILD_DIR overrides),
# RelWithDebInfo, without CUDA; dependencies as scripts/test.sh installs them. An hour or more on
# 2 cores; not part of the default suite.
# Known: in both sanitizer builds two tp x cp layouts of ParallelEquivalence (dp1_cp2_tp2_sp and
# dp1_cp2_tp2_zero2) reach 1.05e-5 on h.0.ln_1.bias against the test's 1e-5 (the Release build's
# worst over all layouts is 7.0e-6; the address build at -O3 gives the same 1.05e-5):
# the instrumented code rounds the same sums differently, the test's tolerance is not loosened for
# it, and those two fail there.
#
# Reports from inside libraries built without the sanitizer are suppressed in
# scripts/sanitizers/{lsan,tsan}.supp, each with its reason; the run fails on any other report.
# Under ThreadSanitizer, OpenMP runs one thread (OMP_NUM_THREADS=1): libgomp is not instrumented,
# so the synchronisation of its parallel regions is invisible to the sanitizer and every region
# would be reported. What is checked is loom's own threads.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
kind=${1:-}
case "$kind" in
  address) flags="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined" ;;
  thread) flags="-fsanitize=thread" ;;
  *)
    echo "usage: scripts/sanitize.sh address|thread [ctest args | gtest args]" >&2
    exit 2
    ;;
esac
shift
"$root/scripts/install_deps.sh"
build=${LOOM_BUILD_DIR:-$root/build-$kind}
jobs=${JOBS:-$(nproc)}
cmake -G Ninja -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DLOOM_CUDA=OFF \
  -DCMAKE_CXX_FLAGS="$flags" -DCMAKE_EXE_LINKER_FLAGS="$flags"
ninja -C "$build" -j"$jobs"
sup="$root/scripts/sanitizers"
if [[ $kind == address ]]; then
  # Full stacks at every allocation (fast_unwind_on_malloc=0): a library's leak is matched by any
  # frame of its stack, and loom's own allocations are never cut short at a library frame.
  export ASAN_OPTIONS="detect_leaks=1:fast_unwind_on_malloc=0:${ASAN_OPTIONS:-}"
  export LSAN_OPTIONS="suppressions=$sup/lsan.supp:${LSAN_OPTIONS:-}"
  export UBSAN_OPTIONS="print_stacktrace=1:${UBSAN_OPTIONS:-}"
  cd "$build"
  exec ctest -LE "long|torch" -j"$jobs" --timeout 3600 --output-on-failure "$@"
fi
export OMP_NUM_THREADS=1
# (OMP_THREAD_LIMIT also holds the loom processes the tests start with --train.threads N to one
# OpenMP thread: omp_set_num_threads cannot go past it.)
export OMP_THREAD_LIMIT=1
export TSAN_OPTIONS="suppressions=$sup/tsan.supp history_size=4 second_deadlock_stack=1 ${TSAN_OPTIONS:-}"
failed=()
for t in test_comm test_parallel test_parallel_data test_parallel_tensor test_parallel_pipeline \
  test_parallel_context test_train; do
  echo "=== $t"
  "$build/tests/$t" "$@" || failed+=("$t")
done
((${#failed[@]} == 0)) || { echo "failed: ${failed[*]}" >&2; exit 1; }
