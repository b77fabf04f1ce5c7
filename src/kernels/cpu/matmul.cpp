// GEMM through oneDNN's dnnl_sgemm: it picks its micro-kernel at run time (AVX2 on this
// baseline, AVX-512 where the CPU has it) and threads with OpenMP over the calling thread's team,
// so a rank thread that sets omp_set_num_threads(k) gets k threads and no more. Nothing for the
// user to set: no environment variable changes the code path.
#include "kernels/cpu/matmul.h"

#include <oneapi/dnnl/dnnl.h>
#include <oneapi/dnnl/dnnl.hpp>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <unordered_map>
#include <tuple>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "core/tensor.h"

namespace loom::cpu {

void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
          int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  LOOM_CHECK(M >= 0 && N >= 0 && K >= 0, "gemm: negative size M={} N={} K={}", M, N, K);
  if (M == 0 || N == 0) return;
  LOOM_CHECK(ldc >= N, "gemm: ldc={} < N={}", ldc, N);
  LOOM_CHECK(lda >= (trans_a ? M : K), "gemm: lda={} too small (trans_a={}, M={}, K={})", lda, trans_a, M, K);
  LOOM_CHECK(ldb >= (trans_b ? K : N), "gemm: ldb={} too small (trans_b={}, K={}, N={})", ldb, trans_b, K, N);
  if (K == 0) {
    // op(A) @ op(B) is the zero matrix; oneDNN rejects K = 0, so scale C here.
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) C[i * ldc + j] = beta == 0.f ? 0.f : beta * C[i * ldc + j];
    return;
  }
  // oneDNN wants leading dimensions >= 1 even where a dimension is 1.
  lda = std::max<int64_t>(lda, 1);
  ldb = std::max<int64_t>(ldb, 1);
  dnnl_status_t st = dnnl_sgemm(trans_a ? 'T' : 'N', trans_b ? 'T' : 'N', M, N, K, alpha, A, lda, B, ldb,
                                beta, C, ldc);
  LOOM_CHECK(st == dnnl_success, "gemm: dnnl_sgemm failed with status {} (M={} N={} K={})", int(st), M, N, K);
}

namespace {

// Rows of out [M, N] start as copies of bias [N], so the GEMM can accumulate into them (beta = 1):
// the bias costs one streaming write of out instead of a second read-modify-write pass.
void broadcast_bias(float* out, const float* bias, int64_t M, int64_t N) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < M; ++i) std::copy(bias, bias + N, out + i * N);
}

// dbias [N] += column sums of dout [M, N]. Columns are split among threads in blocks and each
// block sums the rows in order, so the result does not depend on the thread count.
void column_sums_accumulate(float* dbias, const float* dout, int64_t M, int64_t N) {
  constexpr int64_t kBlock = 64;
  const int64_t nblocks = (N + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < nblocks; ++b) {
    const int64_t j0 = b * kBlock, len = std::min(kBlock, N - j0);
    float acc[kBlock] = {};
    for (int64_t i = 0; i < M; ++i) {
      const float* row = dout + i * N + j0;
#pragma omp simd
      for (int64_t j = 0; j < len; ++j) acc[j] += row[j];
    }
    for (int64_t j = 0; j < len; ++j) dbias[j0 + j] += acc[j];
  }
}

}  // namespace

void matmul_forward(float* out, const float* inp, const float* weight, const float* bias, int64_t M,
                    int64_t K, int64_t N) {
  LOOM_CHECK(M >= 0 && K >= 0 && N >= 0, "matmul_forward: negative size M={} K={} N={}", M, K, N);
  if (M == 0 || N == 0) return;
  if (bias) broadcast_bias(out, bias, M, N);
  // out [M, N] = inp [M, K] @ weight [N, K]^T (+ out)
  gemm(false, true, M, N, K, 1.f, inp, K, weight, K, bias ? 1.f : 0.f, out, N);
}

void matmul_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                     const float* weight, int64_t M, int64_t K, int64_t N, bool accumulate_dinp) {
  LOOM_CHECK(M >= 0 && K >= 0 && N >= 0, "matmul_backward: negative size M={} K={} N={}", M, K, N);
  // dinp [M, K] = dout [M, N] @ weight [N, K]
  if (dinp) gemm(false, false, M, K, N, 1.f, dout, N, weight, K, accumulate_dinp ? 1.f : 0.f, dinp, K);
  // dweight [N, K] += dout^T [N, M] @ inp [M, K]
  if (dweight) gemm(true, false, N, K, M, 1.f, dout, N, inp, K, 1.f, dweight, K);
  if (dbias && M > 0) column_sums_accumulate(dbias, dout, M, N);
}

struct Bf16Matmul::Impl {
  MemoryPool& pool;
  dnnl::engine eng{dnnl::engine::kind::cpu, 0};
  dnnl::stream strm{eng};
  struct Prim {
    dnnl::matmul::primitive_desc pd;
    dnnl::matmul mm;
  };
  // Primitives by (trans_a, trans_b, M, N, K, accumulate, bias, ldc).
  std::map<std::tuple<bool, bool, int64_t, int64_t, int64_t, bool, bool, int64_t>, Prim> prims;
  // bf16 copies of the operands (a16 the input, b16 a block of the weight's rows, c16 a block of
  // the output gradient's columns); oneDNN's scratch (in 2-byte elements).
  Tensor a16, b16, c16, scratch;

  explicit Impl(MemoryPool& p) : pool(p) {}

  // t holds at least n elements of dtype (grown, never shrunk: the largest layer's size).
  void reserve(Tensor& t, int64_t n, DType dtype) {
    if (t.numel() >= n) return;
    t = Tensor();
    t = Tensor::empty({n}, dtype, MemTag::workspace, pool);
  }
  const uint16_t* to_bf16(Tensor& t, const float* x, int64_t n) {
    reserve(t, n, DType::bf16);
    f32_to_bf16(reinterpret_cast<bf16*>(t.raw()), x, n);
    return static_cast<const uint16_t*>(t.raw());
  }

  using dt = dnnl::memory::data_type;
  static dnnl::memory::desc a_desc(bool trans_a, int64_t M, int64_t K) {
    return {{M, K}, dt::bf16, trans_a ? dnnl::memory::dims{1, M} : dnnl::memory::dims{K, 1}};
  }
  static dnnl::memory::desc b_desc(bool trans_b, int64_t K, int64_t N) {
    return {{K, N}, dt::bf16, trans_b ? dnnl::memory::dims{1, K} : dnnl::memory::dims{N, 1}};
  }
  static dnnl::memory::desc c_desc(int64_t M, int64_t N, int64_t ldc) {
    return {{M, N}, dt::f32, dnnl::memory::dims{ldc, 1}};
  }
  static dnnl::memory::desc bias_desc(int64_t N) { return {{1, N}, dt::f32, dnnl::memory::dims{N, 1}}; }

  // The primitive of one product, made on first use.
  const Prim& prim(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, bool accumulate, bool bias,
                   int64_t ldc) {
    const auto key = std::make_tuple(trans_a, trans_b, M, N, K, accumulate, bias, ldc);
    auto it = prims.find(key);
    if (it == prims.end()) {
      const dnnl::memory::desc ad = a_desc(trans_a, M, K), bd = b_desc(trans_b, K, N), cd = c_desc(M, N, ldc);
      dnnl::primitive_attr attr;
      attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
      if (accumulate) {
        dnnl::post_ops po;
        po.append_sum(1.f);
        attr.set_post_ops(po);
      }
      try {
        const dnnl::matmul::desc md =
            bias ? dnnl::matmul::desc(ad, bd, bias_desc(N), cd) : dnnl::matmul::desc(ad, bd, cd);
        dnnl::matmul::primitive_desc pd(md, attr, eng);
        it = prims.emplace(key, Prim{pd, dnnl::matmul(pd)}).first;
      } catch (const dnnl::error& e) {
        LOOM_FAIL("bf16 matmul: oneDNN has no matmul for M={} N={} K={} (trans_a={}, trans_b={}): {}", M, N, K,
                  trans_a, trans_b, e.what());
      }
    }
    return it->second;
  }
  // The scratch buffer's elements (2 bytes each) for a primitive: at least one.
  static int64_t scratch_elements(const Prim& p) {
    return std::max<int64_t>((int64_t(p.pd.scratchpad_desc().get_size()) + 1) / 2, 1);
  }

  // C [M, N] (rows ldc apart; = or += by accumulate) op(A) @ op(B) (+ bias [N]): A [M, K] or, with
  // trans_a, [K, M]; B [K, N] or, with trans_b, [N, K]; row-major, bf16 A and B, f32 C and bias.
  void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const uint16_t* A, const uint16_t* B,
            const float* bias, bool accumulate, float* C, int64_t ldc) {
    const Prim& p = prim(trans_a, trans_b, M, N, K, accumulate, bias != nullptr, ldc);
    reserve(scratch, scratch_elements(p), DType::u16);
    std::unordered_map<int, dnnl::memory> args{
        {DNNL_ARG_SRC, dnnl::memory(a_desc(trans_a, M, K), eng, const_cast<uint16_t*>(A))},
        {DNNL_ARG_WEIGHTS, dnnl::memory(b_desc(trans_b, K, N), eng, const_cast<uint16_t*>(B))},
        {DNNL_ARG_DST, dnnl::memory(c_desc(M, N, ldc), eng, C)},
        {DNNL_ARG_SCRATCHPAD, dnnl::memory(p.pd.scratchpad_desc(), eng, scratch.raw())}};
    if (bias) args.emplace(DNNL_ARG_BIAS, dnnl::memory(bias_desc(N), eng, const_cast<float*>(bias)));
    p.mm.execute(strm, args);
    strm.wait();
  }
};

namespace {

// The products split a layer's output features N into blocks of at most kBlockN, so that the bf16
// copies of its weight and of its output gradient hold one block (kBlockN x K, M x kBlockN), not
// the whole matrix: a vocabulary head's copies shrink from V x K + M x V values to kBlockN x (K +
// M). GPT-2 124M's head (V = 50304, K = 768) at 1024 tokens: 180 MB of copies become 15 MB, its
// three products 13 each.
constexpr int64_t kBlockN = 4096;

// Calls f(n0, nb) for the blocks [n0, n0 + nb) of N.
template <class F>
void for_each_block(int64_t N, F f) {
  for (int64_t n0 = 0; n0 < N; n0 += kBlockN) f(n0, std::min(kBlockN, N - n0));
}

}  // namespace

Bf16Matmul::Bf16Matmul(MemoryPool& pool) {
  const std::string missing = cpu_bf16_missing();
  LOOM_CHECK(missing.empty(), "bf16 matmul: needs a CPU with {}", missing);
  impl_ = std::make_unique<Impl>(pool);
}

Bf16Matmul::~Bf16Matmul() = default;

void Bf16Matmul::release() {
  Impl& m = *impl_;
  m.a16 = Tensor(), m.b16 = Tensor(), m.c16 = Tensor(), m.scratch = Tensor();
}

// What forward / backward below keep for calls of these shapes: the largest of each bf16 copy
// (a16 an input, b16 a block of a weight's rows, c16 a block of an output gradient's columns) and
// of oneDNN's scratch over the products the calls make, block by block (their primitives made now,
// as the calls would make them).
int64_t Bf16Matmul::workspace_bytes(const std::vector<LinearShape>& shapes) const {
  Impl& m = *impl_;
  int64_t a = 0, b = 0, c = 0, scratch = 0;
  auto need = [&](const Impl::Prim& p) { scratch = std::max(scratch, Impl::scratch_elements(p)); };
  for (const LinearShape& s : shapes) {
    if (s.M <= 0 || s.K <= 0 || s.N <= 0) continue;  // (the f32 path's: no copies)
    const int64_t block = std::min(kBlockN, s.N);
    a = std::max(a, s.M * s.K), b = std::max(b, block * s.K);
    if (s.dinp || s.dweight) c = std::max(c, s.M * block);
    for_each_block(s.N, [&](int64_t n0, int64_t nb) {
      need(m.prim(false, true, s.M, nb, s.K, false, s.bias, s.N));
      if (s.dinp) need(m.prim(false, false, s.M, s.K, nb, s.accumulate_dinp || n0 > 0, false, s.K));
      if (s.dweight) need(m.prim(true, false, nb, s.K, s.M, true, false, s.K));
    });
  }
  return int64_t(sizeof(uint16_t)) * (a + b + c + scratch);
}

void Bf16Matmul::forward(float* out, const float* inp, const float* weight, const float* bias, int64_t M, int64_t K,
                         int64_t N) {
  LOOM_CHECK(M >= 0 && K >= 0 && N >= 0, "matmul_forward (bf16): negative size M={} K={} N={}", M, K, N);
  if (M == 0 || N == 0) return;
  if (K == 0) return matmul_forward(out, inp, weight, bias, M, K, N);  // no product: the f32 path's zeros and bias
  Impl& m = *impl_;
  const uint16_t* a = m.to_bf16(m.a16, inp, M * K);
  // out [M, n0 : n0 + nb] = inp [M, K] @ weight [n0 : n0 + nb, K]^T + bias [n0 : n0 + nb]
  for_each_block(N, [&](int64_t n0, int64_t nb) {
    const uint16_t* b = m.to_bf16(m.b16, weight + n0 * K, nb * K);
    m.gemm(false, true, M, nb, K, a, b, bias ? bias + n0 : nullptr, false, out + n0, N);
  });
}

void Bf16Matmul::backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                          const float* weight, int64_t M, int64_t K, int64_t N, bool accumulate_dinp) {
  LOOM_CHECK(M >= 0 && K >= 0 && N >= 0, "matmul_backward (bf16): negative size M={} K={} N={}", M, K, N);
  if (M == 0 || K == 0 || N == 0)
    return matmul_backward(dinp, dweight, dbias, dout, inp, weight, M, K, N, accumulate_dinp);
  Impl& m = *impl_;
  const uint16_t* x = dweight ? m.to_bf16(m.a16, inp, M * K) : nullptr;
  if (dinp || dweight)
    for_each_block(N, [&](int64_t n0, int64_t nb) {
      m.reserve(m.c16, M * nb, DType::bf16);
      f32_to_bf16_rows(static_cast<bf16*>(m.c16.raw()), dout + n0, M, nb, N);
      const auto* g = static_cast<const uint16_t*>(m.c16.raw());  // dout [M, n0 : n0 + nb]
      // dinp [M, K] (= or +=) dout [M, n0 : n0 + nb] @ weight [n0 : n0 + nb, K], summed over the blocks
      if (dinp)
        m.gemm(false, false, M, K, nb, g, m.to_bf16(m.b16, weight + n0 * K, nb * K), nullptr,
               accumulate_dinp || n0 > 0, dinp, K);
      // dweight [n0 : n0 + nb, K] += dout [M, n0 : n0 + nb]^T @ inp [M, K]
      if (dweight) m.gemm(true, false, nb, K, M, g, x, nullptr, true, dweight + n0 * K, K);
    });
  if (dbias) column_sums_accumulate(dbias, dout, M, N);
}

namespace {

// The best sustained rate in GFLOP/s of product(a, b, c) computing C [M, N] from A [M, K] and B
// (K x N values) on smooth f32 operands (no denormals, no overflow): over windows of 3 consecutive
// calls, for at least `seconds`, so one lucky call does not count as the peak.
template <class F>
double sustained_gflops(int64_t M, int64_t N, int64_t K, double seconds, F product) {
  std::vector<float> a(size_t(M * K)), b(size_t(K * N)), c(size_t(M * N), 0.f);
  for (size_t i = 0; i < a.size(); ++i) a[i] = float(int(i % 97) - 48) * (1.f / 64.f);
  for (size_t i = 0; i < b.size(); ++i) b[i] = float(int(i % 89) - 44) * (1.f / 64.f);
  using clock = std::chrono::steady_clock;
  auto run_once = [&] {
    auto t0 = clock::now();
    product(a.data(), b.data(), c.data());
    return std::chrono::duration<double>(clock::now() - t0).count();
  };
  const double flops = 2.0 * double(M) * double(N) * double(K);
  run_once();  // warm-up: page faults, oneDNN's JIT, thread start
  double best = 0.0, window = 0.0, elapsed = 0.0;
  int in_window = 0;
  do {
    const double t = run_once();
    elapsed += t;
    window += t;
    if (++in_window == 3) {
      best = std::max(best, 3.0 * flops / window);
      window = 0.0;
      in_window = 0;
    }
  } while (elapsed < seconds || best == 0.0);
  return best * 1e-9;
}

}  // namespace

double measure_gemm_gflops(int64_t M, int64_t N, int64_t K, double seconds) {
  LOOM_CHECK(M > 0 && N > 0 && K > 0, "measure_gemm_gflops: [{}, {}, {}] must be positive", M, N, K);
  return sustained_gflops(M, N, K, seconds, [&](const float* a, const float* b, float* c) {
    gemm(false, false, M, N, K, 1.f, a, K, b, N, 0.f, c, N);
  });
}

double measure_bf16_gemm_peak_gflops(int64_t n, double seconds) {
  LOOM_CHECK(n > 0, "measure_bf16_gemm_peak_gflops: n = {} must be positive", n);
  MemoryPool pool("bf16-peak");
  Bf16Matmul mm(pool);
  return sustained_gflops(n, n, n, seconds,
                          [&](const float* a, const float* b, float* c) { mm.forward(c, a, b, nullptr, n, n, n); });
}

double measure_gemm_peak_gflops(int64_t n, double seconds) { return measure_gemm_gflops(n, n, n, seconds); }

}  // namespace loom::cpu
