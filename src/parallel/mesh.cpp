#include "parallel/mesh.h"

#include "core/error.h"

namespace loom::parallel {

namespace {

constexpr int kMaxCommDims = 8;  // MeshComms makes 2^ndims - 1 communicators

std::string names_of(const std::vector<MeshDim>& dims) {
  std::string s;
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + dims[i].name;
  return s;
}

}  // namespace

Mesh::Mesh(std::vector<MeshDim> dims) : dims_(std::move(dims)) {
  LOOM_CHECK(!dims_.empty(), "mesh: at least one dimension is needed");
  LOOM_CHECK(dims_.size() <= 31, "mesh: {} dimensions, at most 31", dims_.size());
  int64_t world = 1;
  for (size_t i = 0; i < dims_.size(); ++i) {
    const auto& d = dims_[i];
    LOOM_CHECK(!d.name.empty(), "mesh: dimension {} has an empty name", i);
    LOOM_CHECK(d.size >= 1, "mesh: dimension '{}' has size {}, must be at least 1", d.name, d.size);
    for (size_t j = 0; j < i; ++j) {
      LOOM_CHECK(dims_[j].name != d.name, "mesh: dimension '{}' appears twice", d.name);
    }
    world *= d.size;
    LOOM_CHECK(world <= (int64_t(1) << 30), "mesh: {} ranks is too many", world);
  }
  world_ = int(world);
  strides_.assign(dims_.size(), 1);
  for (int i = int(dims_.size()) - 2; i >= 0; --i) {
    strides_[size_t(i)] = strides_[size_t(i) + 1] * dims_[size_t(i) + 1].size;
  }
}

Mesh Mesh::standard(int pp, int dp, int cp, int tp) {
  return Mesh({{"pp", pp}, {"dp", dp}, {"cp", cp}, {"tp", tp}});
}

bool Mesh::has(std::string_view name) const {
  for (auto& d : dims_) if (d.name == name) return true;
  return false;
}

int Mesh::dim_index(std::string_view name) const {
  for (size_t i = 0; i < dims_.size(); ++i) if (dims_[i].name == name) return int(i);
  LOOM_FAIL("mesh: no dimension '{}' in mesh {} (dimensions: {})", name, str(), names_of(dims_));
}

void Mesh::check_rank(int rank) const {
  LOOM_CHECK(rank >= 0 && rank < world_, "mesh: rank {} outside mesh {} of {} ranks", rank, str(), world_);
}

std::vector<int> Mesh::coords(int rank) const {
  check_rank(rank);
  std::vector<int> c(dims_.size());
  for (size_t i = 0; i < dims_.size(); ++i) c[i] = rank / strides_[i] % dims_[i].size;
  return c;
}

int Mesh::coord(int rank, std::string_view name) const {
  check_rank(rank);
  size_t i = size_t(dim_index(name));
  return rank / strides_[i] % dims_[i].size;
}

int Mesh::rank_of(std::span<const int> coords) const {
  LOOM_CHECK(coords.size() == dims_.size(), "mesh: {} coordinates given for mesh {} of {} dimensions",
             coords.size(), str(), dims_.size());
  int r = 0;
  for (size_t i = 0; i < dims_.size(); ++i) {
    LOOM_CHECK(coords[i] >= 0 && coords[i] < dims_[i].size, "mesh: coordinate {} of '{}' outside [0, {})",
               coords[i], dims_[i].name, dims_[i].size);
    r += coords[i] * strides_[i];
  }
  return r;
}

int Mesh::shift(int rank, std::string_view name, int offset) const {
  check_rank(rank);
  size_t i = size_t(dim_index(name));
  int n = dims_[i].size;
  int c = rank / strides_[i] % n;
  int to = ((c + offset) % n + n) % n;
  return rank + (to - c) * strides_[i];
}

uint32_t Mesh::mask(const std::vector<std::string>& names) const {
  uint32_t m = 0;
  for (auto& n : names) {
    uint32_t bit = 1u << dim_index(n);
    LOOM_CHECK(!(m & bit), "mesh: dimension '{}' named twice in a group", n);
    m |= bit;
  }
  return m;
}

int Mesh::group_size(uint32_t mask) const {
  int s = 1;
  for (size_t i = 0; i < dims_.size(); ++i) if (mask & (1u << i)) s *= dims_[i].size;
  return s;
}

int Mesh::group_rank(int rank, uint32_t mask) const {
  check_rank(rank);
  int g = 0;
  for (size_t i = 0; i < dims_.size(); ++i) {
    if (mask & (1u << i)) g = g * dims_[i].size + rank / strides_[i] % dims_[i].size;
  }
  return g;
}

int Mesh::group_index(int rank, uint32_t mask) const {
  check_rank(rank);
  int g = 0;
  for (size_t i = 0; i < dims_.size(); ++i) {
    if (!(mask & (1u << i))) g = g * dims_[i].size + rank / strides_[i] % dims_[i].size;
  }
  return g;
}

std::vector<int> Mesh::group_ranks(int rank, uint32_t mask) const {
  std::vector<int> c = coords(rank);
  for (size_t i = 0; i < dims_.size(); ++i) if (mask & (1u << i)) c[i] = 0;
  std::vector<int> out;
  out.reserve(size_t(group_size(mask)));
  // Count through the group's coordinates row-major (innermost fastest).
  for (;;) {
    out.push_back(rank_of(c));
    int i = int(dims_.size()) - 1;
    for (; i >= 0; --i) {
      if (!(mask & (1u << i))) continue;
      if (++c[size_t(i)] < dims_[size_t(i)].size) break;
      c[size_t(i)] = 0;
    }
    if (i < 0) break;
  }
  return out;
}

int Mesh::group_size(const std::vector<std::string>& names) const { return group_size(mask(names)); }

int Mesh::group_rank(int rank, const std::vector<std::string>& names) const {
  return group_rank(rank, mask(names));
}

int Mesh::group_index(int rank, const std::vector<std::string>& names) const {
  return group_index(rank, mask(names));
}

std::vector<int> Mesh::group_ranks(int rank, const std::vector<std::string>& names) const {
  return group_ranks(rank, mask(names));
}

std::vector<std::vector<int>> Mesh::groups(const std::vector<std::string>& names) const {
  uint32_t m = mask(names);
  std::vector<std::vector<int>> out(size_t(world_ / group_size(m)));
  for (int r = 0; r < world_; ++r) {
    if (group_rank(r, m) == 0) out[size_t(group_index(r, m))] = group_ranks(r, m);
  }
  return out;
}

std::string Mesh::str() const {
  std::string s;
  for (size_t i = 0; i < dims_.size(); ++i) s += fmt::format("{}{}={}", i ? " x " : "", dims_[i].name, dims_[i].size);
  return s;
}

bool Mesh::operator==(const Mesh& o) const {
  if (dims_.size() != o.dims_.size()) return false;
  for (size_t i = 0; i < dims_.size(); ++i) {
    if (dims_[i].name != o.dims_[i].name || dims_[i].size != o.dims_[i].size) return false;
  }
  return true;
}

std::unique_ptr<comm::Comm> split_comm(const Mesh& mesh, comm::Comm& world,
                                       const std::vector<std::string>& names) {
  LOOM_CHECK(world.size() == mesh.world_size(), "mesh: communicator of {} ranks for mesh {} of {} ranks",
             world.size(), mesh.str(), mesh.world_size());
  uint32_t m = mesh.mask(names);
  return world.split(mesh.group_index(world.rank(), m), mesh.group_rank(world.rank(), m));
}

MeshComms::MeshComms(Mesh mesh, comm::Comm& world) : mesh_(std::move(mesh)), world_(world) {
  LOOM_CHECK(world.size() == mesh_.world_size(), "mesh: communicator of {} ranks for mesh {} of {} ranks",
             world.size(), mesh_.str(), mesh_.world_size());
  LOOM_CHECK(mesh_.ndims() <= kMaxCommDims, "mesh: MeshComms supports at most {} dimensions, mesh {} has {}",
             kMaxCommDims, mesh_.str(), mesh_.ndims());
  uint32_t n = 1u << mesh_.ndims();
  comms_.resize(n);
  int r = world.rank();
  for (uint32_t m = 1; m < n; ++m) comms_[m] = world.split(mesh_.group_index(r, m), mesh_.group_rank(r, m));
}

comm::Comm& MeshComms::get(const std::vector<std::string>& names) const {
  uint32_t m = mesh_.mask(names);
  LOOM_CHECK(m != 0, "mesh: a communicator needs at least one dimension");
  return *comms_[m];
}

}  // namespace loom::parallel
