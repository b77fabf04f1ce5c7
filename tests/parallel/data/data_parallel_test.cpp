// Data parallelism against one device: dp in {1, 2, 4} x ZeRO 0-3 (and offload) train 20 steps of
// a tiny GPT on the threads backend; per-step losses agree within 1e-5 relative and the final
// parameters within ||p - p_ref|| / ||p_ref|| <= 1e-5. Peak memory per rank and tag equals the
// formulas of parallel/data/data_parallel.h, on the CPU and on a device (the emulated one, with its
// compute copies). A rank that throws stops every rank promptly.
#include "parallel/data/data_parallel.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <thread>

#include <omp.h>

#include "comm/threads.h"
#include "core/backend.h"
#include "core/rng.h"
#include "model/gpt.h"
#include "optim/adamw.h"
#include "parallel/tensor/counting_comm.h"

using namespace loom;

namespace {

model::GPTConfig tiny() {
  model::GPTConfig c;
  c.n_layer = 2;
  c.n_head = 2;
  c.n_embd = 32;
  c.vocab_size = 97;  // padded to 128 rows
  c.block_size = 16;
  return c;
}

constexpr int64_t kB = 8, kT = 16;
constexpr int64_t kSteps = 20;

optim::AdamWConfig adam_cfg() {
  optim::AdamWConfig a;
  a.lr = 3e-3;
  a.weight_decay = 0.1;
  a.max_norm = 0.5f;  // small enough that clipping is active
  return a;
}

// Tokens of global sample g at step s: a function of (s, g) only.
void fill_sample(int64_t step, int64_t g, int32_t* x, int32_t* y, int64_t V) {
  for (int64_t t = 0; t < kT; ++t) {
    uint64_t idx = uint64_t((step * kB + g) * kT + t);
    x[t] = int32_t(uniform_at(7, 1, idx) * float(V));
    y[t] = int32_t((x[t] * 3 + 1) % V);  // learnable
  }
}

struct RunResult {
  std::vector<double> losses;
  std::vector<float> params;  // logical elements of every parameter, in order
  // download_params (host memory, gathered piece by piece under ZeRO-3) against the gathered
  // flat state, bit for bit.
  bool downloaded_equal = true;
};

RunResult reference(int64_t accum) {
  MemoryPool pool("ref");
  model::GPT gpt(tiny(), pool, 1234);
  optim::AdamW adam(gpt.parameters(), adam_cfg(), pool);
  const int64_t mb = kB / accum, V = tiny().vocab_size;
  Tensor x = Tensor::empty({mb, kT}, DType::i32, MemTag::workspace, pool);
  Tensor y = Tensor::empty({mb, kT}, DType::i32, MemTag::workspace, pool);
  RunResult r;
  for (int64_t s = 0; s < kSteps; ++s) {
    gpt.zero_grad();
    double loss = 0;
    for (int64_t m = 0; m < accum; ++m) {
      for (int64_t i = 0; i < mb; ++i) fill_sample(s, m * mb + i, x.i32() + i * kT, y.i32() + i * kT, V);
      model::ForwardOptions fo;
      fo.fuse_backward = true;
      fo.dloss_scale = 1.0f / float(accum);
      loss += gpt.forward(x, y, fo);
      gpt.backward();
    }
    r.losses.push_back(loss / double(accum));
    adam.step();
  }
  for (auto* p : gpt.parameters()) r.params.insert(r.params.end(), p->value.f32(), p->value.f32() + p->spec.numel());
  return r;
}

struct MemPeaks {
  int64_t params = 0, grads = 0, optimizer = 0;
  int64_t host_params = 0, host_grads = 0, host_optimizer = 0;
  int64_t N_pad = 0, S = 0, G = 0, U = 0;
};

// One rank's training: samples [r B/dp, (r+1) B/dp) of each step, in `accum` micro-batches. On
// the emulated device (emu) in bf16, as a GPU's ranks run (the model's parameters declared and
// placed by data parallelism, the tokens in host memory).
RunResult train_rank(comm::Comm& c, int zero, bool offload, int64_t accum, int64_t bucket_bytes, MemPeaks* mem,
                     bool prefetch = true, bool emu = false) {
  const int dp = c.size();
  MemoryPool pool(fmt::format("{}:{}", emu ? "emu" : "cpu", c.rank()), emu ? &emu_allocator() : &cpu_allocator()),
      host(fmt::format("host:{}", c.rank()));
  std::unique_ptr<Backend> be = emu ? make_backend(Device::emu, {.pool = &pool}) : nullptr;
  model::GPT gpt = emu ? model::GPT(tiny(), *be, 1234, {.groups = {}, .defer_parameters = true}) : model::GPT(tiny(), pool, 1234);
  parallel::DataParallelOptions o;
  o.zero = zero;
  o.offload = offload;
  o.host_pool = &host;
  o.bucket_bytes = bucket_bytes;
  o.prefetch = prefetch;
  parallel::DataParallel ddp(gpt, c, adam_cfg(), o);
  const int64_t local = kB / dp, mb = local / accum, V = tiny().vocab_size;
  Tensor x = Tensor::empty({mb, kT}, DType::i32, MemTag::workspace, emu ? host : pool);
  Tensor y = Tensor::empty({mb, kT}, DType::i32, MemTag::workspace, emu ? host : pool);
  pool.reset_peaks();
  host.reset_peaks();
  RunResult r;
  for (int64_t s = 0; s < kSteps; ++s) {
    ddp.zero_grad();
    double loss = 0;
    for (int64_t m = 0; m < accum; ++m) {
      for (int64_t i = 0; i < mb; ++i)
        fill_sample(s, c.rank() * local + m * mb + i, x.i32() + i * kT, y.i32() + i * kT, V);
      model::ForwardOptions fo;
      fo.fuse_backward = true;
      fo.dloss_scale = 1.0f / float(accum * dp);
      ddp.set_last_micro(m + 1 == accum);
      loss += gpt.forward(x, y, fo);
      gpt.backward();
    }
    r.losses.push_back(ddp.sum_over_ranks(loss / double(accum)) / double(dp));
    ddp.step(-1.0);
  }
  if (mem) {
    mem->params = pool.peak(MemTag::params);
    mem->grads = pool.peak(MemTag::grads);
    mem->optimizer = pool.peak(MemTag::optimizer);
    mem->host_params = host.peak(MemTag::params);
    mem->host_grads = host.peak(MemTag::grads);
    mem->host_optimizer = host.peak(MemTag::optimizer);
    mem->N_pad = ddp.flat_elements();
    mem->S = ddp.shard_elements();
    mem->G = ddp.bucket_peak_elements();
    mem->U = ddp.max_block_use_elements();
  }
  auto full = ddp.gather_full_state();
  std::vector<float> downloaded(size_t(ddp.flat_elements()));
  ddp.download_params(downloaded.data());
  r.downloaded_equal = std::memcmp(downloaded.data(), full.params.f32(), downloaded.size() * sizeof(float)) == 0;
  for (size_t i = 0; i < gpt.parameters().size(); ++i) {
    Tensor v = ddp.param_view(full.params, i);
    r.params.insert(r.params.end(), v.f32(), v.f32() + v.numel());
  }
  return r;
}

std::vector<RunResult> run_dp(int dp, int zero, bool offload, int64_t accum, int64_t bucket_bytes,
                              std::vector<MemPeaks>* mem = nullptr, bool prefetch = true, bool emu = false) {
  std::vector<RunResult> out(static_cast<size_t>(dp));
  if (mem) mem->assign(size_t(dp), {});
  comm::RunOptions ro;
  ro.comm.timeout = std::chrono::milliseconds(60'000);
  comm::run_ranks(dp, [&](comm::Comm& c) {
    out[size_t(c.rank())] =
        train_rank(c, zero, offload, accum, bucket_bytes, mem ? &(*mem)[size_t(c.rank())] : nullptr, prefetch, emu);
  }, ro);
  return out;
}

double rel_dist(const std::vector<float>& a, const std::vector<float>& b) {
  double d = 0, n = 0;
  for (size_t i = 0; i < a.size(); ++i) d += (double(a[i]) - b[i]) * (double(a[i]) - b[i]), n += double(b[i]) * b[i];
  return std::sqrt(d / n);
}

void expect_matches(const std::vector<RunResult>& runs, const RunResult& ref, const std::string& what) {
  for (size_t r = 0; r < runs.size(); ++r) {
    ASSERT_EQ(runs[r].losses.size(), ref.losses.size()) << what;
    for (size_t s = 0; s < ref.losses.size(); ++s)
      EXPECT_LE(std::abs(runs[r].losses[s] - ref.losses[s]), 1e-5 * std::abs(ref.losses[s]))
          << what << " rank " << r << " step " << s + 1 << ": " << runs[r].losses[s] << " vs " << ref.losses[s];
    ASSERT_EQ(runs[r].params.size(), ref.params.size()) << what;
    EXPECT_LE(rel_dist(runs[r].params, ref.params), 1e-5) << what << " rank " << r;
    // Every rank ends with the same parameters, bit for bit.
    EXPECT_EQ(runs[r].params, runs[0].params) << what << " rank " << r;
    EXPECT_EQ(runs[r].losses, runs[0].losses) << what << " rank " << r;
    EXPECT_TRUE(runs[r].downloaded_equal) << what << " rank " << r << ": download_params differs from the gathered state";
  }
}

TEST(DataParallel, EqualsSingleDeviceForEveryStageAndDp) {
  omp_set_num_threads(1);
  const RunResult ref = reference(1);
  // The loss must actually move, or equality would prove little.
  ASSERT_LT(ref.losses.back(), ref.losses.front() - 0.05);
  for (int dp : {1, 2, 4})
    for (int zero : {0, 1, 2, 3})
      for (bool offload : {false, true}) {
        if (offload && zero != 2 && dp != 2) continue;  // offload: every stage at dp=2, dp x stage 2
        std::string what = fmt::format("dp={} zero={} offload={}", dp, zero, offload);
        expect_matches(run_dp(dp, zero, offload, 1, 4096), ref, what);
      }
}

TEST(DataParallel, GradientAccumulationEqualsSingleDevice) {
  omp_set_num_threads(1);
  const RunResult ref = reference(2);
  for (int zero : {0, 1, 2, 3}) expect_matches(run_dp(2, zero, false, 2, 4096), ref, fmt::format("accum zero={}", zero));
}

TEST(DataParallel, BucketSizeDoesNotChangeTheResult) {
  // One bucket per chain block vs one bucket for the whole model: the reduction chunks differ, so
  // equality with the reference is within tolerance; the result must not depend on timing.
  omp_set_num_threads(1);
  const RunResult ref = reference(1);
  auto a = run_dp(2, 2, false, 1, 1);
  auto b = run_dp(2, 2, false, 1, int64_t(1) << 30);
  expect_matches(a, ref, "small buckets");
  expect_matches(b, ref, "one bucket");
  EXPECT_EQ(run_dp(2, 2, false, 1, 1)[0].params, a[0].params) << "two identical runs differ";
}

// Peak bytes per rank and tag over the training steps, from the formulas of data_parallel.h:
//   stage 0: params 4 N_pad, grads 4 N_pad, optimizer 8 N_pad
//   stage 1: params 4 N_pad, grads 4 N_pad, optimizer 8 S
//   stage 2: params 4 N_pad, grads 4 S + 4 G, optimizer 8 S
//   stage 3: params 4 S + 8 U, grads 4 S + 4 G, optimizer 8 S
// and with offload the device pool holds no optimizer state; the host pool holds optimizer 8 P,
// params 4 P and grads 4 P with P = N_pad (stage 0) or S.
TEST(DataParallel, PeakMemoryEqualsZeroFormulas) {
  omp_set_num_threads(1);
  const model::GPTConfig c = tiny();
  const int64_t C = c.n_embd, Vp = c.padded_vocab(), L = c.n_layer, Tb = c.block_size;
  auto r16 = [](int64_t x) { return (x + 15) / 16 * 16; };
  // Flat elements per chain block (each parameter rounded up to 16 elements).
  const int64_t emb = r16(Vp * C) + r16(Tb * C);
  const int64_t blk = 4 * r16(C) + r16(3 * C * C) + r16(3 * C) + r16(C * C) + r16(C) + r16(4 * C * C) + r16(4 * C) +
                      r16(4 * C * C) + r16(C);
  const int64_t head = 2 * r16(C);
  const int64_t N = emb + L * blk + head;
  for (int zero : {0, 1, 2, 3})
    for (bool offload : {false, true}) {
      const int dp = 4;
      std::vector<MemPeaks> mem;
      run_dp(dp, zero, offload, 1, 1, &mem);  // one bucket per chain block
      const int64_t N_pad = (N + 16 * dp - 1) / (16 * dp) * (16 * dp), S = N_pad / dp;
      // Buckets (backward order): head (+ the flat tail padding), h.1, h.0, embedding, and the
      // tied head's own bucket for wte. Lifetimes: head and tied from the head's backward, head
      // freed when h.1 is acquired (only the newest launched bucket stays in flight), tied when
      // h.0 is, h.1 when the embedding is. Placed largest first at the lowest free offset: h.1 at
      // 0, h.0 beside it, the embedding at 0 (h.1 is gone), tied beside h.1, head at 0 (h.1 not
      // yet acquired): G = 2 blk, the most held at once.
      const int64_t H = head + N_pad - N;
      ASSERT_LT(H + Vp * C, blk);
      ASSERT_LT(emb, blk);
      const int64_t G = 2 * blk;
      // U: the tied head uses ln_f and wte; the embedding uses wte and wpe (unrounded sizes).
      const int64_t U = std::max({Vp * C + Tb * C, Vp * C + 2 * C, 12 * C * C + 13 * C});
      const int64_t P = zero == 0 ? N_pad : S;
      for (int r = 0; r < dp; ++r) {
        const MemPeaks& m = mem[size_t(r)];
        std::string what = fmt::format("zero={} offload={} rank {}", zero, offload, r);
        ASSERT_EQ(m.N_pad, N_pad) << what;
        ASSERT_EQ(m.S, S) << what;
        if (zero >= 2) {
          ASSERT_EQ(m.G, G) << what;
        }
        if (zero == 3) {
          ASSERT_EQ(m.U, U) << what;
        }
        EXPECT_EQ(m.params, zero == 3 ? 4 * S + 8 * U : 4 * N_pad) << what;  // two gather buffers of U
        EXPECT_EQ(m.grads, zero >= 2 ? 4 * S + 4 * G : 4 * N_pad) << what;
        EXPECT_EQ(m.optimizer, offload ? 0 : 8 * P) << what;
        EXPECT_EQ(m.host_optimizer, offload ? 8 * P : 0) << what;
        EXPECT_EQ(m.host_params, offload ? 4 * P : 0) << what;
        EXPECT_EQ(m.host_grads, offload ? 4 * P : 0) << what;
      }
    }
}

// On a device computing in bf16 (the emulated one), the peaks of the grads and optimizer tags of
// both pools as on the CPU (the formulas above), and of the params tag only the compute copies
// more: one flat bf16 copy of the parameters (2 N_pad bytes) for stages 0-2, and under ZeRO-3
// none kept whole but a bf16 buffer beside each of the two gather buffers (4 U bytes). Offloaded,
// the f32 master weights are the host pool's alone: the device keeps the compute copies only
// (2 N_pad bytes; under ZeRO-3 the bf16 shard, 2 S, gathered straight into the two bf16 buffers,
// 4 U), and under ZeRO 2/3 no gradient shard either (each bucket's reduced part is added into the
// host's, 4 S bytes less: the arena alone); and it computes the same bits as without offload (the
// same sums and update, rounded to bf16 on the host instead of on the device).
TEST(DataParallel, PeakMemoryOnADeviceAddsOnlyTheComputeCopies) {
  omp_set_num_threads(1);
  for (int zero : {0, 1, 2, 3}) {
    std::vector<RunResult> kept;
    for (bool offload : {false, true}) {
      std::vector<MemPeaks> cpu, dev;
      run_dp(4, zero, offload, 1, 1, &cpu);
      const std::vector<RunResult> runs = run_dp(4, zero, offload, 1, 1, &dev, true, true);
      for (size_t r = 0; r < cpu.size(); ++r) {
        const MemPeaks &c = cpu[r], &d = dev[r];
        const std::string what = fmt::format("zero={} offload={} rank {}", zero, offload, r);
        ASSERT_EQ(d.N_pad, c.N_pad) << what;
        ASSERT_EQ(d.U, c.U) << what;
        if (!offload) EXPECT_EQ(d.params, c.params + (zero == 3 ? 4 * c.U : 2 * c.N_pad)) << what;
        else EXPECT_EQ(d.params, zero == 3 ? 2 * c.S + 4 * c.U : 2 * c.N_pad) << what;
        EXPECT_EQ(d.grads, c.grads - (offload && zero >= 2 ? 4 * c.S : 0)) << what;
        EXPECT_EQ(d.optimizer, c.optimizer) << what;
        EXPECT_EQ(d.host_params, c.host_params) << what;
        EXPECT_EQ(d.host_grads, c.host_grads) << what;
        EXPECT_EQ(d.host_optimizer, c.host_optimizer) << what;
        EXPECT_TRUE(runs[r].downloaded_equal) << what << ": download_params differs from the gathered state";
      }
      if (!kept.empty())
        for (size_t r = 0; r < runs.size(); ++r) {
          EXPECT_EQ(runs[r].losses, kept[r].losses) << "zero=" << zero << " rank " << r << ": offload changed a loss";
          EXPECT_EQ(runs[r].params, kept[r].params) << "zero=" << zero << " rank " << r << ": offload changed a weight";
        }
      kept = runs;
    }
  }
  // With two micro-batches a step the host adds each one's reduced gradients as the device would.
  for (int zero : {2, 3}) {
    const std::vector<RunResult> a = run_dp(2, zero, false, 2, 1, nullptr, true, true);
    const std::vector<RunResult> b = run_dp(2, zero, true, 2, 1, nullptr, true, true);
    for (size_t r = 0; r < a.size(); ++r) {
      EXPECT_EQ(a[r].losses, b[r].losses) << "accum 2, zero=" << zero << " rank " << r;
      EXPECT_EQ(a[r].params, b[r].params) << "accum 2, zero=" << zero << " rank " << r;
    }
  }
}

// ZeRO-3's prefetch (the next block gathered while the current computes, into a second buffer of
// U elements) changes when weights arrive, not what is computed: the same parameters to the bit,
// and one buffer less without it.
TEST(DataParallel, ZeroThreePrefetchChangesNothingButOneBuffer) {
  omp_set_num_threads(1);
  std::vector<MemPeaks> with, without;
  const auto a = run_dp(4, 3, false, 2, 1, &with, true);
  const auto b = run_dp(4, 3, false, 2, 1, &without, false);
  for (size_t r = 0; r < a.size(); ++r) {
    EXPECT_EQ(a[r].params, b[r].params) << "rank " << r;
    EXPECT_EQ(with[r].params - without[r].params, 4 * with[r].U) << "rank " << r;
  }
}

// What a step puts on the wire per rank (ring algorithms, parallel::CountingComm), N_pad the flat
// elements over d ranks: ZeRO 0 all-reduces the gradients, 2 (d-1)/d 4 N_pad bytes; ZeRO 1
// reduce-scatters them ((d-1)/d 4 N_pad: a rank reads its shard's only) and all-gathers the
// updated weights (the same again), as much as ZeRO 0 and no more (Megatron's distributed
// optimizer); ZeRO 2 the same over one micro-batch. Besides, a few scalars: the loss and the
// gradient norm's sums.
TEST(DataParallel, ZeroOneMovesAsManyBytesAsPlainDataParallelism) {
  omp_set_num_threads(1);
  for (int dp : {2, 4}) {
    std::vector<double> wire(3, 0.0);
    int64_t n_pad = 0, wte = 0;
    for (int zero : {0, 1, 2}) {
      comm::run_ranks(dp, [&](comm::Comm& c) {
        parallel::CountingComm counted(c);
        MemoryPool pool(fmt::format("cpu:{}", c.rank()));
        model::GPT gpt(tiny(), pool, 1234);
        parallel::DataParallelOptions o;
        o.zero = zero;
        o.bucket_bytes = 4096;
        parallel::DataParallel ddp(gpt, counted, adam_cfg(), o);
        const int64_t mb = kB / dp, V = tiny().vocab_size;
        Tensor x = Tensor::empty({mb, kT}, DType::i32, MemTag::workspace, pool);
        Tensor y = Tensor::empty({mb, kT}, DType::i32, MemTag::workspace, pool);
        for (int64_t i = 0; i < mb; ++i) fill_sample(0, c.rank() * mb + i, x.i32() + i * kT, y.i32() + i * kT, V);
        counted.reset();
        ddp.zero_grad();
        gpt.forward(x, y, {.fuse_backward = true, .dloss_scale = 1.0f / float(dp)});
        gpt.backward();
        ddp.step(-1.0);
        if (c.rank() == 0)
          wire[size_t(zero)] = counted.counts().wire_bytes, n_pad = ddp.flat_elements(), wte = ddp.layout()[0].alloc;
      });
    }
    const double grads = 2.0 * (dp - 1) / dp * 4 * double(n_pad);
    // (ZeRO 2 also reduce-scatters the tied head's part of wte's gradient in a bucket of its own.)
    const double tied = (dp - 1.0) / dp * 4 * double(wte);
    for (int zero : {0, 1, 2}) {
      const double expected = grads + (zero == 2 ? tied : 0.0);
      std::printf("  dp=%d zero=%d: %.0f bytes on the wire per rank, %.0f of gradients and weights\n", dp, zero,
                  wire[size_t(zero)], expected);
      EXPECT_GE(wire[size_t(zero)], expected) << "dp=" << dp << " zero=" << zero;
      EXPECT_LE(wire[size_t(zero)], expected + 256) << "dp=" << dp << " zero=" << zero
                                                    << ": more than a few scalars beyond the gradients and weights";
    }
  }
}

TEST(DataParallel, RankThatThrowsStopsEveryRankWithItsNumber) {
  omp_set_num_threads(1);
  comm::RunOptions ro;
  ro.comm.timeout = std::chrono::milliseconds(30'000);
  auto t0 = std::chrono::steady_clock::now();
  try {
    comm::run_ranks(4, [&](comm::Comm& c) {
      MemoryPool pool(fmt::format("cpu:{}", c.rank()));
      model::GPT gpt(tiny(), pool, 1);
      parallel::DataParallelOptions o;
      o.zero = 3;
      o.bucket_bytes = 1;
      parallel::DataParallel ddp(gpt, c, adam_cfg(), o);
      Tensor x = Tensor::zeros({2, kT}, DType::i32, MemTag::workspace, pool);
      model::ForwardOptions fo;
      fo.fuse_backward = true;
      for (int s = 0; s < 3; ++s) {
        ddp.zero_grad();
        if (c.rank() == 2 && s == 1) throw Error("rank 2 raised on purpose");
        gpt.forward(x, x, fo);
        gpt.backward();
        ddp.step(-1.0);
      }
    }, ro);
    FAIL() << "run_ranks returned normally";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("rank 2 raised on purpose"), std::string::npos) << e.what();
  }
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(s, 10.0) << "the other ranks must stop long before the 30 s timeout";
}

}  // namespace
