#include "plan/planner.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <tuple>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "parallel/context/ring_attention.h"
#include "parallel/pipeline/checker.h"
#include "parallel/pipeline/executor.h"

namespace loom::plan {

namespace pipe = parallel::pipeline;

std::string Layout::str() const {
  std::string s = fmt::format("dp={},tp={},pp={}", dp, tp, pp);
  if (v > 1) s += fmt::format(",v={}", v);
  if (cp > 1) s += fmt::format(",cp={}", cp);
  if (sp) s += ",sp=1";
  s += fmt::format(",mbs={}", mbs);
  if (pp > 1) s += fmt::format(",schedule={}", pipe::kind_name(schedule));
  s += fmt::format(",recompute={},zero={}", model::recompute_name(recompute), zero);
  if (offload) s += ",offload=1";
  return s;
}

Layout parse_layout(const std::string& text, const std::string& where) {
  Layout l;
  std::set<std::string> seen;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (item.empty()) continue;
    const size_t eq = item.find('=');
    if (eq == std::string::npos)
      throw Error(fmt::format("{}: '{}' is not key=value (keys: dp, tp, pp, v, cp, sp, mbs, schedule, recompute, zero, offload)",
                              where, item));
    const std::string k = item.substr(0, eq), v = item.substr(eq + 1);
    if (!seen.insert(k).second)
      throw Error(fmt::format("{}: {} is given twice ('{}')", where, k, text));
    auto integer = [&](int64_t lo) -> int64_t {
      size_t used = 0;
      int64_t x = 0;
      try {
        x = std::stoll(v, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      if (used != v.size() || v.empty() || x < lo || x > (int64_t(1) << 30))
        throw Error(fmt::format("{}: {}={} must be an integer in [{}, 2^30]", where, k, v, lo));
      return x;
    };
    if (k == "dp") l.dp = int(integer(1));
    else if (k == "tp") l.tp = int(integer(1));
    else if (k == "pp") l.pp = int(integer(1));
    else if (k == "v") l.v = int(integer(1));
    else if (k == "cp") l.cp = int(integer(1));
    else if (k == "sp") l.sp = integer(0) != 0;
    else if (k == "mbs") l.mbs = integer(1);
    else if (k == "offload") {
      const int64_t o = integer(0);
      if (o > 1) throw Error(fmt::format("{}: offload={} must be 0 or 1", where, o));
      l.offload = o == 1;
    }
    else if (k == "zero") {
      l.zero = int(integer(0));
      if (l.zero > 3) throw Error(fmt::format("{}: zero={} must be 0, 1, 2 or 3", where, l.zero));
    } else if (k == "schedule") l.schedule = pipe::parse_kind(v, where + ": schedule");
    else if (k == "recompute") {
      l.recompute = model::recompute_from_name(v, where + ": recompute");
      if (l.recompute != model::Recompute::none && l.recompute != model::Recompute::selective &&
          l.recompute != model::Recompute::full)
        throw Error(fmt::format("{}: recompute={}: the planner models none, selective and full", where, v));
    } else
      throw Error(fmt::format("{}: unknown key '{}' (keys: dp, tp, pp, v, cp, sp, mbs, schedule, recompute, zero, offload)",
                              where, k));
  }
  // (Every product of the four then fits an int.)
  if (const int64_t n = int64_t(l.dp) * l.tp * l.pp * l.cp; n > (int64_t(1) << 30))
    throw Error(fmt::format("{}: dp x tp x pp x cp = {} x {} x {} x {} = {} devices, more than 2^30", where, l.dp, l.tp,
                            l.pp, l.cp, n));
  return l;
}

std::string_view precision_name(Precision p) {
  switch (p) {
    case Precision::mixed: return "mixed";
    case Precision::f32: return "f32";
    case Precision::device: return "device";
  }
  return "?";
}

Precision parse_precision(const std::string& s, const std::string& where) {
  for (Precision p : {Precision::mixed, Precision::f32, Precision::device})
    if (s == precision_name(p)) return p;
  throw Error(fmt::format("{}: unknown precision '{}' (mixed, f32 or device)", where, s));
}

namespace {

// Bytes per parameter of the weights, gradients and optimizer state, per activation element, and
// of a compute copy of the weights (loom's device runs: a bf16 copy beside the f32 masters).
struct Bytes {
  double weight, grad, optimizer, act, copy;
};

Bytes bytes_of(Precision p) {
  switch (p) {
    case Precision::f32: return {4, 4, 8, 4, 0};
    case Precision::device: return {4, 4, 8, 2, 2};
    case Precision::mixed: break;
  }
  return {2, 2, 12, 2, 0};
}

// The same as a layout holds it: offloaded, a device computing in a 16-bit dtype keeps only the
// compute copy of its weights (its flat buffer, and ZeRO-3's shards and gathers, in that dtype),
// the f32 master weights being the host's alone (parallel::DataParallel).
Bytes held_bytes(Precision p, bool offload) {
  Bytes B = bytes_of(p);
  if (offload && B.copy > 0) B.weight = B.copy, B.copy = 0;
  return B;
}

// Whether a layout's reduced gradients (the shard a rank updates, under ZeRO 2/3) are the host's
// rather than the device's: offloaded on a device computing in a 16-bit dtype (the device keeps
// the buckets' arena alone).
bool grads_on_host(Precision p, bool offload, int zero) { return offload && bytes_of(p).copy > 0 && zero >= 2; }

// Whether memory is counted as loom's pools hold it (its declarations, scratch and buffers).
bool loom_pools(Precision p) { return p != Precision::mixed; }

// Parameters one device holds of each kind of chain block under tensor parallelism (matrices and
// the vocabulary split, norms whole).
struct BlockParams {
  double layer = 0;  // a transformer layer
  double wte = 0;    // the token embedding (and an untied lm_head, or a tied head's copy: as large)
  double emb = 0;    // the embedding block: wte, and wpe when learned
  double norms = 0;  // the final norm (weight, and bias where the model has biases)
  // The head's own parameters: the final norm, and lm_head when untied (a tied head reads wte).
  double head_own(const ModelSpec& m) const { return norms + (m.tied ? 0.0 : wte); }
  // Chain element `el` (0 the embedding, 1 .. layers a layer, then the head) on a pipeline stage,
  // where a tied head holds its own copy of wte.
  double stage_element(const ModelSpec& m, int64_t el) const {
    return el == 0 ? emb : el <= m.layers ? layer : head_own(m) + (m.tied ? wte : 0.0);
  }
};

BlockParams block_params(const ModelSpec& m, int tp) {
  BlockParams b;
  b.norms = double(m.bias ? 2 * m.hidden : m.hidden);
  // The key and value projections (and biases): their heads divided over tp, or one head on each
  // rank where tp exceeds them (replicated).
  const double hd = double(m.head_dim()), kv_rows = double(m.kv()) * hd;
  const double kv_local = std::max(1.0, double(m.kv()) / tp) * hd;
  const double per_row = double(m.hidden) + (m.bias ? 1.0 : 0.0);
  b.layer = (double(m.layer_params()) - 2 * b.norms - 2 * kv_rows * per_row) / tp + 2 * kv_local * per_row + 2 * b.norms;
  b.wte = double(m.vocab) * double(m.hidden) / tp;
  b.emb = b.wte + (m.learned_positions ? double(m.seq) * double(m.hidden) : 0.0);
  return b;
}

// Parameters one device of the larger of the first and last stage holds: the stage's layers,
// plus the embedding on the first stage and the head on the last (a tied head's copy of wte where
// the pipeline has more than one stage).
double stage_params(const ModelSpec& m, const Layout& L, double layers_per_stage) {
  const BlockParams b = block_params(m, L.tp);
  const double head = b.head_own(m) + (m.tied && L.pp > 1 ? b.wte : 0.0);
  if (L.pp == 1) return layers_per_stage * b.layer + b.emb + head;
  return layers_per_stage * b.layer + std::max(b.emb, head);
}

// Saved activation bytes of one layer for one micro-batch on one device.
double layer_activation_bytes(const Job& job, const Layout& L) {
  const ModelSpec& m = job.model;
  const double tokens = double(L.mbs) * double(m.seq) / L.cp, h = double(m.hidden), t = L.tp;
  const double kvd = double(m.kv() * m.head_dim()), ffn = double(m.ffn_size());
  const bool full = L.recompute == model::Recompute::full, selective = L.recompute == model::Recompute::selective;
  if (loom_pools(job.precision)) {
    // loom's declarations (TransformerBlock::saved_activations), `a` bytes an element: the stream
    // side (ln1, res2, ln2, out and f32 row statistics, four for LayerNorm, two for RMSNorm) whole
    // or, under sp, the rank's rows; the rest split by tp, with the f32 log-sum-exps.
    // (The packed qkv holds a key and a value head on each rank where tp exceeds them.)
    const double a = bytes_of(job.precision).act;
    const double kv_local = std::max(1.0, double(m.kv()) / t) * double(m.head_dim());
    const double stream = a * (4 * h) + 4 * (m.bias ? 4 : 2);
    const double split = a * (h + h + 2 * (m.swiglu ? 1.5 : 1.0) * ffn) + 4 * double(m.heads);
    const double attn_kept = a * h + 4 * double(m.heads);  // atty and the log-sum-exps
    if (full) return tokens * a * h / (L.sp ? t : 1.0);
    return tokens * (stream / (L.sp ? t : 1.0) + (split - (selective ? attn_kept : 0.0)) / t + a * 2 * kv_local);
  }
  // Korthikanti et al. 2022 (16-bit): per token 10 h on the stream side, the projections' inputs
  // and outputs split by tp, and the attention scores' 5 a s (kept only without flash attention).
  const double stream = 10 * h;
  const double split = 2 * (h + 2 * kvd) + 2 * h + (m.swiglu ? 6.0 : 4.0) * ffn;
  const double scores = 5.0 * double(m.heads) * double(m.seq);
  if (full) return tokens * 2 * h / (L.sp ? t : 1.0);
  return tokens * (stream / (L.sp ? t : 1.0) + split / t + (selective || job.flash_attention ? 0.0 : scores / t));
}

// A ring all-reduce of `bytes` over n ranks on `link`.
double all_reduce_s(double bytes, int n, const Link& link) {
  if (n <= 1) return 0.0;
  return 2.0 * (n - 1) / n * bytes / link.bandwidth + 2.0 * (n - 1) * link.latency;
}

// loom's engine (f32 on the CPU, bf16 on a device), beyond the model state and the saved
// activations, as its pools hold it:
//   workspace: the backward scratch GPT::workspace_bytes declares (dres and bufC [N, h], buf4C [N,
//     wide]; under sp the gathered rows and partial sums, all in the compute dtype; under tp the
//     vocabulary-parallel loss's f32 row statistics, under cp the rows' positions; the attention
//     kernel's own scratch, a few hundred KiB on the CPU, is left out);
//   ZeRO-3: two f32 gather buffers of U elements, U the block with the most parameters (the
//     embedding, a layer, or a tied head's wte), and on a device a bf16 compute copy beside each;
//   ZeRO-2/3: the gradient buckets' arena G: the chain's blocks in backward order cut into buckets
//     of at least bucket_bytes, a tied head's wte part a bucket of its own where it does not share
//     the head's; at most two alive at once (DataParallel keeps the newest launched one), so G is
//     the largest sum of two buckets acquired one after the other (one bucket: its size);
//   a pipeline with tied embeddings: the first and last stages exchange wte's reduced gradient in
//     pieces of at most a bucket (tag comm; under ZeRO 1-3 each piece is first gathered over the
//     stage's group into a second buffer); context parallelism: ring attention's two key/value blocks and
//     two gradient blocks of the rank's rows (tag comm; the key/value blocks in the compute dtype,
//     the gradient blocks in f32: RingAttention::buffer_bytes).
struct LoomExtras {
  double workspace = 0, gather = 0, buckets = 0, comm = 0, exchange = 0;
};

constexpr double kBucketBytes = 25.0 * 1024 * 1024;  // parallel.bucket_mb's default

// G in elements for one range of blocks a backward runs over (sizes in backward order): buckets of
// at least kBucketBytes, a tied head's wte (wte > 0) a bucket of its own where it does not share
// the head's; the largest bucket or sum of two acquired one after the other.
double bucket_arena(const std::vector<double>& blocks, double wte) {
  std::vector<double> buckets;
  double cur = 0;
  bool open = false, head_shares_wte = false;
  for (size_t b = 0; b < blocks.size(); ++b) {
    cur += blocks[b], open = true;
    if (b + 1 == blocks.size() && buckets.empty()) head_shares_wte = true;  // one bucket holds all
    if (cur * 4 >= kBucketBytes) buckets.push_back(cur), cur = 0, open = false;
  }
  if (open) buckets.push_back(cur);
  if (buckets.empty()) return 0;
  if (wte > 0 && !head_shares_wte) buckets.insert(buckets.begin() + 1, wte);
  double g = buckets.front();
  for (size_t b = 0; b + 1 < buckets.size(); ++b) g = std::max(g, buckets[b] + buckets[b + 1]);
  return g;
}

LoomExtras loom_extras(const Job& job, const Layout& L) {
  const ModelSpec& m = job.model;
  const Bytes B = held_bytes(job.precision, L.offload);
  const double a = B.act;
  LoomExtras x;
  const double h = double(m.hidden), tp = L.tp;
  const double N = double(L.mbs) * double(m.seq) / L.cp, Ns = L.sp ? N / tp : N;
  const double q_local = double(m.heads) / tp * double(m.head_dim());
  const double kv_local = std::max(1.0, double(m.kv()) / tp) * double(m.head_dim());
  const double ffn = double(m.ffn_size());
  const double wide = std::max(q_local + 2 * kv_local, (m.swiglu ? 2 * ffn : ffn) / tp + (m.swiglu ? ffn / tp : 0.0));
  x.workspace = a * (Ns * h + N * h + N * wide);
  if (L.sp) x.workspace += a * (2 * N * h + Ns * h);
  if (L.tp > 1) x.workspace += 4 * 3 * N;
  // Under cp the rows' positions and ring attention's buffers: its packed chunks and partial
  // results (workspace), its key/value blocks and their gradients (comm).
  parallel::cp::RingAttention::Buffers ring;
  if (L.cp > 1) {
    ring = parallel::cp::RingAttention::buffer_bytes(
        {L.mbs, m.seq, m.heads / L.tp, m.head_dim(), std::max<int64_t>(1, m.kv() / L.tp)}, L.cp,
        job.precision == Precision::device ? DType::bf16 : DType::f32);
    x.workspace += 4 * double(m.seq) / L.cp + double(ring.workspace);
  }
  const BlockParams bp = block_params(m, L.tp);
  const double layer = bp.layer, wte = bp.wte, emb = bp.emb, head_own = bp.head_own(m);
  const int shard = L.dp * L.cp;
  if (L.zero >= 3 && shard > 1) x.gather = 2 * (B.weight + B.copy) * std::max({emb, layer, head_own + (m.tied ? wte : 0.0)});
  if (L.zero >= 2 && shard > 1) {
    std::vector<double> blocks{head_own};
    for (int64_t l = 0; l < m.layers; ++l) blocks.push_back(layer);
    blocks.push_back(emb);
    x.buckets = 4 * bucket_arena(blocks, m.tied ? wte : 0.0);
  }
  // A pipeline's tied wte: its reduced gradient goes between the first and last stages in pieces
  // of at most a bucket, received into one buffer (and under ZeRO 1-3 gathered into another).
  if (L.pp > 1 && m.tied) x.exchange = 4 * std::min(wte, kBucketBytes / 4) * (L.zero >= 1 && shard > 1 ? 2 : 1);
  x.comm = x.exchange;
  x.comm += double(ring.comm);
  return x;
}

// (Under offload the optimizer state is in host memory: `offloaded` gets the most any rank keeps
// there, the stage with the most parameters, which need not be the rank fullest on its device.)
// With the schedule's lists (`sch`), each rank's activations at their peak are the largest sum over
// its list of the chunks it holds (a chunk's from its forward to its backward, or to its weight
// pass under zero bubble), each chunk at its own size; without, the in-flight count times the
// rank's average chunk.
std::map<std::string, double> pipeline_rank_memory(const Job& job, const Layout& L, const std::vector<int>& rank_in_flight,
                                                   double in_flight, const LoomExtras& x, double& offloaded,
                                                   const pipe::Schedule* sch) {
  const ModelSpec& m = job.model;
  offloaded = 0;
  const int parts = L.pp * L.v;
  const std::vector<int64_t> cuts = pipe::balance_chain(pipe::chain_costs(to_gpt(m), m.seq), parts);
  const double h = double(m.hidden), tp = L.tp;
  const double tokens = double(L.mbs) * double(m.seq) / L.cp, rows = L.sp ? tokens / tp : tokens;
  const BlockParams bp = block_params(m, L.tp);
  const double per_layer = layer_activation_bytes(job, L);
  Layout whole = L;
  whole.recompute = model::Recompute::none;
  const double recompute_extra = L.recompute == model::Recompute::full ? layer_activation_bytes(job, whole) : 0.0;
  const Bytes B = held_bytes(job.precision, L.offload);
  const double a = B.act;  // the compute dtype's bytes
  std::map<std::string, double> best;
  double best_total = -1;
  const int shard = L.dp * L.cp;
  // Zero bubble's split backward: a micro-batch between its input-gradient and weight passes keeps
  // its recomputed blocks' whole activations (recomputed in the first pass for the second) and the
  // output gradients of its linear layers (tag workspace: [N, h] twice, [N, ffn rows], [N, qkv] per
  // block, the first stage's embedding [N, h]).
  const bool zb = L.schedule == pipe::Kind::zb_h1;
  const double qkv_local = (double(m.heads) / tp + 2.0 * std::max(1.0, double(m.kv()) / tp)) * double(m.head_dim());
  const double fc_local = (m.swiglu ? 2.0 : 1.0) * double(m.ffn_size()) / tp;
  const double deferred_per_layer = a * tokens * (2 * h + fc_local + qkv_local);
  for (int r = 0; r < L.pp; ++r) {
    double params = 0, act_per_mb = 0, grad_in = 0, largest = 0, arena = 0, layers_here = 0;
    std::vector<double> chunk_act(size_t(L.v), 0.0), chunk_grad(size_t(L.v), 0.0);  // one micro-batch's
    bool first = false, last = false;
    for (int k = 0; k < L.v; ++k) {
      const int c = r + k * L.pp;
      const int64_t e0 = cuts[size_t(c)], e1 = cuts[size_t(c + 1)];
      double& act = chunk_act[size_t(k)];
      if (e0 > 0) act += a * rows * h;  // the received input
      if (c + 1 < parts) chunk_grad[size_t(k)] = a * rows * h;
      std::vector<double> backward_order;
      for (int64_t e = e1 - 1; e >= e0; --e) {
        const double n = bp.stage_element(m, e);
        params += n, largest = std::max(largest, n), backward_order.push_back(n);
        if (e == 0) act += a * tokens * h, first = true;
        else if (e <= m.layers) act += per_layer, layers_here += 1;
        else act += a * tokens * double(m.vocab) / tp, last = true;  // the logits
      }
      act_per_mb += act, grad_in += chunk_grad[size_t(k)];
      // Each chunk's backward waits for its buckets at its end: the arena is the fullest chunk's.
      arena = std::max(arena, bucket_arena(backward_order, 0.0));
    }
    const double held = rank_in_flight.size() == size_t(L.pp) ? double(rank_in_flight[size_t(r)]) : in_flight * L.v;
    // Under zero bubble each micro-batch past its input-gradient pass and before its weight pass
    // keeps its linear layers' output gradients (workspace) and, under full recomputation, its
    // blocks' recomputed activations: rank r's last r + 1 at most (ZB-H1 delays its weight passes
    // by r micro-batches).
    const double deferred_act =
        zb && L.recompute == model::Recompute::full ? layers_here * layer_activation_bytes(job, whole) : 0.0;
    const double deferred_ws = zb ? layers_here * deferred_per_layer + (first ? a * rows * h : 0.0) : 0.0;
    // The activations, received gradients and deferred passes the rank holds at its fullest.
    double held_act = held / L.v * act_per_mb, held_grad = held / L.v * grad_in;
    double held_deferred = zb ? std::min(held, double(r + 1)) : 0.0;
    if (sch && sch->p() == L.pp && sch->v() == L.v) {
      double cur_act = 0, cur_grad = 0, cur_deferred = 0, peak = -1;
      for (const pipe::Instr& in : sch->ranks[size_t(r)]) {
        const bool ends = in.op == pipe::Op::backward || in.op == pipe::Op::backward_weight;
        if (in.op == pipe::Op::backward_input) cur_deferred += 1;
        else if (in.op != pipe::Op::forward && !ends) continue;
        if (in.op == pipe::Op::backward_weight) cur_deferred -= 1;
        if (in.op != pipe::Op::backward_input) {
          const double sign = in.op == pipe::Op::forward ? 1.0 : -1.0;
          cur_act += sign * chunk_act[size_t(in.chunk)], cur_grad += sign * chunk_grad[size_t(in.chunk)];
        }
        const double total = cur_act + cur_grad + cur_deferred * (deferred_act + deferred_ws);
        if (total > peak) peak = total, held_act = cur_act, held_grad = cur_grad, held_deferred = cur_deferred;
      }
    }
    std::map<std::string, double> t;
    // The stage's data parallelism (parallel::DataParallel over its blocks, the wte copy the
    // head's): ZeRO-3 keeps its shard and two gather buffers of the largest block (on a device each
    // with its compute copy), ZeRO 2/3 the gradients' shard and its bucket arena; below ZeRO-3 a
    // device keeps a compute copy of the stage's weights.
    const bool split = shard > 1;
    t["params"] = L.zero >= 3 && split ? params * B.weight / shard + 2 * (B.weight + B.copy) * largest
                                       : params * (B.weight + B.copy);
    // (Under zero bubble the norms' gradients, which its input pass writes, stay whole for the step.)
    const double whole_norms = zb ? 2 * layers_here * bp.norms + (last ? bp.norms : 0.0) : 0.0;
    t["grads"] = L.zero >= 2 && split
                     ? (grads_on_host(job.precision, L.offload, L.zero) ? 0.0 : params * B.grad / shard) + 4 * arena +
                           4 * whole_norms
                     : params * B.grad;
    t["optimizer"] = params * B.optimizer / (L.zero >= 1 ? shard : 1);
    if (L.offload) offloaded = std::max(offloaded, t["optimizer"]), t["optimizer"] = 0;
    t["activations"] = held_act + (zb ? held_deferred * deferred_act : recompute_extra);
    t["workspace"] = x.workspace + held_deferred * deferred_ws;
    // The wte gradient exchange runs after the flush, when the activations and the received
    // gradients are gone: it adds to the peak only what it exceeds them by.
    const double exchange = (first || last) ? x.exchange : 0.0;
    t["comm"] = std::max(held_grad, exchange - t["activations"]);
    double total = 0;
    for (const auto& [tag, b] : t) total += b;
    if (total > best_total) best_total = total, best = t;
  }
  return best;
}

// Values measured at points of (tokens, width).
template <size_t N>
struct GridPoint {
  double tokens = 0, width = 0;
  std::array<double, N> value{};
};

// The values at (tokens, width) from a grid of points: bilinear in log tokens, log width and log
// value, clamped to the grid's edges; nothing from an empty or incomplete grid.
template <size_t N>
std::optional<std::array<double, N>> interpolate(const std::vector<GridPoint<N>>& grid, double tokens, double width) {
  if (grid.empty()) return std::nullopt;
  std::vector<double> ms, cs;
  for (const GridPoint<N>& r : grid) ms.push_back(r.tokens), cs.push_back(r.width);
  for (auto* v : {&ms, &cs}) {
    std::sort(v->begin(), v->end());
    v->erase(std::unique(v->begin(), v->end()), v->end());
  }
  // The bracketing grid values of x in v and x's weight on the upper one (log scale).
  auto bracket = [](const std::vector<double>& v, double x) {
    x = std::clamp(x, v.front(), v.back());
    size_t i = 0;
    while (i + 2 < v.size() && x > v[i + 1]) ++i;
    const size_t j = std::min(i + 1, v.size() - 1);
    const double w = j == i ? 0.0 : std::log(x / v[i]) / std::log(v[j] / v[i]);
    return std::tuple{v[i], v[j], w};
  };
  const auto [m0, m1, wm] = bracket(ms, tokens);
  const auto [c0, c1, wc] = bracket(cs, width);
  auto at = [&](double m, double c) -> const GridPoint<N>* {
    for (const GridPoint<N>& r : grid)
      if (r.tokens == m && r.width == c) return &r;
    return nullptr;
  };
  std::array<double, N> sum{};
  double wsum = 0;
  for (auto [m, c, w] : {std::tuple{m0, c0, (1 - wm) * (1 - wc)}, std::tuple{m1, c0, wm * (1 - wc)},
                         std::tuple{m0, c1, (1 - wm) * wc}, std::tuple{m1, c1, wm * wc}}) {
    const GridPoint<N>* r = at(m, c);
    if (!r || w <= 0) continue;
    for (size_t k = 0; k < N; ++k) sum[k] += w * std::log(r->value[k]);
    wsum += w;
  }
  if (wsum <= 0) return std::nullopt;  // an incomplete grid
  for (double& x : sum) x = std::exp(x / wsum);
  return sum;
}

// The forward and backward FLOP/s of a layer's linears at (tokens, width) from a measured grid
// (Device::linear); zeros without one.
std::pair<double, double> linear_rates(const std::vector<LinearRate>& grid, double tokens, double width) {
  std::vector<GridPoint<2>> g;
  for (const LinearRate& r : grid) g.push_back({r.tokens, r.width, {r.forward, r.backward}});
  const auto v = interpolate(g, tokens, width);
  return v ? std::pair{(*v)[0], (*v)[1]} : std::pair{0.0, 0.0};
}

// The chain's boundaries for `parts` pipeline chunks as the executor cuts it
// (pipeline::balance_chain over pipeline::chain_costs; one part: the whole chain). Memoised: a
// search asks for the same few cuts many times.
std::vector<int64_t> chain_cuts(const ModelSpec& m, int parts) {
  const std::vector<double> costs = pipe::chain_costs(to_gpt(m), m.seq);
  if (parts <= 1) return {0, int64_t(costs.size())};
  static std::mutex mu;
  static std::map<std::pair<std::vector<double>, int>, std::vector<int64_t>> memo;
  std::lock_guard lk(mu);
  auto [it, fresh] = memo.try_emplace({costs, parts});
  if (fresh) it->second = pipe::balance_chain(costs, parts);
  return it->second;
}

std::string invalid(const Job& job, const Layout& L) {
  const ModelSpec& m = job.model;
  if (L.devices() != job.devices)
    return fmt::format("dp x tp x pp x cp = {} is not the {} devices", L.devices(), job.devices);
  if (m.heads % L.tp != 0) return fmt::format("{} heads are not divisible by tp = {}", m.heads, L.tp);
  if (m.kv() % L.tp != 0 && L.tp % m.kv() != 0)
    return fmt::format("{} key/value heads neither divide nor are divided by tp = {}", m.kv(), L.tp);
  if (L.sp && L.tp == 1) return "sp needs tp > 1";
  if (m.seq % (2 * L.cp) != 0 && L.cp > 1) return fmt::format("seq {} is not divisible by 2 x cp = {}", m.seq, 2 * L.cp);
  if (job.global_batch % (int64_t(L.dp) * L.mbs) != 0)
    return fmt::format("global batch {} is not divisible by dp x mbs = {}", job.global_batch, int64_t(L.dp) * L.mbs);
  if (L.pp == 1 && L.v > 1) return "v > 1 needs a pipeline";
  if (L.pp > 1 && (L.v > 1) != (L.schedule == pipe::Kind::interleaved))
    return "the interleaved schedule, and only it, has v > 1";
  if (m.layers % (int64_t(L.pp) * L.v) != 0)
    return fmt::format("{} layers do not split evenly into pp x v = {} chunks", m.layers, L.pp * L.v);
  const int64_t micro = job.global_batch / (int64_t(L.dp) * L.mbs);
  if (L.pp > 1 && L.schedule == pipe::Kind::interleaved && micro % L.pp != 0)
    return fmt::format("interleaving needs the {} micro-batches divisible by pp = {}", micro, L.pp);
  return "";
}

}  // namespace

ModelState model_state(double params, Precision precision, int zero, int shards, bool offload) {
  const Bytes B = held_bytes(precision, offload);
  // (A device's compute copy is of the whole weights below ZeRO-3, of the gathered blocks at it.)
  const double weights = zero >= 3 && shards > 1 ? params * B.weight / shards : params * (B.weight + B.copy);
  // (Offloaded under ZeRO 2/3 on a device the reduced gradients' shard is the host's.)
  const bool host_grads = shards > 1 && grads_on_host(precision, offload, zero);
  const double grads = host_grads ? 0.0 : params * B.grad / (zero >= 2 ? shards : 1);
  return {weights, grads, params * B.optimizer / (zero >= 1 ? shards : 1)};
}

// A layer's forward and backward compute (seconds, one micro-batch of `tokens` tokens on one
// device), its attention core's forward (what selective recomputation repeats), the head's and the
// embedding's, kernel by kernel: `dev` has the rank's share of the device's rates, `share` what a
// rank's costs measured on the whole device are multiplied by.
struct ComputeCosts {
  double layer_f = 0, layer_b = 0, attn_core_f = 0, head_f = 0, head_b = 0, emb_f = 0, emb_b = 0;
  bool measured = false;  // loom's kernels as calibrated (else the GEMM rate and memory bandwidth)
};

ComputeCosts compute_costs(const Job& job, const ModelSpec& m, const Layout& L, const Device& dev, double share,
                           double tokens) {
  const Bytes B = bytes_of(job.precision);
  // The layer's products have tokens rows and about h / tp columns on a device.
  const double gemm_out = tokens * double(m.hidden) / L.tp;
  const double rate = (job.precision == Precision::f32 ? dev.peak_f32 : dev.peak_bf16) * dev.efficiency *
                      (dev.gemm_half > 0 ? gemm_out / (gemm_out + dev.gemm_half) : 1.0);
  // Element-wise traffic per token of a layer's forward, in elements: on the stream side about 15 h
  // (two norms, two residual adds, two dropouts; whole on every tp rank unless sp), the
  // activation function over the feed-forward width, and without flash attention 4.5 a s over the
  // scores (softmax, mask, dropout); backward moves twice as much.
  const double stream_elems = 15.0 * double(m.hidden) / (L.sp ? L.tp : 1);
  const double split_elems = (m.swiglu ? 3.0 : 2.0) * double(m.ffn_size()) / L.tp;
  const double score_elems = job.flash_attention ? 0.0 : 4.5 * double(m.heads) * double(m.seq) / L.tp;
  const double elem_f = tokens * (stream_elems + split_elems + score_elems) * B.act / dev.memory_bw;
  const double score_f = tokens * score_elems * B.act / dev.memory_bw;
  ComputeCosts c;
  // (attention's own FLOPs, forward, per layer)
  const double attn_flops = tokens * 4.0 * double(m.seq) * double(m.hidden) / L.tp;
  const double gemm_layer = (tokens * m.layer_forward_flops_per_token() / L.tp - attn_flops) / rate;
  const double gemm_head = tokens * m.head_forward_flops_per_token() / L.tp / rate;
  const auto& kernels = dev.kernels;
  c.measured = job.precision == Precision::f32 &&
               std::all_of(kKernelNames.begin(), kKernelNames.end(), [&](const char* n) { return kernels.count(n); });
  // A measured kernel's seconds for `units` of work in `calls` calls, on the rank's share of the host.
  auto k = [&](const char* name, double units, double calls = 1) {
    return kernels.at(name).seconds(units * share, calls);
  };
  if (c.measured) {
    // loom's CPU kernels as `loom calibrate` timed them (per call + per unit, the unit cost scaled
    // to the rank's share of the host): per layer two norms and two residual adds over the stream
    // (the rank's rows under sp), the activation over the feed-forward width (SwiGLU's gate costed
    // as 1.5 activations), attention; backward the same kernels'
    // backward; the head's norm and fused cross-entropy over the rank's vocabulary part; the
    // embedding a gather and an add.
    const double Ns = L.sp ? tokens / L.tp : tokens, h = double(m.hidden);
    // The layer's products at the rates loom's linears reach at its tokens and (per device) width.
    const auto [rate_f, rate_b] = linear_rates(dev.linear, tokens, h / L.tp);
    const double layer_flops = tokens * m.layer_forward_flops_per_token() / L.tp - attn_flops;
    const double gemm_f = rate_f > 0 ? layer_flops * share / rate_f : gemm_layer;
    const double gemm_b = rate_b > 0 ? 2 * layer_flops * share / rate_b : 2 * gemm_layer;
    const double act = tokens * double(m.ffn_size()) / L.tp * (m.swiglu ? 1.5 : 1.0);
    // Attention: one call per micro-batch (per ring step under cp).
    const double attn_calls = L.cp;
    c.attn_core_f = k("attention_forward", attn_flops, attn_calls);
    c.layer_f = gemm_f + c.attn_core_f + k("norm_forward", 2 * Ns * h, 2) + k("residual", 2 * Ns * h, 2) +
                k("gelu_forward", act);
    c.layer_b = gemm_b + k("attention_backward", attn_flops, attn_calls) + k("norm_backward", 2 * Ns * h, 2) +
                k("residual", 2 * Ns * h, 2) + k("gelu_backward", act);
    c.head_f = gemm_head + k("norm_forward", Ns * h) + k("crossentropy", tokens * double(m.vocab) / L.tp);
    c.head_b = 2 * gemm_head + k("norm_backward", Ns * h);
    c.emb_f = c.emb_b = k("residual", tokens * h);
  } else {
    c.layer_f = gemm_layer + attn_flops / rate + elem_f;
    c.layer_b = 2 * c.layer_f;
    c.attn_core_f = attn_flops / rate + score_f;
    c.head_f = gemm_head;
    c.head_b = 2 * gemm_head;
    c.emb_f = c.emb_b = tokens * 3.0 * double(m.hidden) * B.act / dev.memory_bw;
  }
  return c;
}

// What loom's own blocks take (Device::blocks, `loom calibrate`) over what compute_costs gives for
// the same blocks: factors for a layer's forward and backward and the head's, 1 where nothing was
// measured. The measured seconds are interpolated at (tokens, width) (log-bilinear, clamped to the
// calibrated points) for `ranks` ranks on the host (the nearest calibrated count not above it), and
// divided by compute_costs of the calibrated block (a GPT layer, heads of 64, and its head) at
// the same clamped point and a 1 / ranks share of the host: the layout's own blocks then cost
// compute_costs times these factors, which is what the calibrated blocks measured wherever the
// layout's are the same.
std::array<double, 4> block_factors(const Job& job, int ranks, double tokens, double width) {
  const std::vector<BlockTime>& blocks = job.cluster.device.blocks;
  int chosen = 0;
  for (const BlockTime& b : blocks)
    if (b.ranks <= ranks && b.ranks > chosen) chosen = b.ranks;
  if (chosen == 0)
    for (const BlockTime& b : blocks)
      if (chosen == 0 || b.ranks < chosen) chosen = b.ranks;
  // The calibrated points: a full grid of tokens x widths (an incomplete one is not used, as
  // seconds interpolated over the corners present would belong to other tokens than the model's).
  std::vector<GridPoint<4>> grid;
  std::vector<double> ts, ws;
  double seq = 0, vocab = 0;
  for (const BlockTime& b : blocks) {
    if (b.ranks != chosen) continue;
    grid.push_back({b.tokens, b.width, {b.layer_forward, b.layer_backward, b.head_forward, b.head_backward}});
    ts.push_back(b.tokens), ws.push_back(b.width);
    seq = b.seq, vocab = b.vocab;
  }
  for (auto* v : {&ts, &ws}) {
    std::sort(v->begin(), v->end());
    v->erase(std::unique(v->begin(), v->end()), v->end());
  }
  if (grid.empty() || grid.size() != ts.size() * ws.size()) return {1, 1, 1, 1};
  tokens = std::clamp(tokens, ts.front(), ts.back()), width = std::clamp(width, ws.front(), ws.back());
  const auto measured = interpolate(grid, tokens, width);
  if (!measured) return {1, 1, 1, 1};
  ModelSpec pm;
  pm.layers = 2;
  pm.hidden = std::max<int64_t>(1, std::llround(width));
  pm.heads = std::max<int64_t>(1, pm.hidden / 64);
  pm.vocab = int64_t(vocab);
  pm.seq = int64_t(seq);
  Device pd = job.cluster.device;
  const double share = double(chosen);
  pd.peak_f32 /= share, pd.peak_bf16 /= share, pd.memory_bw /= share;
  const ComputeCosts c = compute_costs(job, pm, Layout{}, pd, share, tokens);
  if (!c.measured) return {1, 1, 1, 1};
  const std::array<double, 4>& t = *measured;
  return {t[0] / c.layer_f, t[1] / c.layer_b, t[2] / c.head_f, t[3] / c.head_b};
}

Estimate estimate(const Job& job, const Layout& L, bool simulate) {
  Estimate e;
  e.layout = L;
  e.why_not = invalid(job, L);
  if (!e.why_not.empty()) {
    e.valid = false;
    return e;
  }
  const ModelSpec& m = job.model;
  // On a shared host (the cpu cluster) the ranks divide its cores: up to `capacity` ranks compute
  // at once, each at its share of the host's rates; with more ranks than that, the ranks that
  // compute at the same moment divide the host among them (`crowd`: the slowdown when all do).
  // `share`: what a rank's costs measured on the whole host are multiplied by (1 on a device of
  // its own).
  Device dev = job.cluster.device;
  double capacity = 0, crowd = 1, share = 1;
  if (job.cluster.shared_host) {
    const int cores = job.cluster.cores > 0 ? job.cluster.cores : job.cluster.per_node;
    capacity = share = double(std::min({job.devices, job.cluster.per_node, cores}));
    crowd = double(job.devices) / capacity;
    dev.peak_f32 /= share, dev.peak_bf16 /= share, dev.memory_bw /= share;
  }
  const Bytes B = held_bytes(job.precision, L.offload);
  const int64_t micro = job.global_batch / (int64_t(L.dp) * L.mbs);
  e.micro_batches = micro;
  const double lps = double(m.layers) / L.pp;  // layers per stage
  const int shard = L.dp * L.cp;               // ZeRO shards over the data-parallel group (x cp)

  // Memory.
  const double P = stage_params(m, L, lps);
  const ModelState state = model_state(P, job.precision, L.zero, shard, L.offload);
  e.memory["params"] = state.params;
  e.memory["grads"] = state.grads;
  e.memory["optimizer"] = state.optimizer;
  double offloaded = L.offload ? state.optimizer : 0.0;  // the optimizer state in host memory

  // Pipeline: per-chunk durations, then the schedule's makespan and in-flight chunks.
  const double tokens = double(L.mbs) * double(m.seq) / L.cp;
  const ComputeCosts cc = compute_costs(job, m, L, dev, share, tokens);
  const bool measured = cc.measured;
  // loom's blocks as they ran beside one another (Device::blocks) against the kernels' sum.
  // (With more ranks than cores: the blocks as measured with as many ranks as cores; the schedule's
  // simulation divides the cores among the ranks computing at once.)
  const std::array<double, 4> factor =
      measured ? block_factors(job, capacity > 0 ? int(capacity) : 1, tokens, double(m.hidden) / L.tp)
               : std::array<double, 4>{1, 1, 1, 1};
  const double layer_f = cc.layer_f * factor[0], layer_b = cc.layer_b * factor[1],
               attn_core_f = cc.attn_core_f * factor[0], head_f = cc.head_f * factor[2], head_b = cc.head_b * factor[3],
               emb_f = cc.emb_f, emb_b = cc.emb_b;
  double recompute_f = 0;  // per layer, run again in backward
  if (L.recompute == model::Recompute::full) recompute_f = layer_f;
  else if (L.recompute == model::Recompute::selective) recompute_f = attn_core_f;
  // Tensor parallelism: 2 all-reduces (or all-gather + reduce-scatter) of the layer's output per
  // forward and 2 per backward, on the link the tp group spans; a full recomputation repeats the
  // forward's. Context parallelism: the ring passes each rank's keys and values cp - 1 times.
  const Link& tp_link = job.cluster.link(1, L.tp);
  const double act_msg = tokens * double(m.hidden) * B.act;
  const double tp_ar = all_reduce_s(act_msg, L.tp, tp_link);
  const double tp_layer_f = 2 * tp_ar, tp_layer_b = 2 * tp_ar + (L.recompute == model::Recompute::full ? 2 * tp_ar : 0);
  const Link& cp_link = job.cluster.link(L.tp, L.cp);
  const double kv_msg = tokens * 2.0 * double(m.kv() * m.head_dim()) / double(std::min<int64_t>(L.tp, m.kv())) * B.act;
  const double cp_layer = L.cp > 1 ? (L.cp - 1) * (kv_msg / cp_link.bandwidth + cp_link.latency) : 0.0;
  // Each chain element's seconds for one micro-batch on one device (the embedding: a gather and an
  // add over the stream; a layer; the head), forward and backward, and of them the tensor- and
  // context-parallel communication and what recomputation runs again.
  // `syncs`: how many times a micro-batch's forward and backward wait on the element's tp or cp
  // peers (each collective or ring step).
  struct ElemCost {
    double f = 0, b = 0, comm_f = 0, comm_b = 0, recompute = 0, syncs = 0;
    ElemCost& operator+=(const ElemCost& o) {
      f += o.f, b += o.b, comm_f += o.comm_f, comm_b += o.comm_b, recompute += o.recompute, syncs += o.syncs;
      return *this;
    }
  };
  ElemCost emb, layer, head;
  emb.f = emb_f;
  emb.b = emb_b;
  layer.comm_f = tp_layer_f + cp_layer;
  layer.comm_b = tp_layer_b + cp_layer;
  layer.recompute = recompute_f;
  // Synchronisations: under tp a layer's two all-reduces each way (all-gather + reduce-scatter
  // pairs under sp: four), repeated by a full recomputation; the head's vocabulary-parallel loss
  // (max, sum, target logit; the input gradient) and the embedding's reduction each way; under cp
  // the ring's cp - 1 steps each way.
  if (L.tp > 1) {
    layer.syncs = (L.sp ? 4 : 2) * (L.recompute == model::Recompute::full ? 3 : 2);
    head.syncs = 4;
    emb.syncs = 2;
  }
  if (L.cp > 1) layer.syncs += 2 * (L.cp - 1);
  layer.f = layer_f + layer.comm_f;
  layer.b = layer_b + recompute_f + layer.comm_b;
  head.f = head_f;
  head.b = head_b;
  // The stages as the executor cuts the chain (pipeline::balance_chain over the blocks' declared
  // costs) and each rank's chunks' durations; the busiest rank's sums.
  const int parts = L.pp * L.v;
  const std::vector<int64_t> cuts = chain_cuts(m, parts);
  pipe::RankCosts rank_costs;
  rank_costs.chunk.assign(size_t(L.pp), std::vector<pipe::OpCosts>(size_t(L.v)));
  ElemCost busiest;
  int busiest_rank = 0;
  for (int r = 0; r < L.pp; ++r) {
    ElemCost sum;
    for (int k = 0; k < L.v; ++k) {
      const int c = r + k * L.pp;
      ElemCost chunk;
      for (int64_t el = cuts[size_t(c)]; el < cuts[size_t(c + 1)]; ++el) chunk += el == 0 ? emb : el <= m.layers ? layer : head;
      pipe::OpCosts& oc = rank_costs.chunk[size_t(r)][size_t(k)];
      oc.forward = chunk.f;
      oc.backward = chunk.b;
      oc.backward_input = oc.backward_weight = chunk.b / 2;
      sum += chunk;
    }
    if (r == 0 || sum.f + sum.b > busiest.f + busiest.b) busiest = sum, busiest_rank = r;
  }
  const double t_f = busiest.f, t_b = busiest.b;
  const double stage_f_comm = busiest.comm_f, stage_b_comm = busiest.comm_b;
  const double stage_recompute = busiest.recompute;
  // Point-to-point between stages: the activation (split over tp: the scatter/gather of
  // Megatron-LM) on the link between ranks tp x cp x dp apart.
  const Link& pp_link = job.cluster.link(L.tp * L.cp * L.dp, L.pp);
  const double p2p = L.pp > 1 ? act_msg / L.tp / pp_link.bandwidth + pp_link.latency : 0.0;
  rank_costs.transfer = p2p;
  // On a shared host the ranks run on `capacity` cores as the OS runs threads (wake-ups and load
  // balancing as loom calibrate measured them); the dp x tp x cp pipelines run side by side.
  rank_costs.capacity = capacity;
  rank_costs.copies = L.dp * L.tp * L.cp;
  rank_costs.wake = job.cluster.wake;
  rank_costs.crowded_wake = job.cluster.crowded_wake;
  rank_costs.balance = job.cluster.balance;
  double makespan = 0, in_flight = 1;
  // How much longer the busiest rank computes than its work takes on its share alone: the ranks
  // it shares the host with (all of them at once without a pipeline; as the simulation has it
  // with one).
  double slowdown = crowd;
  std::vector<int> rank_in_flight;  // (micro-batch, chunk) pairs each pipeline rank holds at most (simulated)
  std::optional<pipe::Schedule> flight_schedule;  // the simulated lists those counts come from
  // The schedule is generated for the busiest rank's chunk costs (free transfers), as the executor
  // generates one schedule for every rank.
  e.order_costs.forward = t_f / L.v;
  e.order_costs.backward = t_b / L.v;
  e.order_costs.backward_input = e.order_costs.backward_weight = t_b / L.v / 2;
  e.rank_costs = rank_costs;
  if (L.pp == 1) {
    makespan = double(micro) * (t_f + t_b) * crowd;
  } else {
    const int v = L.v;
    const double cf = t_f / v, cb = t_b / v;
    if (simulate) {
      // The schedule's own lists, simulated with these durations. Past a few rounds of p
      // micro-batches a schedule repeats itself, so its makespan grows by the same amount per
      // micro-batch: for long steps two shorter ones are simulated (3p and 4p micro-batches) and
      // the makespan extended along that line (what the planner costs is then linear in p, not
      // in the step's micro-batches).
      auto run = [&](int64_t mb) {
        pipe::ScheduleSpec spec;
        spec.kind = L.schedule;
        spec.stages = L.pp;
        spec.virtual_stages = v;
        spec.micro_batches = int(mb);
        flight_schedule = pipe::generate(spec, e.order_costs);
        return pipe::simulate(*flight_schedule, rank_costs);
      };
      auto slowdown_of = [&](const pipe::CheckResult& r, int64_t mb) {
        return r.ranks[size_t(busiest_rank)].busy / (double(mb) * (t_f + t_b));
      };
      auto peak_of = [&](const pipe::CheckResult& r) {
        int peak = 0;
        rank_in_flight.clear();
        for (const auto& rt : r.ranks) peak = std::max(peak, rt.peak_in_flight), rank_in_flight.push_back(rt.peak_in_flight);
        return double(peak) / v;  // in whole stages' worth of micro-batches
      };
      const int64_t m1 = 3 * int64_t(L.pp), m2 = 4 * int64_t(L.pp);
      if (micro <= m2) {
        const pipe::CheckResult r = run(micro);
        makespan = r.makespan;
        in_flight = peak_of(r);
        slowdown = slowdown_of(r, micro);
      } else {
        const pipe::CheckResult a = run(m1), b = run(m2);
        makespan = b.makespan + double(micro - m2) * (b.makespan - a.makespan) / double(m2 - m1);
        in_flight = peak_of(b);
        slowdown = slowdown_of(b, m2);
      }
    } else {
      const double p = L.pp, mm = double(micro);
      switch (L.schedule) {
        case pipe::Kind::gpipe: makespan = (mm + p - 1) * (t_f + t_b), in_flight = mm; break;
        case pipe::Kind::one_f_one_b: makespan = (mm + p - 1) * (t_f + t_b), in_flight = std::min(mm, p); break;
        case pipe::Kind::interleaved:
          makespan = (mm * v + p - 1) * (cf + cb);
          in_flight = std::min(mm, p * (1.0 + (p - 1) / (p * v)));
          break;
        case pipe::Kind::zb_h1: makespan = (mm + (p - 1) / 3.0) * (t_f + t_b), in_flight = std::min(mm, p); break;
      }
      makespan += 2 * (p - 1) * p2p;
      // On a shared host the ranks' work together needs the host at least this long.
      if (capacity > 0) {
        double work = 0;
        for (const auto& ranks : rank_costs.chunk)
          for (const pipe::OpCosts& oc : ranks) work += mm * (oc.forward + oc.backward);
        makespan = std::max(makespan, work * rank_costs.copies / capacity);
      }
    }
  }
  e.peak_in_flight = in_flight;
  // Activations: the stage's layers for each micro-batch in flight; the head's f32 logits and the
  // embedding output; under full recomputation one layer's whole set while it is recomputed.
  Layout whole = L;
  whole.recompute = model::Recompute::none;
  const double per_layer = layer_activation_bytes(job, L);
  e.memory["activations"] = in_flight * lps * per_layer +
                            (L.recompute == model::Recompute::full ? layer_activation_bytes(job, whole) : 0.0) +
                            tokens * double(m.vocab) / L.tp * (loom_pools(job.precision) ? B.act : 4.0) +
                            tokens * double(m.hidden) * B.act;
  if (loom_pools(job.precision)) {
    const LoomExtras x = loom_extras(job, L);
    e.memory["workspace"] = x.workspace;
    e.memory["params"] += x.gather;
    e.memory["grads"] += x.buckets;
    if (x.comm > 0) e.memory["comm"] = x.comm;
    if (L.pp > 1) {
      // The fullest pipeline rank as loom's executor lays it out: its chunks cut by cost
      // (pipeline::balance_chain over chain_costs, the embedding, each block and the head), the
      // micro-batches each rank keeps in flight under the schedule (simulated; without a
      // simulation the closed form above), the received gradient buffers of those in flight. Its
      // tags add up to its peak (comm: what the transfers add to it).
      const std::map<std::string, double> r = pipeline_rank_memory(job, L, rank_in_flight, in_flight, x, offloaded,
                                                                   flight_schedule ? &*flight_schedule : nullptr);
      e.memory = r;
    }
  }
  // Offload: the optimizer state leaves the device for the host, which also keeps an f32 gradient
  // staging copy and, in loom's pools, an f32 master copy of what the rank updates.
  if (L.offload) {
    e.memory["optimizer"] = 0;
    const double updated = offloaded / B.optimizer;  // the parameters the rank updates
    e.host_memory["optimizer"] = offloaded;
    e.host_memory["grads"] = 4 * updated;
    if (loom_pools(job.precision)) e.host_memory["params"] = 4 * updated;
    for (const auto& [tag, b] : e.host_memory) e.host_memory_total += b;
  }
  e.memory_total = 0;
  for (const auto& [tag, b] : e.memory) e.memory_total += b;
  e.fits = e.memory_total <= kUsableMemory * dev.memory;
  if (!e.fits)
    e.why_not = fmt::format("needs {:.1f} GB per device, {:.0f}% of {:.0f} GB is usable", e.memory_total / 1e9,
                            100 * kUsableMemory, dev.memory / 1e9);
  // An offloaded optimizer's host memory: within the device's share of the node's, where known.
  const double host_memory = job.cluster.host_memory;
  e.host_fits = host_memory <= 0 || e.host_memory_total <= kUsableMemory * host_memory;
  if (e.fits && !e.host_fits) {
    e.fits = false;
    e.why_not = fmt::format("needs {:.1f} GB of host memory per device, {:.0f}% of its {:.0f} GB is usable",
                            e.host_memory_total / 1e9, 100 * kUsableMemory, host_memory / 1e9);
  }

  // The step: the busiest stage's compute and communication inside the makespan.
  const double mm = double(micro);
  e.compute_s = mm * (t_f + t_b - stage_f_comm - stage_b_comm - stage_recompute) * slowdown;
  e.recompute_s = mm * stage_recompute * slowdown;
  e.tp_comm_s = mm * (stage_f_comm + stage_b_comm) * slowdown;
  e.pp_comm_s = L.pp > 1 ? mm * 2 * p2p : 0.0;
  e.bubble_s = std::max(0.0, makespan - mm * (t_f + t_b) * slowdown - e.pp_comm_s);
  // Data parallelism over dp x cp as loom's DataParallel runs it, each pass a ring over the shard's
  // ranks (its bandwidth term and n - 1 link latencies; twice both for an all-reduce): ZeRO-0
  // all-reduces the step's gradients after its last micro-batch; ZeRO-1 reduce-scatters them so and
  // all-gathers the updated weights; ZeRO-2 reduce-scatters every micro-batch's gradients and
  // gathers the weights once; ZeRO-3 reduce-scatters every micro-batch's gradients and gathers the
  // weights for its forward and its backward, with or without a pipeline (before, only a
  // pipeline's micro-batches paid theirs: ZeRO 2/3 with accumulation were predicted a step's worth
  // of one micro-batch). The weights move in the dtype the rank holds them in (B.weight: the
  // compute dtype where the masters are the host's). (A pass is many calls, a bucket's or a
  // block's each; their latencies are counted once a pass: a ring's n - 1 hops for every call
  // would be seconds at thousands of ranks, where NCCL's tree and PAT algorithms take log n.)
  const Link& dp_link = job.cluster.link(L.tp, shard);
  const double grad_bytes = P * B.grad;
  const double reduce_scatter = 0.5 * all_reduce_s(grad_bytes, shard, dp_link);
  const double weights = 0.5 * all_reduce_s(P * B.weight, shard, dp_link);
  // Per micro-batch (ZeRO 2/3's reduce-scatter, ZeRO-3's gathers) and per step (ZeRO-0's
  // all-reduce and ZeRO-1's reduce-scatter after the last backward; the updated weights' gather
  // after the update).
  double per_micro = 0, at_last_backward = 0, after_update = 0, gathers = 0;
  if (shard > 1) {
    if (L.zero == 0) at_last_backward = 2 * reduce_scatter;
    else if (L.zero == 1) at_last_backward = reduce_scatter, after_update = weights;
    else if (L.zero == 2) per_micro = reduce_scatter, after_update = weights;
    else per_micro = reduce_scatter + 2 * weights, gathers = 2 * weights;
  }
  const double mm_dp = double(micro);
  e.dp_comm_s = (mm_dp * per_micro + at_last_backward + after_update) * crowd;
  // What the step waits for. Hidden where the collectives run beside the compute: as Megatron-LM
  // and DeepSpeed run them (precision mixed), a reduction behind the backward it follows (but 10%)
  // and ZeRO-3's gathers behind the forward and the backward they precede; the updated weights'
  // gather after the update never. Exposed whole where they do not: loom's device runs (precision
  // device: DataParallel reduces on the compute thread, in the stream's order, no overlap yet), a
  // shared host (the threads backend's sums and copies run on the cores that compute; with more
  // ranks than cores the ranks reducing at once divide them, as the optimizer's passes do: the
  // link's rate was measured with a core per rank), and a pipeline (ZeRO 2/3's reduce-scatters run
  // between its micro-batches, the rest after its flush).
  if (L.pp > 1 || job.cluster.shared_host || job.precision == Precision::device) {
    e.dp_exposed_s = e.dp_comm_s;
  } else {
    auto hidden_behind = [](double comm, double compute) { return std::max(comm - 0.9 * compute, 0.1 * comm); };
    const double reduce = per_micro - gathers;  // (ZeRO 2/3: each micro-batch's reduce-scatter)
    e.dp_exposed_s = mm_dp * (hidden_behind(gathers / 2, t_f) + hidden_behind(gathers / 2 + reduce, t_b)) +
                     hidden_behind(at_last_backward, t_b) + after_update;
  }
  // A pipeline with tied embeddings: after the flush its first and last stages exchange wte's
  // reduced gradient (DataParallel::add_peer_gradient: f32, a sendrecv in pieces of at most a
  // bucket) and add it into theirs. Under ZeRO 1-3 a rank's shard is a slice of its whole stage's
  // flat buffer, not of wte: each piece is first gathered over the data-parallel group (a rank
  // receives what the others own of it, all of it where wte fits in their shards) and a rank adds
  // what it owns (at most its shard). The two sides wait for each other: the slower one counts.
  double tied_pieces = 0;
  if (L.pp > 1 && m.tied) {
    const bool sharded = L.zero >= 1 && shard > 1;
    const BlockParams bp = block_params(m, L.tp);
    const double elems = bp.wte, bytes = 4 * elems;
    tied_pieces = std::max(1.0, std::ceil(bytes / kBucketBytes));
    const double p2p_s = bytes / pp_link.bandwidth + tied_pieces * pp_link.latency;
    for (const int r : {0, L.pp - 1}) {
      double stage = 0;  // the rank's parameters: its chunks' elements of the chain
      for (int k = 0; k < L.v; ++k) {
        const int c = r + k * L.pp;
        for (int64_t el = cuts[size_t(c)]; el < cuts[size_t(c + 1)]; ++el) stage += bp.stage_element(m, el);
      }
      double gather = 0, added = elems;
      if (sharded) {
        const double S = std::ceil(stage / shard);
        gather = elems - std::max(0.0, elems - (shard - 1) * S);
        added = std::min(elems, S);
        gather = 4 * gather / dp_link.bandwidth + tied_pieces * (shard - 1) * dp_link.latency;
      }
      e.tied_s = std::max(e.tied_s, gather + p2p_s + 3 * 4 * added / dev.memory_bw);
    }
    // On a shared host: the first and last stages of every pipeline exchange at once.
    if (capacity > 0) e.tied_s *= std::max(1.0, std::min(double(job.devices), 2.0 * rank_costs.copies) / capacity);
  }
  // The optimizer reads and writes its state, the weights and the gradients once (on a device it
  // also writes the compute copy of every weight the rank holds, P: under ZeRO 1/2 after the
  // updated shards are gathered). Offloaded: the gradients go to the host and the updated weights
  // come back over the host link, and the host updates its f32 state (4 + 4 + 8 bytes a
  // parameter, read and written) at its share of the host's memory bandwidth.
  const double opt_params = P / (L.zero >= 1 ? shard : 1);
  const double refresh = (L.zero >= 3 && shard > 1 ? 0.0 : P * B.copy) / dev.memory_bw;
  if (!L.offload) {
    e.optimizer_s = (measured ? dev.kernels.at("adamw").seconds(opt_params * share)
                              : opt_params * 2 * (B.weight + B.grad + B.optimizer) / dev.memory_bw + refresh) *
                    crowd;
  } else {
    // (On a shared host the "host" is the devices' own memory: copies read and write it, at half
    // its rank's share of the rate.)
    const bool shared = job.cluster.shared_host;
    const Link host = shared ? Link{dev.memory_bw / 2, 0.0} : job.cluster.host;
    // With the reduced gradients' shard the host's (ZeRO 2/3 on a device), every micro-batch's
    // goes down as its buckets are reduced, and the host adds it to the step's (reading both and
    // writing one, 12 bytes an element): paid during backward, not hidden behind it, counted here.
    // Backend::add_to_host takes a bucket's part of the shard at a time in pieces of 2^21 elements,
    // each piece's addition beside the next one's transfer: a call's first transfer and last
    // addition are serial, the rest the slower of the two.
    const double host_memory_bw = shared ? dev.memory_bw : job.cluster.host_memory_bw;
    const bool host_grads = grads_on_host(job.precision, L.offload, L.zero) && shard > 1;
    const double grad_moves = host_grads ? double(micro) : 1.0;
    const double per_down = B.grad / host.bandwidth, per_add = host_grads ? 12 / host_memory_bw : 0.0;
    double down_and_add = opt_params * per_down;
    if (host_grads && opt_params > 0) {
      const double per_call = std::min(opt_params, std::max(1.0, kBucketBytes / 4 / shard));
      const double calls = std::ceil(opt_params / per_call);
      const double serial = std::min(opt_params, calls * std::min(per_call, double(int64_t(1) << 21)));
      down_and_add = serial * (per_down + per_add) + (opt_params - serial) * std::max(per_down, per_add);
    }
    const double up = opt_params * B.weight / host.bandwidth + host.latency;
    const double update = measured ? dev.kernels.at("adamw").seconds(opt_params * share)
                                   : opt_params * 2 * 16 / host_memory_bw;
    e.optimizer_s = (grad_moves * (down_and_add + host.latency) + up + update + refresh) * crowd;
  }
  // Ranks beyond a shared host's cores: every synchronisation on the busiest rank's path (its
  // elements' per micro-batch, the data-parallel collectives, the loss and gradient-norm
  // reductions of the step) waits for peers the OS has not scheduled (Cluster::crowded_sync,
  // measured by loom calibrate).
  if (job.cluster.shared_host && crowd > 1 && job.cluster.crowded_sync > 0) {
    const double buckets = std::max(1.0, std::ceil(grad_bytes / kBucketBytes));
    double step_syncs = 2;  // the loss and the gradient norm
    if (shard > 1) {
      const double blocks = double(m.layers) / L.pp + (L.pp == 1 ? 2.0 : 1.0);
      if (L.zero == 0) step_syncs += buckets;                                     // all-reduce
      else if (L.zero == 3) step_syncs += double(micro) * (2 * blocks + buckets);  // gathers, reduce-scatters
      else if (L.zero == 2) step_syncs += double(micro) * buckets + 1;           // per micro-batch, then a gather
      else step_syncs += buckets + 1;                                              // reduce-scatter, all-gather
    }
    step_syncs += tied_pieces * (L.zero >= 1 && shard > 1 ? 2 : 1);  // the tied wte's exchange (and gathers)
    // In a pipeline the other stages' ranks compute on the cores a waiting stage leaves (the
    // simulation gives them those cores): a stage's waits are exposed for 1 / pp of the step. Its
    // two received messages per micro-batch count among them where the simulation has no wake-ups
    // to give them (the search's closed form, or a calibration from before they were measured).
    const bool woken = simulate && (job.cluster.wake > 0 || job.cluster.crowded_wake > 0);
    const double micro_syncs = (busiest.syncs + (L.pp > 1 && !woken ? 2.0 : 0.0)) / L.pp;
    e.sync_s = job.cluster.crowded_sync * (double(micro) * micro_syncs + step_syncs);
  }
  e.step_s = makespan + e.dp_exposed_s + e.tied_s + e.optimizer_s + e.sync_s;
  const double step_tokens = double(job.global_batch) * double(m.seq);
  e.tokens_per_s = step_tokens / e.step_s;
  const double model_flops = m.model_flops(step_tokens);
  double extra = 0;
  if (L.recompute == model::Recompute::full) extra = step_tokens * m.layers * m.layer_forward_flops_per_token();
  else if (L.recompute == model::Recompute::selective) extra = step_tokens * m.layers * 4.0 * m.seq * m.hidden;
  e.model_tflops = model_flops / (e.step_s * job.devices) / 1e12;
  e.hardware_tflops = (model_flops + extra) / (e.step_s * job.devices) / 1e12;
  e.mfu = e.model_tflops * 1e12 / (job.precision == Precision::f32 ? dev.peak_f32 : dev.peak_bf16);
  return e;
}

SearchResult search(const Job& job, const SearchOptions& opt) {
  const auto t0 = std::chrono::steady_clock::now();
  SearchResult res;
  const ModelSpec& m = job.model;
  std::vector<int> divisors;
  for (int64_t d = 1; d <= job.devices; ++d)
    if (job.devices % d == 0) divisors.push_back(int(d));
  std::vector<Estimate> fitting;
  for (int tp : divisors) {
    if ((opt.tp && tp != opt.tp) || tp > job.cluster.per_node || m.heads % tp != 0) continue;
    for (int pp : divisors) {
      if ((opt.pp && pp != opt.pp) || (job.devices / tp) % pp != 0 || m.layers % pp != 0) continue;
      // Context parallelism in powers of two, for sequences of 8K and longer, while each rank keeps
      // at least 1K of them (Llama 3 405B's 128K-token stage ran cp = 16: 8K a rank).
      for (int64_t cp64 = 1; cp64 <= job.devices / tp / pp; cp64 *= 2) {
        const int cp = int(cp64);
        if ((opt.cp && cp != opt.cp) || (!opt.cp && cp > 1 && (m.seq < 8192 || m.seq / cp < 1024))) continue;
        if ((job.devices / tp / pp) % cp != 0) continue;
        const int dp = job.devices / tp / pp / cp;
        if (job.global_batch % dp != 0) continue;
        for (int64_t mbs : {1, 2, 4, 8, 16}) {
          if ((opt.mbs && mbs != opt.mbs) || (job.global_batch / dp) % mbs != 0) continue;
          std::vector<std::pair<pipe::Kind, int>> scheds;
          if (pp == 1) scheds.push_back({pipe::Kind::one_f_one_b, 1});
          else
            for (pipe::Kind k : opt.schedules) {
              if (k != pipe::Kind::interleaved) scheds.push_back({k, 1});
              else
                for (int v : {2, 3, 4, 6, 8})
                  if (m.layers % (int64_t(pp) * v) == 0) scheds.push_back({k, v});
            }
          for (auto [kind, v] : scheds)
            for (model::Recompute rc : opt.recomputes)
              for (int zero : opt.zeros) {
                if (opt.zero >= 0 && zero != opt.zero) continue;
                if (opt.zero < 0 && zero > 0 && dp * cp == 1) continue;  // nothing to shard over
                for (bool sp : {false, true}) {
                  if ((sp && tp == 1) || (opt.sp >= 0 && sp != (opt.sp == 1))) continue;
                  Layout L;
                  L.dp = dp, L.tp = tp, L.pp = pp, L.cp = cp, L.v = v, L.sp = sp, L.mbs = mbs, L.schedule = kind;
                  L.recompute = rc, L.zero = zero;
                  ++res.considered;
                  Estimate e = estimate(job, L, /*simulate=*/false);
                  if (e.memory.empty()) continue;  // not a valid layout (why_not says why)
                  // What does not fit is tried again with its optimizer in host memory (the slower
                  // twin of one that fits would never rank above it). The least demanding layout
                  // is one the host can hold.
                  auto least = [&](const Estimate& c) {
                    if (c.host_fits && (!res.least || c.memory_total < res.least->memory_total)) res.least = c;
                  };
                  if (!e.fits && opt.offload && !job.cluster.shared_host) {
                    least(e);
                    L.offload = true;
                    ++res.considered;
                    e = estimate(job, L, /*simulate=*/false);
                  }
                  least(e);
                  if (!e.fits) continue;
                  ++res.fitting;
                  fitting.push_back(std::move(e));
                }
              }
        }
      }
    }
  }
  // Fastest first; of equally fast layouts, the one needing least memory.
  auto faster = [](const Estimate& a, const Estimate& b) {
    if (a.step_s != b.step_s) return a.step_s < b.step_s;
    return a.memory_total < b.memory_total;
  };
  std::sort(fitting.begin(), fitting.end(), faster);
  // The closed forms rank; the schedules' own simulation decides among the leaders.
  const size_t keep = std::min(fitting.size(), size_t(std::max(opt.top, 1)) * 3);
  for (size_t i = 0; i < keep; ++i) res.best.push_back(estimate(job, fitting[i].layout, /*simulate=*/true));
  std::erase_if(res.best, [](const Estimate& e) { return !e.fits; });
  std::stable_sort(res.best.begin(), res.best.end(), faster);
  if (res.best.size() > size_t(opt.top)) res.best.resize(size_t(opt.top));
  res.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return res;
}

std::string format_table(const Job& job, const std::vector<Estimate>& es) {
  std::string s = fmt::format("{:<64} {:>9} {:>10} {:>7} {:>6} {:>8} {:>8} {:>8} {:>8} {:>9}\n", "layout", "step s",
                              "tokens/s", "TFLOP/s", "MFU", "compute", "bubble", "comm", "recomp", "memory GB");
  for (const Estimate& e : es) {
    const double comm = e.tp_comm_s + e.pp_comm_s + e.dp_exposed_s + e.tied_s;
    const std::string host = e.layout.offload ? fmt::format("  (+{:.1f} GB host)", e.host_memory_total / 1e9) : "";
    s += fmt::format("{:<64} {:>9.3f} {:>10.0f} {:>7.1f} {:>5.1f}% {:>8.3f} {:>8.3f} {:>8.3f} {:>8.3f} {:>9.1f}{}{}\n",
                     e.layout.str(), e.step_s, e.tokens_per_s, e.model_tflops, 100 * e.mfu, e.compute_s, e.bubble_s,
                     comm, e.recompute_s, e.memory_total / 1e9, host,
                     e.fits ? "" : (e.valid ? "  (does not fit: " : "  (invalid: ") + e.why_not + ")");
  }
  (void)job;
  return s;
}

std::string explain(const std::vector<Estimate>& r) {
  if (r.empty()) return "no layout fits.\n";
  const Estimate& a = r[0];
  std::string s = fmt::format("{} is fastest: {:.3f} s a step, {:.1f}% MFU.\n", a.layout.str(), a.step_s, 100 * a.mfu);
  for (size_t i = 1; i < r.size(); ++i) {
    const Estimate& b = r[i];
    struct Part {
      const char* what;
      double d;
    } parts[] = {{"pipeline bubble", b.bubble_s - a.bubble_s},
                 {"tensor/context-parallel communication", b.tp_comm_s - a.tp_comm_s},
                 {"exposed data-parallel communication", b.dp_exposed_s - a.dp_exposed_s},
                 {"recomputation", b.recompute_s - a.recompute_s},
                 {"compute", b.compute_s - a.compute_s},
                 {"pipeline transfers", b.pp_comm_s - a.pp_comm_s},
                 {"the tied embedding's exchange", b.tied_s - a.tied_s},
                 {"waits for ranks beyond the cores", b.sync_s - a.sync_s}};
    std::sort(std::begin(parts), std::end(parts), [](const Part& x, const Part& y) { return x.d > y.d; });
    s += fmt::format("  over {} ({:.3f} s, +{:.1f}%): it spends {:.3f} s more on {}", b.layout.str(), b.step_s,
                     100 * (b.step_s / a.step_s - 1), parts[0].d, parts[0].what);
    if (parts[1].d > 0.01 * b.step_s) s += fmt::format(" and {:.3f} s more on {}", parts[1].d, parts[1].what);
    s += ".\n";
  }
  return s;
}

std::string to_json(const Estimate& e) {
  nlohmann::json j;
  j["layout"] = e.layout.str();
  j["fits"] = e.fits;
  if (!e.why_not.empty()) j["why_not"] = e.why_not;
  j["step_time_s"] = e.step_s;
  j["tokens_per_s"] = e.tokens_per_s;
  j["tflops_per_gpu"] = e.model_tflops;
  j["hardware_tflops_per_gpu"] = e.hardware_tflops;
  j["mfu"] = e.mfu;
  j["micro_batches"] = e.micro_batches;
  j["memory_bytes_per_gpu"] = e.memory;
  if (e.layout.offload) j["host_memory_bytes_per_gpu"] = e.host_memory;
  j["time_s"] = {{"compute", e.compute_s},       {"recompute", e.recompute_s}, {"tp_comm", e.tp_comm_s},
                 {"pp_comm", e.pp_comm_s},       {"bubble", e.bubble_s},       {"dp_exposed", e.dp_exposed_s},
                 {"dp_comm", e.dp_comm_s},       {"optimizer", e.optimizer_s}, {"crowded_sync", e.sync_s},
                 {"tied_exchange", e.tied_s}};
  return j.dump(2);
}

}  // namespace loom::plan
