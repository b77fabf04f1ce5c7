#include "comm_util.h"

#include <array>
#include <cmath>
#include <cstring>
#include <memory>

#include "core/error.h"

namespace loom::comm::testing {

namespace {

uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Uninitialised bytes (zeroing 64 MB per buffer would dominate the tests).
struct Bytes {
  explicit Bytes(size_t n) : p(new char[n ? n : 1]), size(n) {}
  char* data() const { return p.get(); }
  std::unique_ptr<char[]> p;
  size_t size;
};

float elem(const void* p, DType dt, int64_t i) {
  if (dt == DType::f32) return static_cast<const float*>(p)[i];
  return bf16_to_f32(static_cast<const bf16*>(p)[i]);
}

// Throws describing the first element where got and want differ bitwise.
void compare(const void* got, const void* want, DType dt, int64_t n, int64_t first_index,
             const std::string& what, int rank) {
  size_t es = dtype_size(dt);
  if (n == 0 || std::memcmp(got, want, size_t(n) * es) == 0) return;
  for (int64_t i = 0; i < n; ++i) {
    if (std::memcmp(static_cast<const char*>(got) + size_t(i) * es, static_cast<const char*>(want) + size_t(i) * es,
                    es) != 0) {
      std::string g, w;
      if (dt == DType::f32 || dt == DType::bf16) {
        g = fmt::format("{:.9g}", elem(got, dt, i));
        w = fmt::format("{:.9g}", elem(want, dt, i));
      } else {
        uint32_t a = 0, b = 0;
        std::memcpy(&a, static_cast<const char*>(got) + size_t(i) * es, es);
        std::memcpy(&b, static_cast<const char*>(want) + size_t(i) * es, es);
        g = fmt::format("{:#x}", a);
        w = fmt::format("{:#x}", b);
      }
      throw Error(fmt::format("{}: rank {} element {}: got {}, expected {}", what, rank, first_index + i, g, w));
    }
  }
}

// Inputs of any dtype for the data-movement collectives: deterministic bytes per (seed, rank, i).
void fill_bytes(void* buf, DType dt, int64_t count, uint64_t seed, int rank) {
  if (dt == DType::f32 || dt == DType::bf16) return fill_input(buf, dt, count, seed, rank);
  size_t es = dtype_size(dt);
  char* b = static_cast<char*>(buf);
  for (int64_t i = 0; i < count; ++i) {
    uint64_t h = mix(seed * 0x100000001b3ull ^ (uint64_t(rank) << 40) ^ uint64_t(i));
    std::memcpy(b + size_t(i) * es, &h, es);
  }
}

std::string name(std::string_view call, const Comm& c, DType dt, int64_t count) {
  return fmt::format("{} {} [{}] on {} ranks ({})", call, dtype_name(dt), count, c.size(), c.backend());
}

}  // namespace

float input_value(uint64_t seed, int rank, int64_t i) {
  uint64_t h = mix(mix(seed ^ (uint64_t(uint32_t(rank)) << 32)) ^ uint64_t(i));
  // A 24-bit signed mantissa times 2^e, e in [-30, -15]: exact in f32, magnitudes 2^-30 .. 2^8.
  static const auto scale = [] {
    std::array<float, 16> t{};
    for (int e = 0; e < 16; ++e) t[size_t(e)] = std::ldexp(1.f, e - 30);
    return t;
  }();
  float m = float(int32_t((h >> 40) & 0xffffff) - 0x800000);
  return m * scale[h & 15];
}

void fill_input(void* buf, DType dt, int64_t count, uint64_t seed, int rank) {
  LOOM_CHECK(dt == DType::f32 || dt == DType::bf16, "fill_input: {} inputs", dtype_name(dt));
  if (dt == DType::f32) {
    float* f = static_cast<float*>(buf);
    for (int64_t i = 0; i < count; ++i) f[i] = input_value(seed, rank, i);
  } else {
    bf16* b = static_cast<bf16*>(buf);
    for (int64_t i = 0; i < count; ++i) b[i] = f32_to_bf16(input_value(seed, rank, i));
  }
}

void expected_reduction(void* out, DType dt, int n, int owner, ReduceOp op, uint64_t seed, int64_t begin,
                        int64_t end) {
  auto in = [&](int r, int64_t i) {
    float v = input_value(seed, r, i);
    return dt == DType::bf16 ? bf16_to_f32(f32_to_bf16(v)) : v;
  };
  for (int64_t i = begin; i < end; ++i) {
    float acc = in((owner + 1) % n, i);
    for (int k = 2; k <= n; ++k) {
      float x = in((owner + k) % n, i);
      if (op == ReduceOp::sum) {
        acc = acc + x;
      } else if (x > acc || std::isnan(x)) {
        acc = x;
      }
    }
    if (dt == DType::f32) {
      static_cast<float*>(out)[i - begin] = acc;
    } else {
      static_cast<bf16*>(out)[i - begin] = f32_to_bf16(acc);
    }
  }
}

uint64_t hash_bytes(const void* p, size_t bytes) {
  const char* b = static_cast<const char*>(p);
  uint64_t h = 0xcbf29ce484222325ull ^ bytes;
  size_t i = 0;
  for (; i + 8 <= bytes; i += 8) {
    uint64_t w;
    std::memcpy(&w, b + i, 8);
    h = (h ^ w) * 0x100000001b3ull;
    h ^= h >> 29;
  }
  for (; i < bytes; ++i) h = (h ^ uint8_t(b[i])) * 0x100000001b3ull;
  return mix(h);
}

void check_same_on_all_ranks(Comm& c, uint64_t hash, const std::string& what) {
  uint32_t mine[2] = {uint32_t(hash), uint32_t(hash >> 32)};
  std::vector<uint32_t> all(size_t(2 * c.size()));
  c.all_gather(mine, all.data(), 2 * c.size(), DType::u32);
  for (int j = 0; j < c.size(); ++j) {
    if (all[size_t(2 * j)] != mine[0] || all[size_t(2 * j + 1)] != mine[1]) {
      throw Error(fmt::format("{}: ranks {} and {} ended with different results", what, c.rank(), j));
    }
  }
}

void check_all_reduce(Comm& c, int64_t count, DType dt, ReduceOp op, uint64_t seed) {
  const int n = c.size(), r = c.rank();
  const size_t es = dtype_size(dt);
  std::string what = name(fmt::format("all_reduce {}", reduce_op_name(op)), c, dt, count);
  Bytes buf(static_cast<size_t>(count) * es);
  fill_input(buf.data(), dt, count, seed, r);
  c.all_reduce(buf.data(), count, dt, op);
  // This rank checks its own chunk against the reference; the hashes then tie all chunks together.
  Range mine = chunk_range(count, n, r);
  Bytes want(size_t(mine.size()) * es);
  expected_reduction(want.data(), dt, n, r, op, seed, mine.begin, mine.end);
  compare(buf.data() + size_t(mine.begin) * es, want.data(), dt, mine.size(), mine.begin, what, r);
  check_same_on_all_ranks(c, hash_bytes(buf.data(), buf.size), what);
}

void check_reduce_scatter(Comm& c, int64_t per_rank, DType dt, ReduceOp op, uint64_t seed, bool uneven) {
  const int n = c.size(), r = c.rank();
  const size_t es = dtype_size(dt);
  {
    int64_t total = per_rank * n;
    std::string what = name("reduce_scatter", c, dt, total);
    Bytes send(static_cast<size_t>(total) * es), recv(static_cast<size_t>(per_rank) * es), want(static_cast<size_t>(per_rank) * es);
    fill_input(send.data(), dt, total, seed, r);
    expected_reduction(want.data(), dt, n, r, op, seed, r * per_rank, (r + 1) * per_rank);
    c.reduce_scatter(send.data(), recv.data(), total, dt, op);
    compare(recv.data(), want.data(), dt, per_rank, r * per_rank, what, r);
    // In place: the output is this rank's chunk of the input.
    fill_input(send.data(), dt, total, seed, r);
    char* own = send.data() + size_t(r * per_rank) * es;
    c.reduce_scatter(send.data(), own, total, dt, op);
    compare(own, want.data(), dt, per_rank, r * per_rank, what + " in place", r);
  }
  if (uneven) {
    std::vector<int64_t> counts(static_cast<size_t>(n));
    for (int j = 0; j < n; ++j) counts[size_t(j)] = j % 3 == 1 ? 0 : per_rank + j;
    int64_t off = 0, total = 0;
    for (int j = 0; j < n; ++j) {
      if (j < r) off += counts[size_t(j)];
      total += counts[size_t(j)];
    }
    int64_t mine = counts[size_t(r)];
    std::string what = name("reduce_scatter_v", c, dt, total);
    Bytes send(static_cast<size_t>(total) * es), recv(static_cast<size_t>(mine) * es), want(static_cast<size_t>(mine) * es);
    fill_input(send.data(), dt, total, seed + 1, r);
    expected_reduction(want.data(), dt, n, r, op, seed + 1, off, off + mine);
    c.reduce_scatter_v(send.data(), recv.data(), counts, dt, op);
    compare(recv.data(), want.data(), dt, mine, off, what, r);
  }
}

void check_all_gather(Comm& c, int64_t per_rank, DType dt, uint64_t seed, bool uneven) {
  const int n = c.size(), r = c.rank();
  const size_t es = dtype_size(dt);
  std::vector<int64_t> counts(static_cast<size_t>(n));
  for (int j = 0; j < n; ++j) counts[size_t(j)] = uneven && j % 3 != 1 ? per_rank + 2 * j : uneven ? 0 : per_rank;
  std::vector<int64_t> offs(size_t(n) + 1, 0);
  for (int j = 0; j < n; ++j) offs[size_t(j) + 1] = offs[size_t(j)] + counts[size_t(j)];
  int64_t total = offs[size_t(n)];
  std::string what = name(uneven ? "all_gather_v" : "all_gather", c, dt, total);
  Bytes want(static_cast<size_t>(total) * es), send(static_cast<size_t>(counts[size_t(r)]) * es), recv(static_cast<size_t>(total) * es);
  for (int j = 0; j < n; ++j) fill_bytes(want.data() + size_t(offs[size_t(j)]) * es, dt, counts[size_t(j)], seed, j);
  fill_bytes(send.data(), dt, counts[size_t(r)], seed, r);
  if (uneven) {
    c.all_gather_v(send.data(), recv.data(), counts, dt);
  } else {
    c.all_gather(send.data(), recv.data(), total, dt);
  }
  compare(recv.data(), want.data(), dt, total, 0, what, r);
  // In place: this rank's part already sits in the output.
  std::memset(recv.data(), 0, recv.size);
  char* own = recv.data() + size_t(offs[size_t(r)]) * es;
  fill_bytes(own, dt, counts[size_t(r)], seed, r);
  c.all_gather_v(own, recv.data(), counts, dt);
  compare(recv.data(), want.data(), dt, total, 0, what + " in place", r);
}

void check_broadcast(Comm& c, int64_t count, DType dt, int root, uint64_t seed) {
  const size_t es = dtype_size(dt);
  std::string what = name(fmt::format("broadcast from {}", root), c, dt, count);
  Bytes buf(static_cast<size_t>(count) * es), want(static_cast<size_t>(count) * es);
  fill_bytes(buf.data(), dt, count, seed, c.rank());
  fill_bytes(want.data(), dt, count, seed, root);
  c.broadcast(buf.data(), count, dt, root);
  compare(buf.data(), want.data(), dt, count, 0, what, c.rank());
}

void check_point_to_point(Comm& c, int64_t count, DType dt, uint64_t seed) {
  const int n = c.size(), r = c.rank();
  const size_t es = dtype_size(dt);
  int next = (r + 1) % n, prev = (r + n - 1) % n;
  {
    std::string what = name("sendrecv ring", c, dt, count);
    Bytes send(static_cast<size_t>(count) * es), recv(static_cast<size_t>(count) * es), want(static_cast<size_t>(count) * es);
    fill_bytes(send.data(), dt, count, seed, r);
    fill_bytes(want.data(), dt, count, seed, prev);
    c.sendrecv(send.data(), count, next, recv.data(), count, prev, dt, 3);
    compare(recv.data(), want.data(), dt, count, 0, what, r);
  }
  if (n == 1) return;
  // Pairs (0,1), (2,3), ...: two messages of different sizes and tags each way, in order.
  int peer = r % 2 == 0 ? r + 1 : r - 1;
  if (peer >= n) return;
  int64_t counts[2] = {count, count / 2 + 1};
  std::string what = name("send/recv", c, dt, count);
  for (int dir = 0; dir < 2; ++dir) {
    bool sender = (r % 2 == 0) == (dir == 0);
    for (int m = 0; m < 2; ++m) {
      Bytes buf(size_t(counts[m]) * es), want(size_t(counts[m]) * es);
      uint64_t s = seed + uint64_t(10 * dir + m);
      if (sender) {
        fill_bytes(buf.data(), dt, counts[m], s, r);
        c.send(buf.data(), counts[m], dt, peer, 100 + m);
      } else {
        fill_bytes(want.data(), dt, counts[m], s, peer);
        c.recv(buf.data(), counts[m], dt, peer, 100 + m);
        compare(buf.data(), want.data(), dt, counts[m], 0, what, r);
      }
    }
  }
  // Non-blocking sends: both partners send two messages on one tag before receiving (blocking
  // sends would wait on each other forever); they arrive whole and in order.
  std::string iwhat = name("isend/recv", c, dt, count);
  std::vector<Bytes> out, in, want;
  std::vector<std::unique_ptr<PendingSend>> pending;
  for (int m = 0; m < 2; ++m) {
    out.emplace_back(size_t(counts[m]) * es);
    in.emplace_back(size_t(counts[m]) * es);
    want.emplace_back(size_t(counts[m]) * es);
    fill_bytes(out.back().data(), dt, counts[m], seed + 50 + uint64_t(m), r);
    fill_bytes(want.back().data(), dt, counts[m], seed + 50 + uint64_t(m), peer);
  }
  for (int m = 0; m < 2; ++m) pending.push_back(c.isend(out[size_t(m)].data(), counts[m], dt, peer, 200));
  for (int m = 0; m < 2; ++m) c.recv(in[size_t(m)].data(), counts[m], dt, peer, 200);
  for (auto& p : pending) p->wait();
  for (int m = 0; m < 2; ++m) compare(in[size_t(m)].data(), want[size_t(m)].data(), dt, counts[m], 0, iwhat, r);
}

void check_split(Comm& c, uint64_t seed) {
  const int n = c.size(), r = c.rank();
  // By parity, keys reversed: the part's ranks count down the parent's.
  auto part = c.split(r % 2, -r);
  LOOM_CHECK(part, "split: rank {} got no communicator", r);
  int members = (n - r % 2 + 1) / 2;
  int higher = 0;
  for (int j = r + 2; j < n; j += 2) ++higher;
  LOOM_CHECK(part->size() == members && part->rank() == higher,
             "split by parity on {} ranks: rank {} got rank {} of {}, expected {} of {}", n, r, part->rank(),
             part->size(), higher, members);
  check_all_reduce(*part, 1001, DType::f32, ReduceOp::sum, seed);
  // A negative color takes part but gets nothing; the rest keep working.
  auto rest = c.split(r == 0 ? -1 : 7, 0);
  if (r == 0) {
    LOOM_CHECK(!rest, "split: rank 0 passed a negative color but got a communicator");
  } else {
    LOOM_CHECK(rest && rest->size() == n - 1 && rest->rank() == r - 1, "split: rank {} got a wrong communicator", r);
    auto nested = rest->split(0, 0);
    check_all_reduce(*nested, 257, DType::bf16, ReduceOp::sum, seed);
  }
  c.barrier();
}

void check_collectives(Comm& c, const CheckPlan& plan) {
  const int n = c.size();
  for (DType dt : plan.dtypes) {
    for (int64_t count : plan.counts) {
      check_all_reduce(c, count, dt, ReduceOp::sum, plan.seed);
      check_all_reduce(c, count, dt, ReduceOp::max, plan.seed + 1);
      int64_t per_rank = (count + n - 1) / n;
      check_reduce_scatter(c, per_rank, dt, ReduceOp::sum, plan.seed + 2, true);
      check_all_gather(c, per_rank, dt, plan.seed + 3, false);
      check_all_gather(c, per_rank, dt, plan.seed + 4, true);
      check_broadcast(c, count, dt, int(count % n), plan.seed + 5);
      check_point_to_point(c, count, dt, plan.seed + 6);
    }
  }
  check_all_gather(c, 33, DType::i32, plan.seed + 7, true);
  check_split(c, plan.seed + 8);
  c.barrier();
}

}  // namespace loom::comm::testing
