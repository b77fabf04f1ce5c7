#include "kernels/emu/backend.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>

#include "comm/comm.h"
#include "core/error.h"
#include "kernels/cpu/adamw.h"

namespace loom::emu {

namespace {

// One bf16 operand of an op: rows of cols elements, stride apart (a packed q, k or v inside its
// [B, T, 3 C] buffer), or n contiguous ones; null or empty operands are left out.
struct Operand {
  const void* p = nullptr;
  int64_t rows = 1, cols = 0, stride = 0;
  Operand(const void* p_, int64_t n) : p(p_), cols(n), stride(n) {}
  Operand(const void* p_, int64_t rows_, int64_t cols_, int64_t stride_)
      : p(p_), rows(rows_), cols(cols_), stride(rows_ == 1 ? cols_ : stride_) {}
  const char* begin() const { return static_cast<const char*>(p); }
  const char* end() const { return begin() + 2 * ((rows - 1) * stride + cols); }
  bool empty() const { return !p || rows <= 0 || cols <= 0; }
};

// An op's bf16 operands widened into the backend's f32 scratch (overlapping ones, like an aliased
// output or the q, k and v columns of one buffer, share one span of it; outputs are widened too,
// for ops that accumulate or write only some rows) and, after the op, the written ones rounded
// back: only their own rows' columns, so that no byte outside what the op writes is stored to
// (another thread may be reading it: a pipeline's send in flight, a gradient bucket's reduction).
class Widened {
 public:
  Widened(EmuBackend& be, std::initializer_list<Operand> outs, std::initializer_list<Operand> ins) {
    for (const Operand& o : outs) (o.empty() ? empty_ : outs_).push_back(o);
    std::vector<Operand> all = outs_;
    for (const Operand& o : ins) (o.empty() ? empty_ : all).push_back(o);
    for (const Operand& o : all)
      LOOM_CHECK(o.rows == 1 || o.stride >= o.cols, "emu backend: rows of {} elements {} apart", o.cols, o.stride);
    std::sort(all.begin(), all.end(),
              [](const Operand& a, const Operand& b) { return std::less<const char*>()(a.begin(), b.begin()); });
    int64_t total = 0;
    for (const Operand& o : all) {
      if (!spans_.empty() && o.begin() < spans_.back().hi) {
        spans_.back().hi = std::max(spans_.back().hi, o.end());
      } else {
        spans_.push_back({o.begin(), o.end(), 0});
      }
    }
    for (Span& sp : spans_) {
      sp.at = total;
      total += (sp.hi - sp.lo) / 2;
    }
    base_ = be.scratch(total);
    for (const Span& sp : spans_)
      bf16_to_f32(base_ + sp.at, reinterpret_cast<const bf16*>(sp.lo), (sp.hi - sp.lo) / 2);
  }
  // The f32 image of p (an operand's pointer; null stays null).
  float* operator()(const void* p) const {
    if (!p) return nullptr;
    const char* c = static_cast<const char*>(p);
    for (const Span& sp : spans_)
      if (c >= sp.lo && c < sp.hi) return base_ + sp.at + (c - sp.lo) / 2;
    // An operand of no elements (a zero-size call): any pointer the kernel will not read.
    for (const Operand& o : empty_)
      if (o.p == p) return const_cast<float*>(&nothing_);
    LOOM_FAIL("emu backend: pointer {} is not an operand of the op", p);
  }
  // Rounds the written operands back to bf16.
  void narrow() const {
    for (const Operand& o : outs_) {
      const float* f = (*this)(o.p);
      bf16* d = static_cast<bf16*>(const_cast<void*>(o.p));
      for (int64_t r = 0; r < o.rows; ++r) f32_to_bf16(d + r * o.stride, f + r * o.stride, o.cols);
    }
  }

 private:
  struct Span {
    const char* lo;
    const char* hi;
    int64_t at;
  };
  std::vector<Operand> outs_, empty_;
  std::vector<Span> spans_;
  float* base_ = nullptr;
  float nothing_ = 0;
};

// Runs op(w) on the widened operands, then rounds the outputs back.
template <class F>
void widened(EmuBackend& be, std::initializer_list<Operand> outs, std::initializer_list<Operand> ins, F&& op) {
  Widened w(be, outs, ins);
  op(w);
  w.narrow();
}

// AdamW on the f32 master weights (the CPU's plan), then each compute copy refreshed from them.
// As a GPU's plan: a gradient norm that is not finite skips the update (the CPU's throws when it
// forms the norm itself, so the norm is formed here and passed on).
class EmuAdamW final : public AdamWPlan {
 public:
  EmuAdamW(std::unique_ptr<AdamWPlan> plan, std::vector<AdamWTensor> t) : plan_(std::move(plan)), t_(std::move(t)) {}
  void set_hyper(const AdamWHyper& h) override { h_ = h; }
  void launch() override {
    AdamWHyper h = h_;
    if (h.global_norm < 0) {
      double sq = 0;
      for (const AdamWTensor& x : t_) sq += cpu::sum_squares(x.grad, x.n);
      h.global_norm = double(h.grad_scale) * std::sqrt(sq);
    }
    plan_->set_hyper(h);
    plan_->launch();
    if (!std::isfinite(h.global_norm)) return;  // skipped: the masters, and so the copies, as they were
    for (const AdamWTensor& x : t_)
      if (x.compute && x.compute != static_cast<void*>(x.param))
        f32_to_bf16(static_cast<bf16*>(x.compute), x.param, x.n);
  }
  double grad_norm() override { return plan_->grad_norm(); }

 private:
  std::unique_ptr<AdamWPlan> plan_;
  std::vector<AdamWTensor> t_;
  AdamWHyper h_;
};

// A host communicator that declares it takes the device's buffers (they are host memory).
class BufferComm final : public comm::Comm {
 public:
  explicit BufferComm(std::unique_ptr<comm::Comm> host) : Comm(host->options()), host_(std::move(host)) {}
  int rank() const override { return host_->rank(); }
  int size() const override { return host_->size(); }
  std::string_view backend() const override { return "emu"; }
  int world_rank() const override { return host_->world_rank(); }
  bool device_buffers() const override { return true; }

 protected:
  void do_all_reduce(void* buf, int64_t count, DType dt, comm::ReduceOp op) override {
    sync_timeout();
    host_->all_reduce(buf, count, dt, op);
  }
  void do_reduce_scatter(const void* send, void* recv, std::span<const int64_t> counts, DType dt,
                         comm::ReduceOp op) override {
    sync_timeout();
    host_->reduce_scatter_v(send, recv, counts, dt, op);
  }
  void do_all_gather(const void* send, void* recv, std::span<const int64_t> counts, DType dt) override {
    sync_timeout();
    host_->all_gather_v(send, recv, counts, dt);
  }
  void do_broadcast(void* buf, int64_t count, DType dt, int root) override {
    sync_timeout();
    host_->broadcast(buf, count, dt, root);
  }
  void do_send(const void* buf, int64_t count, DType dt, int dst, int tag) override {
    sync_timeout();
    host_->send(buf, count, dt, dst, tag);
  }
  void do_recv(void* buf, int64_t count, DType dt, int src, int tag) override {
    sync_timeout();
    host_->recv(buf, count, dt, src, tag);
  }
  std::unique_ptr<comm::PendingSend> do_isend(const void* buf, int64_t count, DType dt, int dst, int tag) override {
    sync_timeout();
    return host_->isend(buf, count, dt, dst, tag);
  }
  void do_sendrecv(const void* send_buf, int64_t send_count, int dst, void* recv_buf, int64_t recv_count, int src,
                   DType dt, int tag) override {
    sync_timeout();
    host_->sendrecv(send_buf, send_count, dst, recv_buf, recv_count, src, dt, tag);
  }
  void do_barrier() override {
    sync_timeout();
    host_->barrier();
  }
  std::unique_ptr<comm::Comm> do_split(int color, int key) override {
    sync_timeout();
    std::unique_ptr<comm::Comm> s = host_->split(color, key);
    if (!s) return nullptr;
    return std::make_unique<BufferComm>(std::move(s));
  }

 private:
  void sync_timeout() { host_->set_timeout(timeout()); }
  std::unique_ptr<comm::Comm> host_;
};

}  // namespace

EmuBackend::EmuBackend(const BackendOptions& opt) : compute_(opt.compute) {
  if (opt.pool) {
    pool_ = opt.pool;
  } else {
    own_pool_ = std::make_unique<MemoryPool>("emu", &emu_allocator());
    pool_ = own_pool_.get();
  }
  scratch_pool_ = pool_;
  LOOM_CHECK(pool_->device() == Device::emu, "emu backend: pool '{}' holds {} memory, not the emulated device's",
             pool_->name(), device_name(pool_->device()));
  LOOM_CHECK(compute_ == DType::bf16 || compute_ == DType::f32, "emu backend: computes in bf16 or f32, not {}",
             dtype_name(compute_));
  LOOM_CHECK(opt.attention == AttnKernel::automatic || opt.attention == AttnKernel::tiled,
             "emu backend: attention kernel '{}' runs on CUDA only (the emulated device runs the CPU's 'tiled')",
             attn_kernel_name(opt.attention));
  cpu_ = std::make_unique<cpu::CpuBackend>(BackendOptions{.pool = pool_});
}

EmuBackend::~EmuBackend() { release_workspace(); }

std::string EmuBackend::name() const {
  return fmt::format("emu (the CPU's kernels, {} on the device)", dtype_name(compute_));
}

bool EmuBackend::supports(Op op, DType dtype) const {
  // As a GPU's: ops in the compute dtype, and f32 sums of gradients; copies convert.
  if (op == Op::copy) return dtype == DType::f32 || dtype == DType::bf16 || dtype == DType::i32;
  if (op == Op::add && dtype == DType::f32) return true;
  return dtype == compute_;
}

void EmuBackend::check(Op op, DType dtype) const {
  LOOM_CHECK(supports(op, dtype), "emu backend: {} in {} is not supported (it computes in {})", op_name(op),
             dtype_name(dtype), dtype_name(compute_));
}

float* EmuBackend::scratch(int64_t n) {
  if (n > scratch_elems_) {
    release_scratch();
    scratch_ = scratch_pool_->allocate(size_t(n) * sizeof(float), MemTag::workspace);
    scratch_elems_ = n;
    memory_moved();
  }
  return static_cast<float*>(scratch_);
}

void EmuBackend::release_scratch() {
  if (!scratch_) return;
  scratch_pool_->deallocate(scratch_, size_t(scratch_elems_) * sizeof(float), MemTag::workspace);
  scratch_ = nullptr;
  scratch_elems_ = 0;
  memory_moved();
}

void EmuBackend::set_scratch_pool(MemoryPool& host) {
  LOOM_CHECK(host.device() == Device::cpu, "emu backend: scratch pool '{}' holds {} memory, not the host's", host.name(),
             device_name(host.device()));
  release_scratch();
  scratch_pool_ = &host;
}

void EmuBackend::release_workspace() {
  cpu_->release_workspace();
  release_scratch();
}

// Each op: in f32 (the compute dtype f32, or an f32 gradient sum) the CPU's kernel on the buffers
// themselves; in bf16 on their widened images.

void EmuBackend::linear_forward(const LinearForward& a) {
  check(Op::linear, a.dtype);
  if (a.dtype == DType::f32) return cpu_->linear_forward(a);
  const int64_t M = a.M, K = a.K, N = a.N;
  widened(*this, {{a.out, M * N}, {a.gelu ? a.pre_gelu : nullptr, M * N}},
          {{a.inp, M * K}, {a.weight, N * K}, {a.bias, N}, {a.residual, M * N}}, [&](const Widened& w) {
            LinearForward b = a;
            b.dtype = DType::f32;
            b.out = w(a.out);
            b.pre_gelu = a.gelu ? w(a.pre_gelu) : nullptr;
            b.inp = w(a.inp);
            b.weight = w(a.weight);
            b.bias = w(a.bias);
            b.residual = w(a.residual);
            cpu_->linear_forward(b);
          });
}

void EmuBackend::linear_backward(const LinearBackward& a) {
  check(Op::linear, a.dtype);
  if (a.dtype == DType::f32) return cpu_->linear_backward(a);
  const int64_t M = a.M, K = a.K, N = a.N;
  widened(*this, {{a.dinp, M * K}}, {{a.dout, M * N}, {a.inp, M * K}, {a.weight, N * K}, {a.gelu_pre, M * K}},
          [&](const Widened& w) {
            LinearBackward b = a;
            b.dtype = DType::f32;
            b.dinp = w(a.dinp);
            b.dout = w(a.dout);
            b.inp = w(a.inp);
            b.weight = w(a.weight);
            b.gelu_pre = w(a.gelu_pre);
            cpu_->linear_backward(b);
          });
}

void EmuBackend::layernorm_forward(const LayerNormForward& a) {
  check(a.rms ? Op::rmsnorm : Op::layernorm, a.dtype);
  if (a.dtype == DType::f32) return cpu_->layernorm_forward(a);
  // The residual sum is stored in bf16 first and normalised as stored, as a GPU's fused kernel
  // does (the backward reads the stored sum).
  const void* x = a.inp;
  if (a.residual_b) {
    LOOM_CHECK(a.residual_out, "layernorm_forward: residual_b without residual_out");
    add(a.dtype, a.residual_out, a.inp, a.residual_b, a.N * a.C);
    x = a.residual_out;
  }
  widened(*this, {{a.out, a.N * a.C}}, {{x, a.N * a.C}, {a.weight, a.C}, {a.bias, a.C}}, [&](const Widened& w) {
    LayerNormForward b = a;
    b.dtype = DType::f32;
    b.out = w(a.out);
    b.inp = w(x);
    b.residual_b = nullptr;
    b.residual_out = nullptr;
    b.weight = w(a.weight);
    b.bias = w(a.bias);
    cpu_->layernorm_forward(b);
  });
}

void EmuBackend::layernorm_backward(const LayerNormBackward& a) {
  check(a.rms ? Op::rmsnorm : Op::layernorm, a.dtype);
  if (a.dtype == DType::f32) return cpu_->layernorm_backward(a);
  const int64_t n = a.N * a.C;
  widened(*this, {{a.dinp, n}}, {{a.dout, n}, {a.inp, n}, {a.weight, a.C}}, [&](const Widened& w) {
    LayerNormBackward b = a;
    b.dtype = DType::f32;
    b.dinp = w(a.dinp);
    b.dout = w(a.dout);
    b.inp = w(a.inp);
    b.weight = w(a.weight);
    cpu_->layernorm_backward(b);
  });
}

void EmuBackend::prepare_attention(DType dtype, const AttnShape& s) {
  check(Op::attention, dtype);
  cpu_->prepare_attention(DType::f32, s);
}

int64_t EmuBackend::attention_workspace_bytes(DType dtype, const AttnShape& s, int threads) const {
  check(Op::attention, dtype);
  return cpu_->attention_workspace_bytes(DType::f32, s, threads);
}

namespace {
// Attention's operands: queries (and outputs) of B Tq rows, keys and values of B Tkv rows.
Operand rows_q(const void* p, const AttnShape& s, int64_t stride) { return {p, s.B * s.Tq, s.NH * s.HS, stride}; }
Operand rows_kv(const void* p, const AttnShape& s) { return {p, s.B * s.Tkv, s.kv_heads() * s.HS, s.kv_stride}; }
}  // namespace

void EmuBackend::attention_forward(const AttentionForward& a) {
  check(Op::attention, a.dtype);
  if (a.dtype == DType::f32) return cpu_->attention_forward(a);
  const AttnShape& s = a.shape;
  widened(*this, {rows_q(a.out, s, s.o_stride)}, {rows_q(a.q, s, s.q_stride), rows_kv(a.k, s), rows_kv(a.v, s)},
          [&](const Widened& w) {
            AttentionForward b = a;
            b.dtype = DType::f32;
            b.out = w(a.out);
            b.q = w(a.q);
            b.k = w(a.k);
            b.v = w(a.v);
            b.probs = nullptr;
            cpu_->attention_forward(b);
          });
}

void EmuBackend::attention_backward(const AttentionBackward& a) {
  check(Op::attention, a.dtype);
  if (a.dtype == DType::f32) return cpu_->attention_backward(a);
  const AttnShape& s = a.shape;
  widened(*this, {rows_q(a.dq, s, s.q_stride), rows_kv(a.dk, s), rows_kv(a.dv, s)},
          {rows_q(a.dout, s, s.o_stride), rows_q(a.out, s, s.o_stride), rows_q(a.q, s, s.q_stride), rows_kv(a.k, s),
           rows_kv(a.v, s)},
          [&](const Widened& w) {
            AttentionBackward b = a;
            b.dtype = DType::f32;
            b.dq = w(a.dq);
            b.dk = w(a.dk);
            b.dv = w(a.dv);
            b.dout = w(a.dout);
            b.out = w(a.out);
            b.q = w(a.q);
            b.k = w(a.k);
            b.v = w(a.v);
            b.probs = nullptr;
            cpu_->attention_backward(b);
          });
}

void EmuBackend::attention_merge(const AttentionMerge& a) {
  check(Op::attention, a.dtype);
  if (a.dtype == DType::f32) return cpu_->attention_merge(a);
  widened(*this, {}, {{a.part, a.B * a.Tq * a.NH * a.HS}}, [&](const Widened& w) {
    AttentionMerge b = a;
    b.dtype = DType::f32;
    b.part = w(a.part);
    cpu_->attention_merge(b);
  });
}

void EmuBackend::crossentropy(const CrossEntropy& a) {
  check(Op::crossentropy, a.dtype);
  if (a.dtype == DType::f32) return cpu_->crossentropy(a);
  widened(*this, {{a.dlogits, a.N * a.Vp}}, {{a.logits, a.N * a.Vp}}, [&](const Widened& w) {
    CrossEntropy b = a;
    b.dtype = DType::f32;
    b.dlogits = w(a.dlogits);
    b.logits = w(a.logits);
    cpu_->crossentropy(b);
  });
}

void EmuBackend::vocab_crossentropy(const VocabCrossEntropy& a) {
  check(Op::crossentropy, a.dtype);
  if (a.dtype == DType::f32) return cpu_->vocab_crossentropy(a);
  const bool finish = a.pass == VocabCrossEntropy::Pass::finish;
  widened(*this, {{finish ? a.dlogits : nullptr, a.N * a.Vs}}, {{a.logits, a.N * a.Vs}}, [&](const Widened& w) {
    VocabCrossEntropy b = a;
    b.dtype = DType::f32;
    b.dlogits = finish ? w(a.dlogits) : nullptr;
    b.logits = w(a.logits);
    cpu_->vocab_crossentropy(b);
  });
}

void EmuBackend::embedding_forward(const EmbeddingForward& a) {
  check(Op::embedding, a.dtype);
  if (a.dtype == DType::f32) return cpu_->embedding_forward(a);
  // The position table's rows the call reads.
  int64_t positions = a.pos0 + a.T;
  if (a.positions) {
    positions = 0;
    for (int64_t t = 0; t < a.T; ++t) positions = std::max<int64_t>(positions, int64_t(a.positions[t]) + 1);
  }
  widened(*this, {{a.out, a.B * a.T * a.C}},
          {{a.wte, (a.vocab_rows > 0 ? a.vocab_rows : a.V) * a.C}, {a.wpe, positions * a.C}}, [&](const Widened& w) {
            EmbeddingForward b = a;
            b.dtype = DType::f32;
            b.out = w(a.out);
            b.wte = w(a.wte);
            b.wpe = w(a.wpe);
            cpu_->embedding_forward(b);
          });
}

void EmuBackend::embedding_backward(const EmbeddingBackward& a) {
  check(Op::embedding, a.dtype);
  if (a.dtype == DType::f32) return cpu_->embedding_backward(a);
  widened(*this, {}, {{a.dout, a.B * a.T * a.C}}, [&](const Widened& w) {
    EmbeddingBackward b = a;
    b.dtype = DType::f32;
    b.dout = w(a.dout);
    cpu_->embedding_backward(b);
  });
}

void EmuBackend::gelu_forward(DType dtype, void* out, const void* inp, int64_t n) {
  check(Op::gelu, dtype);
  if (dtype == DType::f32) return cpu_->gelu_forward(dtype, out, inp, n);
  widened(*this, {{out, n}}, {{inp, n}}, [&](const Widened& w) { cpu_->gelu_forward(DType::f32, w(out), w(inp), n); });
}

void EmuBackend::gelu_backward(DType dtype, void* dinp, const void* inp, const void* dout, int64_t n) {
  check(Op::gelu, dtype);
  if (dtype == DType::f32) return cpu_->gelu_backward(dtype, dinp, inp, dout, n);
  widened(*this, {{dinp, n}}, {{inp, n}, {dout, n}},
          [&](const Widened& w) { cpu_->gelu_backward(DType::f32, w(dinp), w(inp), w(dout), n); });
}

void EmuBackend::rope(const Rope& a) {
  check(Op::rope, a.dtype);
  if (a.dtype == DType::f32) return cpu_->rope(a);
  widened(*this, {{a.x, a.B * a.T, a.NH * a.HS, a.stride}}, {}, [&](const Widened& w) {
    Rope b = a;
    b.dtype = DType::f32;
    b.x = w(a.x);
    cpu_->rope(b);
  });
}

void EmuBackend::swiglu_forward(DType dtype, void* out, const void* inp, int64_t N, int64_t H) {
  check(Op::swiglu, dtype);
  if (dtype == DType::f32) return cpu_->swiglu_forward(dtype, out, inp, N, H);
  widened(*this, {{out, N * H}}, {{inp, N * 2 * H}},
          [&](const Widened& w) { cpu_->swiglu_forward(DType::f32, w(out), w(inp), N, H); });
}

void EmuBackend::swiglu_backward(DType dtype, void* dinp, const void* dout, const void* inp, int64_t N, int64_t H) {
  check(Op::swiglu, dtype);
  if (dtype == DType::f32) return cpu_->swiglu_backward(dtype, dinp, dout, inp, N, H);
  widened(*this, {{dinp, N * 2 * H}}, {{dout, N * H}, {inp, N * 2 * H}},
          [&](const Widened& w) { cpu_->swiglu_backward(DType::f32, w(dinp), w(dout), w(inp), N, H); });
}

void EmuBackend::add(DType dtype, void* out, const void* a, const void* b, int64_t n) {
  check(Op::add, dtype);
  if (dtype == DType::f32) return cpu_->add(dtype, out, a, b, n);
  widened(*this, {{out, n}}, {{a, n}, {b, n}}, [&](const Widened& w) { cpu_->add(DType::f32, w(out), w(a), w(b), n); });
}

std::unique_ptr<AdamWPlan> EmuBackend::plan_adamw(const std::vector<AdamWTensor>& tensors) {
  std::vector<AdamWTensor> master = tensors;
  for (AdamWTensor& t : master) t.compute = nullptr;
  for (const AdamWTensor& t : tensors)
    LOOM_CHECK(!t.compute || t.compute == static_cast<void*>(t.param) || compute_ == DType::bf16,
               "emu backend: an AdamW compute copy with f32 compute");
  return std::make_unique<EmuAdamW>(cpu_->plan_adamw(master), tensors);
}

std::unique_ptr<comm::Comm> EmuBackend::buffer_comm(std::unique_ptr<comm::Comm> host, bool staged) {
  (void)staged;  // (the host backend's sends are posted without waiting already)
  return std::make_unique<BufferComm>(std::move(host));
}

}  // namespace loom::emu

// Registration (core/backend.h); the anchor is named on the link line of every program that links
// loom_lib (CMakeLists.txt).
extern "C" {
int loom_emu_backend_anchor = [] {
  loom::register_backend(loom::Device::emu, [](const loom::BackendOptions& opt) -> std::unique_ptr<loom::Backend> {
    return std::make_unique<loom::emu::EmuBackend>(opt);
  });
  return 1;
}();
}
