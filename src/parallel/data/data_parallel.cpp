#include "parallel/data/data_parallel.h"

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <limits>
#include <mutex>
#include <numeric>
#include <thread>

#include "core/error.h"

namespace loom::parallel {

namespace {

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
double seconds(Trace::Clock::duration d) { return std::chrono::duration<double>(d).count(); }
// The elements the ranks before r hold of a range cut by shard counts: where rank r's part starts.
int64_t count_before(const std::vector<int64_t>& counts, int r) {
  return std::accumulate(counts.begin(), counts.begin() + r, int64_t(0));
}
// Element i of a flat tensor of any dtype.
void* element(const Tensor& t, int64_t i) { return static_cast<char*>(t.raw()) + i * int64_t(dtype_size(t.dtype())); }

}  // namespace

// The communication thread of a rank: runs collectives on its own communicator, in submission
// order, while the compute thread continues. An error in a task is kept and rethrown by the next
// wait(); later tasks are skipped.
class DataParallel::Worker {
 public:
  Worker(std::unique_ptr<comm::Comm> c, Trace* trace, bool threaded) : comm_(std::move(c)), trace_(trace) {
    if (threaded) thread_ = std::thread([this] { loop(); });
  }
  ~Worker() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }
  comm::Comm& comm() { return *comm_; }

  int64_t submit(std::string name, std::function<void(comm::Comm&)> fn) {
    int64_t ticket;
    {
      std::lock_guard<std::mutex> lk(mu_);
      ticket = next_++;
      queue_.push_back({std::move(name), std::move(fn)});
    }
    if (!thread_.joinable()) {  // no overlap: run now on the caller's thread
      Task t = std::move(queue_.front());
      queue_.pop_front();
      run(t);
      return ticket;
    }
    cv_.notify_all();
    return ticket;
  }
  // Blocks until task `ticket` (and every earlier one) is done; rethrows a task's error.
  void wait(int64_t ticket) {
    std::unique_lock<std::mutex> lk(mu_);
    done_cv_.wait(lk, [&] { return done_ > ticket || error_; });
    if (error_) std::rethrow_exception(error_);
  }
  void wait_all() { wait(next_ - 1); }
  bool done(int64_t ticket) {
    std::lock_guard<std::mutex> lk(mu_);
    return done_ > ticket;
  }
  double busy_s() {
    std::lock_guard<std::mutex> lk(mu_);
    return busy_s_;
  }
  void reset_busy() {
    std::lock_guard<std::mutex> lk(mu_);
    busy_s_ = 0;
  }

 private:
  struct Task {
    std::string name;
    std::function<void(comm::Comm&)> fn;
  };
  void run(Task& t) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (error_) {
        ++done_;
        done_cv_.notify_all();
        return;
      }
    }
    auto t0 = Trace::Clock::now();
    std::exception_ptr err;
    try {
      t.fn(*comm_);
    } catch (...) {
      err = std::current_exception();
    }
    auto t1 = Trace::Clock::now();
    if (trace_) trace_->add(t.name, TraceStream::comm, t0, t1);
    std::lock_guard<std::mutex> lk(mu_);
    busy_s_ += seconds(t1 - t0);
    if (err && !error_) error_ = err;
    ++done_;
    done_cv_.notify_all();
  }
  void loop() {
    for (;;) {
      Task t;
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stop requested and nothing left
        t = std::move(queue_.front());
        queue_.pop_front();
      }
      run(t);
    }
  }

  std::unique_ptr<comm::Comm> comm_;
  Trace* trace_;
  std::thread thread_;
  std::mutex mu_;
  std::condition_variable cv_, done_cv_;
  std::deque<Task> queue_;
  int64_t next_ = 0, done_ = 0;
  bool stop_ = false;
  std::exception_ptr error_;
  double busy_s_ = 0;
};


DataChain DataChain::of(model::GPT& gpt) {
  DataChain d;
  d.blocks = gpt.chain();
  for (model::ChainBlock* b : d.blocks) d.owned.push_back(b->parameters());
  if (gpt.config().tied_embeddings) d.tied = &gpt.embedding().wte();
  d.backend = &gpt.backend();
  d.seed = gpt.seed();
  std::vector<model::Parameter*> in_chain;
  for (const auto& o : d.owned) in_chain.insert(in_chain.end(), o.begin(), o.end());
  LOOM_CHECK(in_chain == gpt.parameters(), "data parallel: the chain's parameters differ from the model's list "
             "(order or number)");
  return d;
}

DataParallel::DataParallel(model::GPT& gpt, comm::Comm& dp, const optim::AdamWConfig& adam,
                           const DataParallelOptions& opt)
    : DataParallel(DataChain::of(gpt), dp, adam, opt) {
  gpt_ = &gpt;
  gpt.set_hooks(this);
  // Every gradient now points into this object's buffers: a device model's own gradient arena
  // is no longer read.
  gpt.release_flat_gradients();
}

bool DataParallel::range_start(int64_t c) const {
  return std::binary_search(chain_.range_starts.begin(), chain_.range_starts.end(), int(c));
}

int64_t DataParallel::range_end(int64_t c) const {
  auto it = std::upper_bound(chain_.range_starts.begin(), chain_.range_starts.end(), int(c));
  return it == chain_.range_starts.end() ? int64_t(chain_.blocks.size()) : int64_t(*it);
}

DataParallel::DataParallel(DataChain chain, comm::Comm& dp, const optim::AdamWConfig& adam,
                           const DataParallelOptions& opt)
    : chain_(std::move(chain)), comm_(dp), o_(opt), rank_(dp.rank()), world_(dp.size()) {
  LOOM_CHECK(o_.zero >= 0 && o_.zero <= 3, "data parallel: ZeRO stage must be 0-3, got {}", o_.zero);
  LOOM_CHECK(o_.bucket_bytes > 0, "data parallel: bucket size must be positive, got {} bytes", o_.bucket_bytes);
  LOOM_CHECK(!o_.offload || o_.host_pool, "data parallel: offload needs a host pool");
  LOOM_CHECK(chain_.backend != nullptr, "data parallel: the chain has no backend");
  LOOM_CHECK(chain_.owned.size() == chain_.blocks.size(), "data parallel: {} blocks but {} parameter lists",
             chain_.blocks.size(), chain_.owned.size());
  LOOM_CHECK(!chain_.range_starts.empty() && chain_.range_starts.front() == 0 &&
                 std::is_sorted(chain_.range_starts.begin(), chain_.range_starts.end()),
             "data parallel: the backward ranges must start at block 0 and ascend");
  Backend& be = *chain_.backend;
  be_ = &be;
  device_ = be.device() != Device::cpu;
  MemoryPool& pool = be.pool();
  const int nchain = int(chain_.blocks.size());
  if (device_) {
    if (adam.galore_rank > 0)
      throw Error(fmt::format("data parallel: GaLore runs on the CPU backend, not on {}", be.name()));
  }

  // Flat layout in chain order; every parameter belongs to exactly one chain block.
  std::vector<model::Parameter*> in_chain;
  std::vector<int> chain_of;
  for (int c = 0; c < nchain; ++c)
    for (model::Parameter* p : chain_.owned[size_t(c)]) in_chain.push_back(p), chain_of.push_back(c);
  lay_ = FlatLayout::build(in_chain, world_, chain_of);
  n_pad_ = lay_.n_pad;
  shard_ = lay_.shard;

  // What each chain block reads and writes: its own parameters, and wte for a tied head.
  uses_.assign(size_t(nchain), {});
  for (size_t i = 0; i < lay_.params.size(); ++i) uses_[size_t(lay_.params[i].chain)].push_back(int(i));
  if (chain_.tied) {
    model::Parameter* wte = chain_.tied;
    for (size_t i = 0; i < lay_.params.size(); ++i)
      if (lay_.params[i].param == wte) uses_[size_t(nchain - 1)].push_back(int(i));
    std::sort(uses_.back().begin(), uses_.back().end());
  }
  // The contiguous flat ranges each block reads (parameters in flat order, each with its
  // alignment gap), and U: the most elements a block's gather holds.
  runs_.assign(size_t(nchain), {});
  for (int c = 0; c < nchain; ++c) {
    auto& r = runs_[size_t(c)];
    for (int i : uses_[size_t(c)]) {
      const FlatParam& f = lay_.params[size_t(i)];
      const int64_t b = f.offset, e = f.offset + round_up(f.alloc, kFlatAlign);
      if (!r.empty() && r.back().second == b) r.back().second = e;
      else r.push_back({b, e});
    }
    int64_t n = 0;
    for (const auto& [b, e] : r) n += e - b;
    max_use_ = std::max(max_use_, n);
  }

  // Buckets: whole chain blocks in backward order, each a contiguous flat range.
  auto block_range = [&](int c) {
    int64_t b = INT64_MAX, e = 0;
    for (const FlatParam& f : lay_.params)
      if (f.chain == c) b = std::min(b, f.offset), e = std::max(e, f.offset + round_up(f.alloc, kFlatAlign));
    return std::pair<int64_t, int64_t>{b, e};
  };
  GradBucket cur;
  bool open = false;
  for (int c = nchain - 1; c >= 0; --c) {
    auto [b, e] = block_range(c);
    if (b < e) {
      if (!open) cur = GradBucket{b, e, {}, c}, open = true;
      cur.begin = b;
      cur.blocks.push_back(c);
      cur.last_writer = c;
      if ((cur.end - cur.begin) * int64_t(sizeof(float)) >= o_.bucket_bytes) buckets_.push_back(cur), open = false;
    }
    if (open && range_start(c)) buckets_.push_back(cur), open = false;  // no bucket spans two ranges
  }
  if (open) buckets_.push_back(cur);
  LOOM_CHECK(!buckets_.empty(), "data parallel: the chain has no parameters");
  buckets_.front().end = n_pad_;  // the tail padding rides with the first bucket (the last block's)
  writes_.assign(size_t(nchain), {});
  for (size_t b = 0; b < buckets_.size(); ++b)
    for (int c = 0; c < nchain; ++c) {
      bool w = false;
      for (int i : uses_[size_t(c)]) {
        int64_t o = lay_.params[size_t(i)].offset;
        w = w || (o >= buckets_[b].begin && o < buckets_[b].end);
      }
      if (w) writes_[size_t(c)].push_back(int(b));
    }
  // A tied head writes wte's gradient first in the backward and the embedding last. Under ZeRO
  // 2/3, where a bucket is reduce-scattered into the shard (which adds), the head's part gets a
  // bucket of its own, reduced right after the head: otherwise the embedding's bucket would be
  // held from the first block of the backward to the last. (Stages 0/1 all-reduce the full
  // gradient in place once, so there the bucket stays shared.)
  if (o_.zero >= 2 && chain_.tied && nchain > 1) {
    const int head = nchain - 1;
    const auto wte = std::find_if(lay_.params.begin(), lay_.params.end(),
                                  [&](const FlatParam& f) { return f.param == chain_.tied; });
    LOOM_CHECK(wte != lay_.params.end(), "data parallel: a tied model without wte in its flat layout");
    auto& hw = writes_[size_t(head)];
    const auto shared = std::find_if(hw.begin(), hw.end(), [&](int b) {
      return wte->offset >= buckets_[size_t(b)].begin && wte->offset < buckets_[size_t(b)].end;
    });
    LOOM_CHECK(shared != hw.end(), "data parallel: the tied head writes no bucket holding wte");
    const std::vector<int>& owners = buckets_[size_t(*shared)].blocks;
    // Unless wte shares a bucket with the head's own parameters (nothing is then held longer).
    if (std::find(owners.begin(), owners.end(), head) == owners.end()) {
      *shared = int(buckets_.size());
      buckets_.push_back(GradBucket{wte->offset, wte->offset + round_up(wte->alloc, kFlatAlign), {head}, head});
    }
  }
  live_.assign(buckets_.size(), {});

  // G: replay the allocation policy of acquire_bucket / launch_bucket over one backward to learn
  // when each bucket holds memory (from its acquisition to the acquisition that frees it), then
  // place the buckets in one arena, largest first, each at the lowest offset no bucket alive with
  // it uses: the buckets reuse the same memory every micro-batch instead of mapping fresh pages,
  // and with a few sizes (blocks, embedding, head) the arena is the most held at once.
  {
    const int nb = int(buckets_.size());
    std::vector<int> state(static_cast<size_t>(nb), 0);  // 0 free, 1 acquired, 2 launched, 3 freed
    std::vector<int64_t> from(size_t(nb), 0), to(size_t(nb), INT64_MAX);
    std::vector<int> launched;
    int64_t t = 0;
    for (int c = nchain - 1; c >= 0; --c) {
      for (int b : writes_[size_t(c)]) {
        if (state[size_t(b)] != 0) continue;
        ++t;
        for (size_t k = 0; k + 1 < launched.size(); ++k)
          if (state[size_t(launched[k])] == 2) state[size_t(launched[k])] = 3, to[size_t(launched[k])] = t;
        from[size_t(b)] = t;
        state[size_t(b)] = 1;
      }
      for (int b = 0; b < nb; ++b)
        if (buckets_[size_t(b)].last_writer == c) state[size_t(b)] = 2, launched.push_back(b);
      if (range_start(c)) {  // the range's backward ends: its buckets are placed as if freed (a
                             // later backward waits for any still reducing where it needs its place)
        ++t;
        for (int b : launched)
          if (state[size_t(b)] == 2) state[size_t(b)] = 3, to[size_t(b)] = t;
        launched.clear();
      }
    }
    auto size_of = [&](int b) { return buckets_[size_t(b)].end - buckets_[size_t(b)].begin; };
    std::vector<int> order(static_cast<size_t>(nb));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int x, int y) { return size_of(x) > size_of(y); });
    bucket_offset_.assign(size_t(nb), 0);
    std::vector<int> placed;
    for (int b : order) {
      std::vector<int> beside;  // placed buckets alive at the same time, by offset
      for (int a : placed)
        if (from[size_t(a)] < to[size_t(b)] && from[size_t(b)] < to[size_t(a)]) beside.push_back(a);
      std::sort(beside.begin(), beside.end(),
                [&](int x, int y) { return bucket_offset_[size_t(x)] < bucket_offset_[size_t(y)]; });
      int64_t at = 0;
      for (int a : beside) {
        if (bucket_offset_[size_t(a)] - at >= size_of(b)) break;
        at = std::max(at, bucket_offset_[size_t(a)] + size_of(a));
      }
      bucket_offset_[size_t(b)] = at;
      placed.push_back(b);
      bucket_peak_ = std::max(bucket_peak_, at + size_of(b));
    }
  }

  // Parameters: the full flat buffer (stages 0-2) or this rank's shard (stage 3), f32; under
  // offload on a device computing in another dtype, in that dtype, the f32 master weights of this
  // rank's optimizer range living in the host pool alone (host_params_).
  const int64_t p0 = o_.zero == 3 ? int64_t(rank_) * shard_ : 0;
  const int64_t plen = o_.zero == 3 ? shard_ : n_pad_;
  const int64_t ob = o_.zero == 0 ? 0 : int64_t(rank_) * shard_, oe = o_.zero == 0 ? n_pad_ : ob + shard_;
  host_master_ = o_.offload && device_ && be.compute_dtype() != DType::f32;
  host_grad_shard_ = host_master_ && o_.zero >= 2;
  params_ = be.empty({plen}, host_master_ ? be.compute_dtype() : DType::f32, MemTag::params);
  be.fill_zero(params_.raw(), int64_t(params_.nbytes()));
  if (o_.offload) {
    host_params_ = Tensor::zeros({oe - ob}, DType::f32, MemTag::params, *o_.host_pool);
    host_grads_ = Tensor::zeros({oe - ob}, DType::f32, MemTag::grads, *o_.host_pool);
  }
  for (const FlatParam& f : lay_.params) {
    int64_t b = std::max(f.offset, p0), e = std::min(f.offset + f.alloc, p0 + plen);
    if (b >= e) continue;
    if (f.param->value_full.defined()) {
      be.copy({.dst = element(params_, b - p0), .dst_dtype = params_.dtype(),
               .src = f.param->value_full.f32() + (b - f.offset), .n = e - b});
      if (host_master_ && std::max(b, ob) < std::min(e, oe))
        be.copy({.dst = host_params_.f32() + (std::max(b, ob) - ob), .dst_host = true,
                 .src = f.param->value_full.f32() + (std::max(b, ob) - f.offset), .n = std::min(e, oe) - std::max(b, ob)});
    } else if (!device_) {  // deferred (declared blocks): drawn here, the part this rank keeps only
      f.param->initialise_part(chain_.seed, b - f.offset, e - b, params_.f32() + (b - p0));
    } else {  // (a device's: drawn on the host)
      std::vector<float> host(size_t(e - b));
      f.param->initialise_part(chain_.seed, b - f.offset, e - b, host.data());
      be.copy({.dst = element(params_, b - p0), .dst_dtype = params_.dtype(), .src = host.data(),
               .src_host = true, .n = e - b});
      if (host_master_ && std::max(b, ob) < std::min(e, oe))
        std::copy(host.begin() + (std::max(b, ob) - b), host.begin() + (std::min(e, oe) - b),
                  host_params_.f32() + (std::max(b, ob) - ob));
    }
  }
  for (FlatParam& f : lay_.params) {
    if (o_.zero == 3 || host_master_) detach_from_flat(*f.param, false);
    else point_at_flat(*f.param, params_, f.offset, f.alloc, false);
    if (o_.zero >= 2) detach_from_flat(*f.param, true);
    // A device computing in another dtype reads compute copies: a declared parameter gets its
    // own here (filled by refresh_compute below); under ZeRO-3 a block's are converted from its
    // gathered weights into a buffer of the two (gather_block), so none is kept whole. With the
    // master weights in the host pool, the flat buffer is the compute copies (stages 0-2).
    if (o_.zero == 3) {
      f.param->compute_full = f.param->compute = Tensor();
    } else if (host_master_) {
      point_compute_at_flat(*f.param, params_, f.offset, f.alloc);
    } else if (device_ && be.compute_dtype() != DType::f32 && !f.param->compute_full.defined()) {
      model::Parameter& q = *f.param;
      Shape full = q.spec.shape;
      if (!full.empty()) full[0] = std::max(q.spec.alloc_rows, full[0]);
      q.compute_full = be.empty(full, be.compute_dtype(), MemTag::params);
      be.fill_zero(q.compute_full.raw(), int64_t(q.compute_full.nbytes()));
      q.compute = full.empty() ? q.compute_full : q.compute_full.slice0(0, q.spec.shape[0]);
    }
  }
  if (o_.zero <= 1) {
    grads_ = flatten_parameters(lay_, /*grad=*/true, MemTag::grads, be);
  } else if (!host_grad_shard_) {
    grads_ = be.empty({shard_}, DType::f32, MemTag::grads);
    be.fill_zero(grads_.raw(), int64_t(grads_.nbytes()));
  }
  if (o_.zero >= 2) {
    // A split backward's input-pass gradients: whole, in a buffer of their own for the step.
    int64_t at = 0;
    for (const model::Parameter* ip : chain_.input_pass) {
      const auto f = std::find_if(lay_.params.begin(), lay_.params.end(),
                                  [&](const FlatParam& x) { return x.param == ip; });
      LOOM_CHECK(f != lay_.params.end(), "data parallel: input-pass parameter '{}' is not in the chain",
                 ip->spec.name);
      input_slots_.push_back({&*f, at});
      at += round_up(f->alloc, kFlatAlign);
      keep_whole_.resize(lay_.params.size(), 0);
      keep_whole_[size_t(f - lay_.params.begin())] = 1;
    }
    if (at > 0) {
      input_grads_ = be.empty({at}, DType::f32, MemTag::grads);
      be.fill_zero(input_grads_.raw(), int64_t(input_grads_.nbytes()));
      for (const auto& [f, off] : input_slots_) point_at_flat(*f->param, input_grads_, off, f->alloc, true);
    }
  }

  // Optimizer over the logical elements of this rank's optimizer range.
  LOOM_CHECK(o_.in_norm.empty() || o_.in_norm.size() == in_chain.size(),
             "data parallel: in_norm has {} entries for {} parameters", o_.in_norm.size(), in_chain.size());
  std::vector<optim::FlatSegment> segs = lay_.segments(o_.in_norm);
  MemoryPool& state_pool = o_.offload ? *o_.host_pool : pool;
  if (o_.offload) host_be_ = make_backend(Device::cpu, {.pool = o_.host_pool});
  Backend& state_be = o_.offload ? *host_be_ : be;
  if (adam.galore_rank > 0) {
    LOOM_CHECK(o_.zero == 0, "data parallel: GaLore needs every matrix whole on its rank (ZeRO stage 0), not stage {}",
               o_.zero);
    for (const FlatParam& f : lay_.params)
      LOOM_CHECK(!f.param->shard.split || !optim::galore_shapes(f.param->spec.name, f.param->spec.shape,
                                                                adam.galore_rank, f.param->spec.row_blocks)
                                                .low_rank,
                 "data parallel: GaLore needs whole matrices, and '{}' is split over tensor-parallel ranks",
                 f.param->spec.name);
    opt_ = std::make_unique<optim::GaLore>(std::move(segs), ob, oe, adam, state_pool, pool);
  } else {
    opt_ = std::make_unique<optim::ShardedAdamW>(std::move(segs), ob, oe, adam, state_be);
  }
  if (o_.offload && !host_master_)
    be.copy({.dst = host_params_.raw(), .dst_host = true, .src = param_shard(), .n = oe - ob});

  // Collective: every rank splits the same way, so the communicators pair up. On a device the
  // buffers' collectives go through device communicators split from the groups.
  buf_ = &comm_;
  comm::Comm* tp = o_.norm_group && o_.norm_group->size() > 1 ? o_.norm_group : nullptr;
  norm_buf_ = tp;
  if (device_ && tp) {
    if (!o_.norm_buffers) own_norm_buf_ = be.buffer_comm(tp->split(0, tp->rank()), false);
    norm_buf_ = o_.norm_buffers ? o_.norm_buffers : own_norm_buf_.get();
    LOOM_CHECK(norm_buf_->device_buffers() && norm_buf_->size() == tp->size(),
               "data parallel: norm_buffers must be a device communicator over the {} ranks of norm_group", tp->size());
  }
  // With the reduced gradients in host memory, their partial sums over tp run on the host groups:
  // norm_group, and for replicated key/value heads a split of it like the model's (ranks with the
  // same rank / size share a head), made in layout order on every tp rank alike.
  if (host_grad_shard_ && tp)
    for (const FlatParam& f : lay_.params)
      if (const comm::Comm* sg = f.param->shard.shared_group; sg && !host_shared_.count(sg->size()))
        host_shared_[sg->size()] = tp->split(tp->rank() / sg->size(), tp->rank());
  // On a device the reductions run on the compute thread, in the model's stream order: every
  // device communicator enqueues on the backend's one stream, where two threads' collectives could
  // land in another order on each rank and NCCL's would wait for each other for ever. (Overlapping
  // them with backward needs a stream of their own ordered by events: not yet.)
  worker_ = std::make_unique<Worker>(device_ ? be.buffer_comm(comm_.split(0, rank_), false) : comm_.split(0, rank_), o_.trace,
                                     o_.overlap && !device_);
  // (The worker then runs on the compute thread: its device communicator serves the step's other
  // collectives on the buffers too.)
  if (device_) buf_ = &worker_->comm();
  if (device_) refresh_compute();
}

void DataParallel::add_into(float* a, const float* b, int64_t n) {
  if (n <= 0) return;
  if (device_) {
    be_->add(DType::f32, a, a, b, n);
    return;
  }
  // (On the CPU a plain loop: this runs on the communication thread too, beside the compute
  // thread's OpenMP team.)
  for (int64_t i = 0; i < n; ++i) a[i] += b[i];
}

void DataParallel::add_reduced(int64_t at, const float* src, int64_t n) {
  if (!host_grad_shard_) {
    add_into(grad_shard() + at, src, n);
    return;
  }
  // Into the host's copy (through the backend's staging).
  if (n > 0) be_->add_to_host(host_grads_.f32() + at, src, n);
}

void DataParallel::copy_f32(float* dst, const float* src, int64_t n) {
  if (n > 0) be_->copy({.dst = dst, .src = src, .n = n});
}

void DataParallel::refresh_compute() {
  if (host_master_) return;  // (the flat buffer is the compute copies)
  for (const FlatParam& f : lay_.params)
    if (f.param->value_full.defined()) f.param->refresh_compute(*be_);
}

DataParallel::~DataParallel() {
  if (gpt_) gpt_->set_hooks(nullptr);
  worker_.reset();  // joins the communication thread after its queued work
}

float* DataParallel::param_shard() const {
  LOOM_CHECK(!host_master_, "data parallel: the master weights are in the host pool");
  if (o_.zero == 3) return params_.f32();
  return params_.f32() + (o_.zero == 0 ? 0 : int64_t(rank_) * shard_);
}

void DataParallel::upload_masters() {
  const int64_t n = opt_->end() - opt_->begin();
  if (!host_master_) {
    be_->copy({.dst = param_shard(), .src = host_params_.raw(), .src_host = true, .n = n});
    return;
  }
  const int64_t at = opt_->begin() - (o_.zero == 3 ? int64_t(rank_) * shard_ : 0);
  be_->copy({.dst = element(params_, at), .dst_dtype = params_.dtype(), .src = host_params_.raw(),
             .src_host = true, .n = n});
}

void DataParallel::gather_updated() {
  buf_->all_gather(element(params_, int64_t(rank_) * shard_), params_.raw(), n_pad_, params_.dtype());
}

float* DataParallel::grad_shard() const {
  if (host_grad_shard_) return host_grads_.f32();
  if (o_.zero >= 2) return grads_.f32();
  return grads_.f32() + (o_.zero == 0 ? 0 : int64_t(rank_) * shard_);
}

std::vector<int64_t> DataParallel::shard_counts(int64_t begin, int64_t end) const {
  return lay_.shard_counts(begin, end);
}

void DataParallel::zero_grad() {
  LOOM_CHECK(std::none_of(live_.begin(), live_.end(), [](const LiveBucket& l) { return l.acquired; }),
             "data parallel: zero_grad during a backward");
  if (host_grad_shard_) std::fill_n(host_grads_.f32(), host_grads_.numel(), 0.0f);
  else be_->fill_zero(grads_.raw(), int64_t(grads_.nbytes()));
  if (input_grads_.defined())
    be_->fill_zero(input_grads_.raw(), int64_t(input_grads_.nbytes())), input_pending_ = true;
  last_micro_ = true;
}

void DataParallel::point_grads(size_t b) {
  const GradBucket& g = buckets_[b];
  for (size_t i = 0; i < lay_.params.size(); ++i) {
    FlatParam& f = lay_.params[i];
    if (f.offset < g.begin || f.offset >= g.end) continue;
    if (!keep_whole_.empty() && keep_whole_[i]) continue;  // whole for the step; the bucket reduces zeros there
    point_at_flat(*f.param, live_[b].buf, f.offset - g.begin, f.alloc, true);
  }
}

void DataParallel::reduce_input_pass() {
  if (!input_pending_) return;
  input_pending_ = false;
  // Summed over the group, then each rank adds the part in its shard to its reduced gradients.
  buf_->all_reduce(input_grads_.f32(), input_grads_.numel(), DType::f32);
  const int64_t gb = int64_t(rank_) * shard_, ge = gb + shard_;
  for (const auto& [f, off] : input_slots_) {
    const int64_t lo = std::max(f->offset, gb), hi = std::min(f->offset + f->numel, ge);
    add_reduced(lo - gb, input_grads_.f32() + off + (lo - f->offset), hi - lo);
  }
}

void DataParallel::acquire_bucket(size_t b) {
  LiveBucket& l = live_[b];
  if (l.acquired) return;
  l.acquired = true;
  if (o_.zero < 2) {
    l.launched = false;
    return;
  }
  // Keep at most the newest launched bucket alive: wait for and free the older ones.
  std::vector<size_t> launched;
  for (int k : acquire_order_)
    if (live_[size_t(k)].launched && !live_[size_t(k)].freed) launched.push_back(size_t(k));
  std::sort(launched.begin(), launched.end(),
            [&](size_t x, size_t y) { return live_[x].ticket < live_[y].ticket; });
  for (size_t k = 0; k + 1 < launched.size(); ++k) free_bucket(launched[k]);
  // The newest, if still reducing (an earlier backward's last bucket: its reduction is waited for
  // only when its place in the arena is needed again, this bucket itself included), where this
  // one goes.
  const GradBucket& g = buckets_[b];
  if (!launched.empty()) {
    const size_t k = launched.back();
    const int64_t lo = bucket_offset_[b], hi = lo + (g.end - g.begin);
    const int64_t klo = bucket_offset_[k], khi = klo + (buckets_[k].end - buckets_[k].begin);
    if (klo < hi && lo < khi) free_bucket(k);
  }
  l.launched = false;
  if (!bucket_arena_.defined())
    bucket_arena_ = be_->empty({std::max<int64_t>(bucket_peak_, 1)}, DType::f32, MemTag::grads);
  l.buf = bucket_arena_.slice0(bucket_offset_[b], g.end - g.begin);
  be_->fill_zero(l.buf.raw(), int64_t(l.buf.nbytes()));
  l.freed = false;
  acquire_order_.erase(std::remove(acquire_order_.begin(), acquire_order_.end(), int(b)), acquire_order_.end());
  acquire_order_.push_back(int(b));
  point_grads(b);
}

void DataParallel::free_bucket(size_t b) {
  LiveBucket& l = live_[b];
  if (l.freed) return;
  if (l.ticket >= 0 && !worker_->done(l.ticket)) {
    auto t0 = Trace::Clock::now();
    worker_->wait(l.ticket);
    auto t1 = Trace::Clock::now();
    stats_.reduce_wait_s += seconds(t1 - t0);
    if (o_.trace) o_.trace->add("wait bucket " + std::to_string(b), TraceStream::wait, t0, t1);
  }
  // Only the gradients that point here: wte's may already point at the embedding's bucket while
  // the tied head's is freed.
  const GradBucket& g = buckets_[b];
  for (FlatParam& f : lay_.params)
    if (f.offset >= g.begin && f.offset < g.end && f.param->grad_full.defined() &&
        f.param->grad_full.f32() == l.buf.f32() + (f.offset - g.begin))
      detach_from_flat(*f.param, true);
  l.buf = Tensor();
  l.freed = true;
}

void DataParallel::launch_bucket(size_t b) {
  LiveBucket& l = live_[b];
  l.launched = true;
  const GradBucket& g = buckets_[b];
  const std::string name = fmt::format("{} bucket {} ({} KiB)", o_.zero >= 1 ? "reduce_scatter" : "all_reduce", b,
                                       (g.end - g.begin) * 4 / 1024);
  if (o_.zero < 2) {
    if (!last_micro_) return;  // accumulate locally until the step's last micro-batch
    float* p = grads_.f32() + g.begin;
    const int64_t n = g.end - g.begin;
    if (o_.zero == 0) {
      l.ticket = worker_->submit(name, [p, n](comm::Comm& c) { c.all_reduce(p, n, DType::f32); });
    } else {  // stage 1: the rank reads its shard's reduced gradients only, reduce-scattered in place
      std::vector<int64_t> counts = shard_counts(g.begin, g.end);
      const int64_t before = count_before(counts, rank_);
      l.ticket = worker_->submit(name, [p, before, counts](comm::Comm& c) {
        c.reduce_scatter_v(p, p + before, counts, DType::f32);
      });
    }
  } else {
    std::vector<int64_t> counts = shard_counts(g.begin, g.end);
    const int64_t before = count_before(counts, rank_);
    float* buf = l.buf.f32();
    const int64_t at = std::max(g.begin, int64_t(rank_) * shard_) - int64_t(rank_) * shard_;  // in the shard
    const int64_t mine = counts[size_t(rank_)];
    l.ticket = worker_->submit(name, [this, buf, at, before, mine, counts](comm::Comm& c) {
      c.reduce_scatter_v(buf, buf + before, counts, DType::f32);
      add_reduced(at, buf + before, mine);
    });
  }
  ++stats_.reductions;
}

void DataParallel::finish_reductions() {
  auto t0 = Trace::Clock::now();
  worker_->wait_all();
  auto t1 = Trace::Clock::now();
  stats_.reduce_wait_s += seconds(t1 - t0);
  if (o_.trace && t1 - t0 > std::chrono::microseconds(1)) o_.trace->add("wait reductions", TraceStream::wait, t0, t1);
  for (size_t b = 0; b < live_.size(); ++b) {
    if (o_.zero >= 2) free_bucket(b);
    live_[b] = LiveBucket{};
  }
  acquire_order_.clear();
  stats_.reduce_busy_s += worker_->busy_s();
  worker_->reset_busy();
  reduce_input_pass();
}

void DataParallel::gather_into(int64_t c, int buf, comm::Comm& comm) {
  // One all-gather per contiguous flat range the block reads (its own parameters are one range;
  // a tied head adds wte's), not one per parameter: a collective's cost here is mostly its
  // latency.
  const int64_t mine = int64_t(rank_) * shard_;
  int64_t at = 0;
  for (const auto& [b, e] : runs_[size_t(c)]) {
    const std::vector<int64_t> counts = shard_counts(b, e);
    const int64_t lo = std::max<int64_t>(std::max(b, mine) - mine, 0);
    if (host_master_)  // (the shards are compute copies already: gathered as they are)
      comm.all_gather_v(element(params_, lo), element(block_cbuf_[buf], at), counts, params_.dtype());
    else
      comm.all_gather_v(params_.f32() + lo, block_buf_[buf].f32() + at, counts, DType::f32);
    at += e - b;
  }
  // The compute copies the ops read (a device computing in another dtype), from the gathered
  // weights.
  if (block_cbuf_[buf].defined() && !host_master_)
    be_->copy({.dst = block_cbuf_[buf].raw(), .dst_dtype = block_cbuf_[buf].dtype(), .src = block_buf_[buf].raw(),
               .n = at});
}

void DataParallel::gather_block(int64_t c, const char* phase, bool backward) {
  int64_t total = 0;
  for (const auto& [b, e] : runs_[size_t(c)]) total += e - b;
  LOOM_CHECK(total <= max_use_, "data parallel: block {} gathers {} elements, more than the {} planned", c, total,
             max_use_);
  // The two buffers of U elements, allocated once (a buffer per block and step would be mapped and
  // unmapped hundreds of times a step).
  const bool compute = device_ && be_->compute_dtype() != DType::f32;
  for (int k = 0; k < (o_.prefetch ? 2 : 1); ++k) {
    if (!host_master_ && !block_buf_[k].defined())
      block_buf_[k] = be_->empty({std::max<int64_t>(max_use_, 1)}, DType::f32, MemTag::params);
    if (compute && !block_cbuf_[k].defined())
      block_cbuf_[k] = be_->empty({std::max<int64_t>(max_use_, 1)}, be_->compute_dtype(), MemTag::params);
  }
  auto t0 = Trace::Clock::now();
  if (prefetch_block_ >= 0) {  // the prefetch in flight: this block's, or one this order skipped
    worker_->wait(prefetch_ticket_);
    held_[prefetch_buf_] = prefetch_block_;
    prefetch_block_ = -1;
  }
  int buf = -1;
  for (int k = 0; k < 2; ++k)
    if (held_[k] == c) buf = k;
  if (buf < 0) {  // not at hand: gathered now, into the buffer the last block did not use
    buf = !o_.prefetch ? 0 : held_[0] == -1 ? 0 : (held_[1] == -1 ? 1 : 1 - cur_buf_);
    held_[buf] = -1;
    gather_into(c, buf, *buf_);
    held_[buf] = c;
  }
  cur_buf_ = buf;
  int64_t at = 0;
  for (const auto& [b, e] : runs_[size_t(c)]) {
    for (int i : uses_[size_t(c)]) {
      FlatParam& f = lay_.params[size_t(i)];
      if (f.offset < b || f.offset >= e) continue;
      if (!host_master_) point_at_flat(*f.param, block_buf_[buf], at + (f.offset - b), f.alloc, false);
      // (the same place in the compute copies' buffer)
      if (compute) point_compute_at_flat(*f.param, block_cbuf_[buf], at + (f.offset - b), f.alloc);
    }
    at += e - b;
  }
  auto t1 = Trace::Clock::now();
  stats_.gather_s += seconds(t1 - t0);
  if (o_.trace) o_.trace->add(fmt::format("all_gather {} {}", phase, chain_.blocks[size_t(c)]->name()),
                              TraceStream::comm, t0, t1);
  // The next block of this direction, into the other buffer, on the communication thread.
  // (Within the block's range: what runs after the range is the caller's schedule.)
  const int64_t next = backward ? c - 1 : c + 1;
  if (o_.prefetch && (backward ? !range_start(c) : next < range_end(c))) {
    const int other = 1 - buf;
    if (held_[other] != next) {
      held_[other] = -1;
      prefetch_block_ = next;
      prefetch_buf_ = other;
      prefetch_ticket_ = worker_->submit(fmt::format("prefetch {}", chain_.blocks[size_t(next)]->name()),
                                         [this, next, other](comm::Comm& wc) { gather_into(next, other, wc); });
    }
  }
}

void DataParallel::release_block(int64_t c) {
  for (int i : uses_[size_t(c)]) {
    model::Parameter& q = *lay_.params[size_t(i)].param;
    detach_from_flat(q, false);
    q.compute_full = q.compute = Tensor();
  }
}

// A block's pass that reads its weights (forward, a backward's input pass): ZeRO-3 gathers them
// before and releases them after; the pass is traced as `what` + the block's name.
void DataParallel::begin_weight_read(int64_t c, bool backward) {
  if (o_.zero == 3) gather_block(c, backward ? "bwd" : "fwd", backward);
  block_t0_ = Trace::Clock::now();
}

void DataParallel::end_weight_read(int64_t c, const char* what) {
  if (o_.trace)
    o_.trace->add(what + chain_.blocks[size_t(c)]->name(), TraceStream::compute, block_t0_, Trace::Clock::now());
  if (o_.zero == 3) release_block(c);
}

void DataParallel::before_forward(int64_t c) { begin_weight_read(c, /*backward=*/false); }
void DataParallel::after_forward(int64_t c) { end_weight_read(c, "fwd "); }

void DataParallel::before_backward(int64_t c) {
  begin_weight_read(c, /*backward=*/true);
  for (int b : writes_[size_t(c)]) acquire_bucket(size_t(b));
  block_t0_ = Trace::Clock::now();
}

void DataParallel::before_input_backward(int64_t c) { begin_weight_read(c, /*backward=*/true); }
void DataParallel::after_input_backward(int64_t c) { end_weight_read(c, "bwd input "); }

void DataParallel::before_weight_backward(int64_t c) {
  // (No weights: the weight gradients come from the saved activations and output gradients.)
  for (int b : writes_[size_t(c)]) acquire_bucket(size_t(b));
  block_t0_ = Trace::Clock::now();
}

void DataParallel::after_backward(int64_t c) {
  if (o_.trace) o_.trace->add("bwd " + chain_.blocks[size_t(c)]->name(), TraceStream::compute, block_t0_,
                              Trace::Clock::now());
  if (o_.zero == 3) release_block(c);
  for (size_t b = 0; b < buckets_.size(); ++b)
    if (buckets_[b].last_writer == c) launch_bucket(b);
  if (range_start(c) && o_.zero >= 2) {
    // The micro-batch's backward is over: its buckets may be acquired by the next one, which
    // waits for a reduction still in flight only where it needs that bucket's place in the arena
    // (acquire_bucket), so a pipeline stage does not wait here for its replicas before it sends
    // its gradient on.
    for (size_t b = 0; b < live_.size(); ++b) live_[b].acquired = false;
  } else if (range_start(c)) {
    for (size_t b = 0; b < live_.size(); ++b)
      if (buckets_[b].last_writer >= c && buckets_[b].last_writer < range_end(c)) live_[b].acquired = false;
  }
}

void DataParallel::add_peer_gradient(const model::Parameter* param, comm::Comm& link, int peer) {
  finish_reductions();
  const auto f = std::find_if(lay_.params.begin(), lay_.params.end(),
                              [&](const FlatParam& x) { return x.param == param; });
  LOOM_CHECK(f != lay_.params.end(), "data parallel: add_peer_gradient: '{}' is not in this layout",
             param ? param->spec.name : "null");
  // The pieces travel in the same order on both sides: [k, k + piece) of the parameter's logical
  // elements, piece the same on both (bucket_bytes and the group size are).
  const int64_t numel = f->numel, piece = std::max<int64_t>(o_.bucket_bytes / 4, 1);
  // The flat range whose reduced gradients this rank holds: its optimizer range (all at stage 0,
  // its shard otherwise), at grad_shard().
  const int64_t gb = opt_->begin(), ge = opt_->end();
  Tensor mine, theirs;
  for (int64_t k = 0; k < numel; k += piece) {
    const int64_t n = std::min(piece, numel - k), b = f->offset + k, e = b + n;
    if (!theirs.defined()) {
      theirs = be_->empty({std::min(piece, numel)}, DType::f32, MemTag::comm);
      if (o_.zero >= 1) mine = be_->empty({std::min(piece, numel)}, DType::f32, MemTag::comm);
    }
    const float* send = nullptr;
    if (o_.zero >= 1) {  // this rank's part of the piece, gathered over the group
      const std::vector<int64_t> counts = shard_counts(b, e);
      const int64_t lo = std::min(std::max(b, gb), ge);
      if (host_grad_shard_) {  // (uploaded from the host into its place in the piece, gathered there)
        const int64_t before = count_before(counts, rank_);
        be_->copy({.dst = mine.f32() + before, .src = grad_shard() + (lo - gb), .src_host = true,
                   .n = counts[size_t(rank_)]});
        buf_->all_gather_v(mine.f32() + before, mine.f32(), counts, DType::f32);
      } else {
        buf_->all_gather_v(grad_shard() + (lo - gb), mine.f32(), counts, DType::f32);
      }
      send = mine.f32();
    } else {
      send = grads_.f32() + b;  // stage 0: every reduced element is here
    }
    link.sendrecv(send, n, peer, theirs.f32(), n, peer, DType::f32, 1);
    const int64_t lo = std::max(b, gb), hi = std::min(e, ge);
    if (hi <= lo) continue;
    add_reduced(lo - gb, theirs.f32() + (lo - b), hi - lo);
  }
}

double DataParallel::sum_over_ranks(double x) { return parallel::sum_over_ranks(comm_, x); }

optim::StepStats DataParallel::step(double lr, bool skip) {
  finish_reductions();
  // The update changes every shard: what the buffers hold is stale (and a prefetch is over).
  if (prefetch_block_ >= 0) worker_->wait(prefetch_ticket_), prefetch_block_ = -1;
  held_[0] = held_[1] = -1;
  const int64_t n = opt_->end() - opt_->begin();
  // The reduced gradients of this rank's range: in the backend's memory, or in the host's.
  float* g = grad_shard();
  if (poison_ && n > 0) {
    const float nan = std::numeric_limits<float>::quiet_NaN();
    if (host_grad_shard_) g[0] = nan;
    else be_->copy({.dst = g, .src = &nan, .src_host = true, .n = 1});
  }
  poison_ = false;
  comm::Comm* tp = o_.norm_group && o_.norm_group->size() > 1 ? o_.norm_group : nullptr;
  if (tp) {  // partial sums within tp (sp's, replicated key/value heads'), on this rank's range
    const int64_t ob = opt_->begin();
    for (const FlatParam& f : lay_.params) {
      const int64_t b = std::max(f.offset, ob), e = std::min(f.offset + f.numel, opt_->end());
      if (b >= e) continue;
      const comm::Comm* sg = f.param->shard.shared_group;
      if (host_grad_shard_)
        f.param->sum_partial_gradients(b - f.offset, e - f.offset, g + (b - ob), tp,
                                       sg ? host_shared_.at(sg->size()).get() : nullptr);
      else
        f.param->sum_partial_gradients(b - f.offset, e - f.offset, g + (b - ob), norm_buf_);
    }
  }
  double others = 0;  // (the replicated copies' squares: only whether they are finite counts)
  double sq = opt_->grad_sum_squares(g, host_grad_shard_ ? host_be_.get() : be_, &others);
  // Stage 0 holds every reduced gradient on every rank; otherwise the shards add up; then the
  // tp ranks' parts.
  if (o_.zero != 0) sq = sum_over_ranks(sq);
  if (tp) sq = parallel::sum_over_ranks(*tp, sq);
  comm::Comm* pp = o_.stage_group && o_.stage_group->size() > 1 ? o_.stage_group : nullptr;
  if (pp) sq = parallel::sum_over_ranks(*pp, sq);
  double norm = std::sqrt(sq);
  // Every rank of the group and of the tp group takes the same decision: at stage 0 each rank
  // computed the norm of its own (equal) reduced gradients. [0]: skip, [1]: a rank's gradients
  // are not finite (its norm, or a replicated copy outside it).
  float bad[2] = {skip ? 1.0f : 0.0f, std::isfinite(norm) && std::isfinite(others) ? 0.0f : 1.0f};
  comm_.all_reduce(bad, 2, DType::f32, comm::ReduceOp::max);
  if (tp) tp->all_reduce(bad, 2, DType::f32, comm::ReduceOp::max);
  if (pp) pp->all_reduce(bad, 2, DType::f32, comm::ReduceOp::max);
  if (bad[0] != 0.0f || bad[1] != 0.0f) {
    optim::StepStats st;
    st.grad_norm = bad[1] == 0.0f ? norm : std::numeric_limits<double>::quiet_NaN();
    st.step = opt_->steps_taken();
    st.skipped = true;
    return st;
  }
  auto t0 = Trace::Clock::now();
  // GaLore's projectors: each from one rank of the group (they all hold the same reduced
  // gradient at stage 0), broadcast to the others.
  if (optim::GaLore* gl = galore(); gl && gl->refresh_due())
    gl->refresh_projectors(g, rank_, world_, [&](Tensor& p, int owner) { comm_.broadcast(p, owner); });
  optim::StepStats st;
  if (o_.offload) {
    if (!host_grad_shard_) be_->copy({.dst = host_grads_.raw(), .dst_host = true, .src = g, .n = n});
    st = opt_->step(host_params_.f32(), host_grads_.f32(), norm, lr);
    upload_masters();
  } else {
    st = opt_->step(param_shard(), g, norm, lr);
  }
  auto t1 = Trace::Clock::now();
  if (o_.trace) o_.trace->add("adamw", TraceStream::optimizer, t0, t1);
  if (o_.zero == 1 || o_.zero == 2) {
    gather_updated();
    auto t2 = Trace::Clock::now();
    stats_.gather_s += seconds(t2 - t1);
    if (o_.trace) o_.trace->add("all_gather params", TraceStream::comm, t1, t2);
  }
  if (device_) refresh_compute();
  return st;
}

int DataParallel::first_nonfinite(bool gradients) const {
  // The flat range this rank holds and where it starts.
  // (With the master weights in the host pool, they are what it looks at: its optimizer range.)
  const bool master = !gradients && host_master_;
  const bool on_host = master || (gradients && host_grad_shard_);
  const float* data = gradients ? grad_shard() : master ? host_params_.f32() : params_.f32();
  const int64_t b = gradients || master ? opt_->begin() : (o_.zero == 3 ? int64_t(rank_) * shard_ : 0);
  const int64_t e = gradients || master ? opt_->end() : b + params_.numel();
  std::vector<float> host;
  if (device_ && !on_host) {  // looked at on the host
    host.resize(size_t(e - b));
    be_->copy({.dst = host.data(), .dst_host = true, .src = data, .n = e - b});
    data = host.data();
  }
  for (size_t i = 0; i < lay_.params.size(); ++i) {
    const FlatParam& f = lay_.params[i];
    const int64_t lo = std::max(f.offset, b), hi = std::min(f.offset + f.numel, e);
    if (lo < hi && loom::first_nonfinite(data + (lo - b), hi - lo) >= 0) return int(i);
  }
  return -1;
}

void DataParallel::poison_parameters() {
  held_[0] = held_[1] = -1;
  if (params_.numel() == 0) return;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  // The first element of what it holds: its working copy on every rank and, under offload, the
  // host's master where the rank holds that element's (stage 3: its shard's first), which the
  // step would otherwise copy back over the NaN.
  if (o_.offload && host_params_.numel() > 0 && (o_.zero == 3 || opt_->begin() == 0)) host_params_.f32()[0] = nan;
  if (host_master_) {
    be_->copy({.dst = params_.raw(), .dst_dtype = params_.dtype(), .src = &nan, .src_host = true, .n = 1});
    return;
  }
  be_->copy({.dst = params_.raw(), .src = &nan, .src_host = true, .n = 1});
  if (device_) refresh_compute();
}

Tensor DataParallel::param_view(const Tensor& flat, size_t i) const {
  const FlatParam& f = lay_.params.at(i);
  return flat.slice0(f.offset, f.numel).view(f.param->spec.shape);
}

DataParallel::FullState DataParallel::gather_full_state() {
  if (o_.zero == 0) {  // every rank holds it all already: the live buffers themselves, no copy
    FullState s;
    s.params = host_master_ ? host_params_ : params_;
    if (adam()) s.exp_avg = adam()->exp_avg(), s.exp_avg_sq = adam()->exp_avg_sq();
    return s;
  }
  FullState s;  // (every element is written below)
  // (Under offload the moments are host memory, gathered into host memory; so are the master
  // weights where they live there.)
  Backend& mb = o_.offload && device_ ? *host_be_ : *be_;
  s.params = (host_master_ ? mb : *be_).empty({n_pad_}, DType::f32, MemTag::workspace);
  s.exp_avg = mb.empty({n_pad_}, DType::f32, MemTag::workspace);
  s.exp_avg_sq = mb.empty({n_pad_}, DType::f32, MemTag::workspace);
  if (host_master_) comm_.all_gather(host_params_.f32(), s.params.f32(), n_pad_, DType::f32);
  else if (o_.zero == 3) buf_->all_gather(params_.f32(), s.params.f32(), n_pad_, DType::f32);
  else copy_f32(s.params.f32(), params_.f32(), n_pad_);
  // (The moments are in the host pool under offload: moved over the host communicator.)
  comm::Comm& mc = o_.offload ? comm_ : *buf_;
  mc.all_gather(adam()->exp_avg().f32(), s.exp_avg.f32(), n_pad_, DType::f32);
  mc.all_gather(adam()->exp_avg_sq().f32(), s.exp_avg_sq.f32(), n_pad_, DType::f32);
  return s;
}

void DataParallel::download_params(float* host) {
  if (host_master_) {  // from the master weights in the host pool: this rank's, or every rank's shard
    if (o_.zero == 0) std::memcpy(host, host_params_.f32(), size_t(n_pad_) * sizeof(float));
    else comm_.all_gather(host_params_.f32(), host, n_pad_, DType::f32);
    return;
  }
  if (o_.zero < 3) {
    be_->copy({.dst = host, .dst_host = true, .src = params_.f32(), .n = n_pad_});
    return;
  }
  const int64_t gb = int64_t(rank_) * shard_, ge = gb + shard_;
  const int64_t piece = std::min(n_pad_, std::max<int64_t>(o_.bucket_bytes, int64_t(64) << 10) / 4);
  Tensor buf = be_->empty({piece}, DType::f32, MemTag::workspace);
  for (int64_t b = 0; b < n_pad_; b += piece) {
    const int64_t e = std::min(n_pad_, b + piece), lo = std::min(std::max(b, gb), ge);
    buf_->all_gather_v(params_.f32() + (lo - gb), buf.f32(), shard_counts(b, e), DType::f32);
    be_->copy({.dst = host + b, .dst_host = true, .src = buf.f32(), .n = e - b});
  }
}

DataParallel::LocalState DataParallel::local_state() {
  LocalState s;
  if (host_master_) {  // the master weights of its optimizer range, in the host pool
    s.params_begin = opt_->begin();
    s.params_end = opt_->end();
    s.params = host_params_.f32();
  } else {
    s.params_begin = o_.zero == 3 ? int64_t(rank_) * shard_ : 0;
    s.params_end = s.params_begin + params_.numel();
    s.params = params_.f32();
  }
  s.opt_begin = opt_->begin();
  s.opt_end = opt_->end();
  if (adam()) s.exp_avg = adam()->exp_avg().f32(), s.exp_avg_sq = adam()->exp_avg_sq().f32();
  s.shard_begin = int64_t(rank_) * shard_;
  s.shard_end = s.shard_begin + shard_;
  return s;
}

DataParallel::LocalState DataParallel::host_state() {
  LocalState s = local_state();
  if (!device_) return s;
  auto stage = [&](std::vector<float>& host, float*& ptr, int64_t n) {
    host.resize(size_t(n));
    be_->copy({.dst = host.data(), .dst_host = true, .src = ptr, .n = n});
    ptr = host.data();
  };
  if (!host_master_) stage(staged_params_, s.params, s.params_end - s.params_begin);
  if (!o_.offload && s.exp_avg) {
    stage(staged_m_, s.exp_avg, s.opt_end - s.opt_begin);
    stage(staged_v_, s.exp_avg_sq, s.opt_end - s.opt_begin);
  }
  return s;
}

void DataParallel::put_host_state() {
  if (!device_) return;
  const LocalState s = local_state();
  auto put = [&](const std::vector<float>& host, float* ptr) {
    if (!host.empty()) be_->copy({.dst = ptr, .src = host.data(), .src_host = true, .n = int64_t(host.size())});
  };
  if (!host_master_) put(staged_params_, s.params);
  if (!o_.offload && s.exp_avg) put(staged_m_, s.exp_avg), put(staged_v_, s.exp_avg_sq);
}

void DataParallel::state_loaded(int64_t optimizer_steps) {
  held_[0] = held_[1] = -1;  // the gathered blocks are of the weights before
  if (host_master_) {  // read into the master weights: their compute copies, then every rank's
    upload_masters();
    if (o_.zero == 1 || o_.zero == 2) gather_updated();
  } else if (o_.offload) {
    be_->copy({.dst = host_params_.raw(), .dst_host = true, .src = param_shard(), .n = opt_->end() - opt_->begin()});
  }
  if (device_) refresh_compute();
  opt_->set_steps_taken(optimizer_steps);
}

}  // namespace loom::parallel
