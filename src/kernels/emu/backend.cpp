#include "kernels/emu/backend.h"

#include <algorithm>
#include <cstring>

#include "comm/comm.h"
#include "core/error.h"

namespace loom::emu {

namespace {

// One bf16 operand of an op: rows of cols elements, stride apart (a packed q, k or v inside its
// [B, T, 3 C] buffer); written when the op writes it.
struct Operand {
  const char* p = nullptr;
  int64_t rows = 1, cols = 0, stride = 0;
  bool written = false;
  const char* end() const { return p + 2 * ((rows - 1) * stride + cols); }
};

// An op's bf16 operands widened into f32 scratch (overlapping ones, like an aliased output or the
// q, k and v columns of one buffer, share one span of it) and, after the op, the written ones
// rounded back: only their own rows' columns, so that no byte outside what the op writes is
// stored to (another thread may be reading it, a pipeline's send in flight).
class Widened {
 public:
  explicit Widened(EmuBackend& be) : be_(be) {}
  void in(const void* p, int64_t n) { add(p, 1, n, n, false); }
  void out(void* p, int64_t n) { add(p, 1, n, n, true); }
  void in(const void* p, int64_t rows, int64_t cols, int64_t stride) { add(p, rows, cols, stride, false); }
  void out(void* p, int64_t rows, int64_t cols, int64_t stride) { add(p, rows, cols, stride, true); }

  // Merges the operands' intervals and widens each into its span of the scratch.
  void widen() {
    std::vector<const Operand*> by_start;
    for (const Operand& o : ops_) by_start.push_back(&o);
    std::sort(by_start.begin(), by_start.end(), [](const Operand* a, const Operand* b) { return a->p < b->p; });
    int64_t total = 0;
    for (const Operand* o : by_start) {
      if (!spans_.empty() && o->p < spans_.back().hi) {
        spans_.back().hi = std::max(spans_.back().hi, o->end());
      } else {
        spans_.push_back({o->p, o->end(), 0});
      }
    }
    for (Span& s : spans_) {
      s.at = total;
      total += (s.hi - s.lo) / 2;
    }
    base_ = be_.scratch(total);
    for (const Span& s : spans_)
      bf16_to_f32(base_ + s.at, reinterpret_cast<const bf16*>(s.lo), (s.hi - s.lo) / 2);
  }
  // The f32 image of p (an operand's pointer; null stays null).
  float* operator()(const void* p) const {
    if (!p) return nullptr;
    const char* c = static_cast<const char*>(p);
    for (const Span& s : spans_)
      if (c >= s.lo && c < s.hi) return base_ + s.at + (c - s.lo) / 2;
    LOOM_FAIL("emu backend: pointer {} is not an operand of the op", p);
  }
  // Rounds the written operands back to bf16.
  void narrow() const {
    for (const Operand& o : ops_) {
      if (!o.written) continue;
      const float* f = (*this)(o.p);
      bf16* d = reinterpret_cast<bf16*>(const_cast<char*>(o.p));
      for (int64_t r = 0; r < o.rows; ++r) f32_to_bf16(d + r * o.stride, f + r * o.stride, o.cols);
    }
  }

 private:
  struct Span {
    const char* lo;
    const char* hi;
    int64_t at;
  };
  void add(const void* p, int64_t rows, int64_t cols, int64_t stride, bool written) {
    if (!p || rows <= 0 || cols <= 0) return;
    LOOM_CHECK(rows == 1 || stride >= cols, "emu backend: rows of {} elements {} apart", cols, stride);
    ops_.push_back({static_cast<const char*>(p), rows, cols, rows == 1 ? cols : stride, written});
  }
  EmuBackend& be_;
  std::vector<Operand> ops_;
  std::vector<Span> spans_;
  float* base_ = nullptr;
};

// AdamW on the f32 master weights (the CPU's plan), then each compute copy refreshed from them.
class EmuAdamW final : public AdamWPlan {
 public:
  EmuAdamW(std::unique_ptr<AdamWPlan> plan, std::vector<AdamWTensor> t) : plan_(std::move(plan)), t_(std::move(t)) {}
  void set_hyper(const AdamWHyper& h) override { plan_->set_hyper(h); }
  void launch() override {
    plan_->launch();  // (a skipped update leaves the masters, and so the copies, as they were)
    for (const AdamWTensor& x : t_)
      if (x.compute && x.compute != static_cast<void*>(x.param))
        f32_to_bf16(static_cast<bf16*>(x.compute), x.param, x.n);
  }
  double grad_norm() override { return plan_->grad_norm(); }

 private:
  std::unique_ptr<AdamWPlan> plan_;
  std::vector<AdamWTensor> t_;
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
    if (scratch_) pool_->deallocate(scratch_, size_t(scratch_elems_) * sizeof(float), MemTag::workspace);
    scratch_ = nullptr;
    scratch_elems_ = 0;
    scratch_ = pool_->allocate(size_t(n) * sizeof(float), MemTag::workspace);
    scratch_elems_ = n;
    memory_moved();
  }
  return static_cast<float*>(scratch_);
}

void EmuBackend::release_workspace() {
  cpu_->release_workspace();
  if (scratch_) {
    pool_->deallocate(scratch_, size_t(scratch_elems_) * sizeof(float), MemTag::workspace);
    scratch_ = nullptr;
    scratch_elems_ = 0;
    memory_moved();
  }
}

void EmuBackend::linear_forward(const LinearForward& a) {
  check(Op::linear, a.dtype);
  if (a.dtype == DType::f32) return cpu_->linear_forward(a);
  Widened w(*this);
  w.out(a.out, a.M * a.N);
  if (a.gelu) w.out(a.pre_gelu, a.M * a.N);
  w.in(a.inp, a.M * a.K);
  w.in(a.weight, a.N * a.K);
  w.in(a.bias, a.N);
  w.in(a.residual, a.M * a.N);
  w.widen();
  LinearForward b = a;
  b.dtype = DType::f32;
  b.out = w(a.out);
  b.pre_gelu = a.gelu ? w(a.pre_gelu) : nullptr;
  b.inp = w(a.inp);
  b.weight = w(a.weight);
  b.bias = w(a.bias);
  b.residual = w(a.residual);
  cpu_->linear_forward(b);
  w.narrow();
}

void EmuBackend::linear_backward(const LinearBackward& a) {
  check(Op::linear, a.dtype);
  if (a.dtype == DType::f32) return cpu_->linear_backward(a);
  Widened w(*this);
  w.out(a.dinp, a.M * a.K);
  w.in(a.dout, a.M * a.N);
  w.in(a.inp, a.M * a.K);
  w.in(a.weight, a.N * a.K);
  w.in(a.gelu_pre, a.M * a.K);
  w.widen();
  LinearBackward b = a;
  b.dtype = DType::f32;
  b.dinp = w(a.dinp);
  b.dout = w(a.dout);
  b.inp = w(a.inp);
  b.weight = w(a.weight);
  b.gelu_pre = w(a.gelu_pre);
  cpu_->linear_backward(b);
  w.narrow();
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
  Widened w(*this);
  w.out(a.out, a.N * a.C);
  w.in(x, a.N * a.C);
  w.in(a.weight, a.C);
  w.in(a.bias, a.C);
  w.widen();
  LayerNormForward b = a;
  b.dtype = DType::f32;
  b.out = w(a.out);
  b.inp = w(x);
  b.residual_b = nullptr;
  b.residual_out = nullptr;
  b.weight = w(a.weight);
  b.bias = w(a.bias);
  cpu_->layernorm_forward(b);
  w.narrow();
}

void EmuBackend::layernorm_backward(const LayerNormBackward& a) {
  check(a.rms ? Op::rmsnorm : Op::layernorm, a.dtype);
  if (a.dtype == DType::f32) return cpu_->layernorm_backward(a);
  Widened w(*this);
  w.out(a.dinp, a.N * a.C);
  w.in(a.dout, a.N * a.C);
  w.in(a.inp, a.N * a.C);
  w.in(a.weight, a.C);
  w.widen();
  LayerNormBackward b = a;
  b.dtype = DType::f32;
  b.dinp = w(a.dinp);
  b.dout = w(a.dout);
  b.inp = w(a.inp);
  b.weight = w(a.weight);
  cpu_->layernorm_backward(b);
  w.narrow();
}

void EmuBackend::prepare_attention(DType dtype, const AttnShape& s) {
  check(Op::attention, dtype);
  cpu_->prepare_attention(DType::f32, s);
}

int64_t EmuBackend::attention_workspace_bytes(DType dtype, const AttnShape& s, int threads) const {
  check(Op::attention, dtype);
  return cpu_->attention_workspace_bytes(DType::f32, s, threads);
}

void EmuBackend::attention_forward(const AttentionForward& a) {
  check(Op::attention, a.dtype);
  if (a.dtype == DType::f32) return cpu_->attention_forward(a);
  const AttnShape& s = a.shape;
  const int64_t C = s.NH * s.HS, Ckv = s.kv_heads() * s.HS;
  Widened w(*this);
  w.out(a.out, s.B * s.Tq, C, s.o_stride);
  w.in(a.q, s.B * s.Tq, C, s.q_stride);
  w.in(a.k, s.B * s.Tkv, Ckv, s.kv_stride);
  w.in(a.v, s.B * s.Tkv, Ckv, s.kv_stride);
  w.widen();
  AttentionForward b = a;
  b.dtype = DType::f32;
  b.out = w(a.out);
  b.q = w(a.q);
  b.k = w(a.k);
  b.v = w(a.v);
  b.probs = nullptr;
  cpu_->attention_forward(b);
  w.narrow();
}

void EmuBackend::attention_backward(const AttentionBackward& a) {
  check(Op::attention, a.dtype);
  if (a.dtype == DType::f32) return cpu_->attention_backward(a);
  const AttnShape& s = a.shape;
  const int64_t C = s.NH * s.HS, Ckv = s.kv_heads() * s.HS;
  Widened w(*this);
  w.out(a.dq, s.B * s.Tq, C, s.q_stride);
  w.out(a.dk, s.B * s.Tkv, Ckv, s.kv_stride);
  w.out(a.dv, s.B * s.Tkv, Ckv, s.kv_stride);
  w.in(a.dout, s.B * s.Tq, C, s.o_stride);
  w.in(a.out, s.B * s.Tq, C, s.o_stride);
  w.in(a.q, s.B * s.Tq, C, s.q_stride);
  w.in(a.k, s.B * s.Tkv, Ckv, s.kv_stride);
  w.in(a.v, s.B * s.Tkv, Ckv, s.kv_stride);
  w.widen();
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
  w.narrow();
}

void EmuBackend::attention_merge(const AttentionMerge& a) {
  check(Op::attention, a.dtype);
  if (a.dtype == DType::f32) return cpu_->attention_merge(a);
  Widened w(*this);
  w.in(a.part, a.B * a.Tq * a.NH * a.HS);
  w.widen();
  AttentionMerge b = a;
  b.dtype = DType::f32;
  b.part = w(a.part);
  cpu_->attention_merge(b);
}

void EmuBackend::crossentropy(const CrossEntropy& a) {
  check(Op::crossentropy, a.dtype);
  if (a.dtype == DType::f32) return cpu_->crossentropy(a);
  Widened w(*this);
  w.out(a.dlogits, a.N * a.Vp);
  w.in(a.logits, a.N * a.Vp);
  w.widen();
  CrossEntropy b = a;
  b.dtype = DType::f32;
  b.dlogits = w(a.dlogits);
  b.logits = w(a.logits);
  cpu_->crossentropy(b);
  w.narrow();
}

void EmuBackend::vocab_crossentropy(const VocabCrossEntropy& a) {
  check(Op::crossentropy, a.dtype);
  if (a.dtype == DType::f32) return cpu_->vocab_crossentropy(a);
  Widened w(*this);
  if (a.pass == VocabCrossEntropy::Pass::finish) w.out(a.dlogits, a.N * a.Vs);
  w.in(a.logits, a.N * a.Vs);
  w.widen();
  VocabCrossEntropy b = a;
  b.dtype = DType::f32;
  b.dlogits = a.pass == VocabCrossEntropy::Pass::finish ? w(a.dlogits) : nullptr;
  b.logits = w(a.logits);
  cpu_->vocab_crossentropy(b);
  w.narrow();
}

namespace {
// Rows of the position table an embedding call reads.
int64_t position_rows(const int32_t* positions, int64_t T, int64_t pos0) {
  if (!positions) return pos0 + T;
  int64_t mx = -1;
  for (int64_t t = 0; t < T; ++t) mx = std::max<int64_t>(mx, positions[t]);
  return mx + 1;
}
}  // namespace

void EmuBackend::embedding_forward(const EmbeddingForward& a) {
  check(Op::embedding, a.dtype);
  if (a.dtype == DType::f32) return cpu_->embedding_forward(a);
  Widened w(*this);
  w.out(a.out, a.B * a.T * a.C);
  w.in(a.wte, (a.vocab_rows > 0 ? a.vocab_rows : a.V) * a.C);
  if (a.wpe) w.in(a.wpe, position_rows(a.positions, a.T, a.pos0) * a.C);
  w.widen();
  EmbeddingForward b = a;
  b.dtype = DType::f32;
  b.out = w(a.out);
  b.wte = w(a.wte);
  b.wpe = w(a.wpe);
  cpu_->embedding_forward(b);
  w.narrow();
}

void EmuBackend::embedding_backward(const EmbeddingBackward& a) {
  check(Op::embedding, a.dtype);
  if (a.dtype == DType::f32) return cpu_->embedding_backward(a);
  Widened w(*this);
  w.in(a.dout, a.B * a.T * a.C);
  w.widen();
  EmbeddingBackward b = a;
  b.dtype = DType::f32;
  b.dout = w(a.dout);
  cpu_->embedding_backward(b);
}

void EmuBackend::gelu_forward(DType dtype, void* out, const void* inp, int64_t n) {
  check(Op::gelu, dtype);
  if (dtype == DType::f32) return cpu_->gelu_forward(dtype, out, inp, n);
  Widened w(*this);
  w.out(out, n);
  w.in(inp, n);
  w.widen();
  cpu_->gelu_forward(DType::f32, w(out), w(inp), n);
  w.narrow();
}

void EmuBackend::gelu_backward(DType dtype, void* dinp, const void* inp, const void* dout, int64_t n) {
  check(Op::gelu, dtype);
  if (dtype == DType::f32) return cpu_->gelu_backward(dtype, dinp, inp, dout, n);
  Widened w(*this);
  w.out(dinp, n);
  w.in(inp, n);
  w.in(dout, n);
  w.widen();
  cpu_->gelu_backward(DType::f32, w(dinp), w(inp), w(dout), n);
  w.narrow();
}

void EmuBackend::rope(const Rope& a) {
  check(Op::rope, a.dtype);
  if (a.dtype == DType::f32) return cpu_->rope(a);
  Widened w(*this);
  w.out(a.x, a.B * a.T, a.NH * a.HS, a.stride);
  w.widen();
  Rope b = a;
  b.dtype = DType::f32;
  b.x = w(a.x);
  cpu_->rope(b);
  w.narrow();
}

void EmuBackend::swiglu_forward(DType dtype, void* out, const void* inp, int64_t N, int64_t H) {
  check(Op::swiglu, dtype);
  if (dtype == DType::f32) return cpu_->swiglu_forward(dtype, out, inp, N, H);
  Widened w(*this);
  w.out(out, N * H);
  w.in(inp, N * 2 * H);
  w.widen();
  cpu_->swiglu_forward(DType::f32, w(out), w(inp), N, H);
  w.narrow();
}

void EmuBackend::swiglu_backward(DType dtype, void* dinp, const void* dout, const void* inp, int64_t N, int64_t H) {
  check(Op::swiglu, dtype);
  if (dtype == DType::f32) return cpu_->swiglu_backward(dtype, dinp, dout, inp, N, H);
  Widened w(*this);
  w.out(dinp, N * 2 * H);
  w.in(dout, N * H);
  w.in(inp, N * 2 * H);
  w.widen();
  cpu_->swiglu_backward(DType::f32, w(dinp), w(dout), w(inp), N, H);
  w.narrow();
}

void EmuBackend::add(DType dtype, void* out, const void* a, const void* b, int64_t n) {
  check(Op::add, dtype);
  if (dtype == DType::f32) return cpu_->add(dtype, out, a, b, n);
  Widened w(*this);
  w.out(out, n);
  w.in(a, n);
  w.in(b, n);
  w.widen();
  cpu_->add(DType::f32, w(out), w(a), w(b), n);
  w.narrow();
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
