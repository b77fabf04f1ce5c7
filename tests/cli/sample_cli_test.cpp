// Text samples of every layout come from the mesh itself (a pipeline runs the context forward
// through its stages as one micro-batch; under cp and sp the context is padded on the right to a
// length they divide; the last position's row is taken from the cp rank holding it and each tp
// rank's vocabulary columns gathered), not from weights assembled on rank 0: the greedy sample
// each layout prints is the single device's, token for token.
#include <gtest/gtest.h>

#include <string>

#include "cli_util.h"

using namespace loom::test;

namespace {

std::string sample_of(const std::string& out) {
  const size_t a = out.find("--- sample ---");
  if (a == std::string::npos) return "";
  const size_t b = out.find("\n---", a + 14);
  return out.substr(a, b == std::string::npos ? std::string::npos : b - a);
}

}  // namespace

TEST(SampleCli, EveryLayoutSamplesOnTheMeshAsTheSingleDevice) {
  LOOM_REQUIRE_LOOM();
  TrainScratch s("loom_sample_cli");
  const std::string flags =
      "--model.n_layer 2 --model.n_head 4 --model.n_embd 32 --data.seq_len 16 --train.batch_size 4 --train.steps 4 "
      "--train.eval_every 0 --train.sample_tokens 16 --train.sample_top_k 1 --train.threads 2";
  CliRun one = s.train("single", flags);
  ASSERT_EQ(one.code, 0) << one.err;
  for (const std::string layout :
       {"--parallel.tp 2", "--parallel.tp 2 --parallel.dp 2 --parallel.zero 3", "--parallel.pp 2",
        "--parallel.pp 2 --parallel.tp 2 --parallel.dp 2",
        "--parallel.pp 2 --parallel.schedule interleaved --parallel.virtual_stages 2 --train.grad_accum 2",
        "--parallel.cp 2", "--parallel.tp 2 --parallel.sp true", "--parallel.pp 2 --parallel.cp 2 --parallel.tp 2 --parallel.sp true"}) {
    CliRun tp = s.train("tp", flags + " --overwrite " + layout);
    ASSERT_EQ(tp.code, 0) << layout << "\n" << tp.err;
    EXPECT_FALSE(sample_of(one.out).empty()) << one.out;
    EXPECT_EQ(sample_of(tp.out), sample_of(one.out)) << layout;
  }
}
