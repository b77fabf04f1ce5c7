// Embedding against the CPU op (kernels/cpu/embedding.h, f32 on the same bf16 tables) and double:
// forward is exact (one bf16 rounding of the sum, as on the host); backward within 1e-5 (f32 sums
// of bf16 values; atomics change only the order), onto existing random gradients.
#include <gtest/gtest.h>

#include "cuda_test_util.h"
#include "kernels/cuda/embedding.cuh"
#include "kernels/cpu/embedding.h"

using namespace loom;
using namespace loom::test;

TEST(Embedding, ForwardBackward) {
  LOOM_REQUIRE_GPU();
  const int64_t B = 3, T = 37, C = 72, V = 50, maxT = 64, pos0 = 5;
  auto wte = random_bf16_values(size_t(V * C), 1), wpe = random_bf16_values(size_t(maxT * C), 2);
  std::vector<int32_t> tok(size_t(B * T));
  std::mt19937 g(3);
  for (auto& t : tok) t = int32_t(g() % 7);  // few distinct ids: many repeats for the scatter
  tok[0] = int32_t(V - 1);
  auto dout = random_bf16_values(size_t(B * T * C), 4);
  auto dwte0 = random_f32(size_t(V * C), 5), dwpe0 = random_f32(size_t(maxT * C), 6);

  DeviceBuffer<dbf16> dwte_b(wte.size()), dwpe_b(wpe.size()), dout_b(dout.size()), out(size_t(B * T * C));
  DeviceBuffer<int32_t> dtok(tok.size());
  DeviceBuffer<float> gwte(dwte0.size()), gwpe(dwpe0.size());
  upload_bf16(dwte_b, wte);
  upload_bf16(dwpe_b, wpe);
  upload_bf16(dout_b, dout);
  dtok.upload(tok);
  gwte.upload(dwte0);
  gwpe.upload(dwpe0);
  out.poison();
  cuda::embedding_forward(out.get(), dtok.get(), dwte_b.get(), dwpe_b.get(), B, T, C, V, nullptr, {.pos0 = pos0});
  auto o = download_bf16(out);
  int64_t bad = 0;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t c = 0; c < C; ++c) {
        const float ref = round_bf16(wte[size_t(tok[size_t(b * T + t)] * C + c)] + wpe[size_t((pos0 + t) * C + c)]);
        bad += o[size_t((b * T + t) * C + c)] != ref;
      }
  EXPECT_EQ(bad, 0);
  std::vector<float> c_out(size_t(B * T * C));
  cpu::embedding_forward(c_out.data(), tok.data(), wte.data(), wpe.data(), B, T, C, V, pos0);
  int64_t bad_cpu = 0;
  for (size_t i = 0; i < c_out.size(); ++i) bad_cpu += o[i] != round_bf16(c_out[i]);
  EXPECT_EQ(bad_cpu, 0) << "against the CPU op, rounded to bf16";

  cuda::embedding_backward(gwte.get(), gwpe.get(), dout_b.get(), dtok.get(), B, T, C, V, nullptr, {.pos0 = pos0});
  std::vector<double> rwte(dwte0.begin(), dwte0.end()), rwpe(dwpe0.begin(), dwpe0.end());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t c = 0; c < C; ++c) {
        rwte[size_t(tok[size_t(b * T + t)] * C + c)] += dout[size_t((b * T + t) * C + c)];
        rwpe[size_t((pos0 + t) * C + c)] += dout[size_t((b * T + t) * C + c)];
      }
  const auto got_wte = gwte.download(), got_wpe = gwpe.download();
  const double ewte = rel_err(got_wte, rwte), ewpe = rel_err(got_wpe, rwpe);
  EXPECT_LE(ewte, 1e-5);
  EXPECT_LE(ewpe, 1e-5);
  std::vector<float> c_wte = dwte0, c_wpe = dwpe0;
  cpu::embedding_backward(c_wte.data(), c_wpe.data(), dout.data(), tok.data(), B, T, C, V, pos0);
  const double cwte = rel_err(got_wte, c_wte), cwpe = rel_err(got_wpe, c_wpe);
  EXPECT_LE(cwte, 1e-5);
  EXPECT_LE(cwpe, 1e-5);
  // The token-table gradient alone.
  gwte.upload(dwte0);
  cuda::embedding_backward(gwte.get(), nullptr, dout_b.get(), dtok.get(), B, T, C, V, nullptr, {.pos0 = pos0});
  const double cwte_alone = rel_err(gwte.download(), c_wte);
  EXPECT_LE(cwte_alone, 1e-5);
  std::printf("embedding: forward exact, dwte %.2e dwpe %.2e | against the CPU op: forward exact, dwte %.2e dwpe "
              "%.2e, dwte alone %.2e\n",
              ewte, ewpe, cwte, cwpe, cwte_alone);
}

TEST(Embedding, BadTokensAreCaughtOnTheHost) {
  std::vector<int32_t> tok{1, 2, 50};
  EXPECT_THROW(cuda::check_token_ids(tok.data(), 3, 50, "batch"), Error);
  tok[2] = -1;
  EXPECT_THROW(cuda::check_token_ids(tok.data(), 3, 50, "batch"), Error);
  tok[2] = 49;
  EXPECT_NO_THROW(cuda::check_token_ids(tok.data(), 3, 50, "batch"));
}
