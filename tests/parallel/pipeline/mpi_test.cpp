// The pipeline executor on the MPI backend (processes under mpirun) trains exactly as on the
// threads backend: p = 2 on 2 ranks and p = 2 x dp = 2 on 4 ranks, 1F1B and ZB-H1, and the 4D
// layout dp = 2 x pp = 2 x tp = 2 on 8 processes; per-step losses compared bit for bit (both
// backends send the same bytes point to point and reduce in the same order).
#include <gtest/gtest.h>

#include <mutex>

#include "comm/threads.h"
#include "parallel/pipeline/pipeline_run_util.h"

namespace loom::parallel::pipeline {
namespace {

constexpr int kSteps = 3;

TEST(PipelineMpi, LossesEqualTheThreadsBackendBitwise) {
  for (auto [n, tp] : {std::pair{2, 1}, std::pair{4, 1}, std::pair{8, 2}}) {
    for (Kind kind : {Kind::one_f_one_b, Kind::zb_h1}) {
      if (tp > 1 && kind == Kind::zb_h1) continue;  // one 8-process run is enough
      SCOPED_TRACE(fmt::format("{} ranks, tp {}, {}", n, tp, kind_name(kind)));
      const ScheduleSpec spec{kind, 2, 1, 4};
      std::vector<float> threads_losses;
      std::mutex mu;
      comm::run_ranks(n, [&](comm::Comm& c) {
        std::vector<float> l = testing::train_tiny(c, spec, kSteps, tp);
        std::lock_guard lk(mu);
        if (c.rank() == 0) threads_losses = l;
      });
      ASSERT_EQ(threads_losses.size(), size_t(kSteps));
      auto r = testing::run_mpirun("test_parallel_pipeline_mpi_driver",
                                   n, fmt::format("--kind {} --p 2 --m 4 --steps {} --tp {}", kind_name(kind), kSteps, tp), 120);
      if (r.skipped) GTEST_SKIP() << r.output;
      ASSERT_EQ(r.status, 0) << r.output;
      EXPECT_NE(r.output.find(fmt::format("pipeline mpi driver OK on {} ranks", n)), std::string::npos) << r.output;
      // Every "loss <step> <bits>" line of the threads run appears in the MPI output.
      const std::string want = testing::loss_lines(threads_losses);
      size_t start = 0;
      while (start < want.size()) {
        const size_t end = want.find('\n', start);
        const std::string line = want.substr(start, end - start);
        EXPECT_NE(r.output.find(line), std::string::npos) << "threads: " << line << "\nmpi:\n" << r.output;
        start = end + 1;
      }
    }
  }
}

}  // namespace
}  // namespace loom::parallel::pipeline
