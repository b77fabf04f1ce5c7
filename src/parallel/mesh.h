// The device mesh: named dimensions over the world's ranks, outermost first. The standard layout
// is pp, dp, cp, tp with tp innermost, so tensor-parallel peers are neighbouring ranks (threads
// of one process, GPUs of one node):
//
//   Mesh m({{"pp", 2}, {"dp", 2}, {"cp", 1}, {"tp", 2}});   // 8 ranks; rank = ((pp*2+dp)*1+cp)*2+tp
//   m.group_ranks(5, {"tp"})        -> {4, 5}
//   m.group_ranks(5, {"dp", "cp"})  -> {5, 7}
//
// A group of a set of dimensions is the ranks that differ only in those coordinates. Inside a
// group, ranks are numbered row-major over the group's dimensions in mesh order (whatever order
// they are named in); groups are numbered row-major over the other dimensions. The arithmetic is
// pure (no communicator); MeshComms turns it into sub-communicators, passed explicitly.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "comm/comm.h"

namespace loom::parallel {

struct MeshDim {
  std::string name;
  int size = 1;
};

class Mesh {
 public:
  // Dimensions outermost first: names unique and non-empty, sizes >= 1.
  explicit Mesh(std::vector<MeshDim> dims);
  // The standard layout pp, dp, cp, tp (tp innermost); every dimension is present (size 1 allowed).
  static Mesh standard(int pp, int dp, int cp, int tp);

  int world_size() const { return world_; }
  int ndims() const { return int(dims_.size()); }
  const std::vector<MeshDim>& dims() const { return dims_; }
  bool has(std::string_view name) const;
  // Position of a dimension (0 = outermost); throws naming the mesh's dimensions if absent.
  int dim_index(std::string_view name) const;
  int size(std::string_view name) const { return dims_[size_t(dim_index(name))].size; }
  // Rank distance between neighbours along a dimension.
  int stride(std::string_view name) const { return strides_[size_t(dim_index(name))]; }

  std::vector<int> coords(int rank) const;
  int coord(int rank, std::string_view name) const;
  int rank_of(std::span<const int> coords) const;
  // The rank `offset` steps along `name` (cyclic), other coordinates unchanged.
  int shift(int rank, std::string_view name, int offset) const;

  // Groups of a set of dimensions (names of this mesh; an empty set is the rank alone).
  int group_size(const std::vector<std::string>& names) const;
  int num_groups(const std::vector<std::string>& names) const { return world_ / group_size(names); }
  int group_rank(int rank, const std::vector<std::string>& names) const;
  int group_index(int rank, const std::vector<std::string>& names) const;
  std::vector<int> group_ranks(int rank, const std::vector<std::string>& names) const;
  // Every group, in group_index order.
  std::vector<std::vector<int>> groups(const std::vector<std::string>& names) const;

  // The same by bit mask (bit i = dimension i), as MeshComms indexes them.
  uint32_t mask(const std::vector<std::string>& names) const;
  int group_size(uint32_t mask) const;
  int group_rank(int rank, uint32_t mask) const;
  int group_index(int rank, uint32_t mask) const;
  std::vector<int> group_ranks(int rank, uint32_t mask) const;

  std::string str() const;  // "pp=2 x dp=2 x cp=1 x tp=2"
  bool operator==(const Mesh& o) const;

 private:
  void check_rank(int rank) const;
  std::vector<MeshDim> dims_;
  std::vector<int> strides_;
  int world_ = 1;
};

// The communicator of the groups of `names`: collective over `world` (whose size must be the
// mesh's); each rank gets the communicator of its own group, ranked by group_rank.
std::unique_ptr<comm::Comm> split_comm(const Mesh& mesh, comm::Comm& world,
                                       const std::vector<std::string>& names);

// Sub-communicators of every non-empty set of the mesh's dimensions, made once (collectively, in
// a fixed order) from the world communicator, which must outlive this object.
class MeshComms {
 public:
  MeshComms(Mesh mesh, comm::Comm& world);
  const Mesh& mesh() const { return mesh_; }
  comm::Comm& world() const { return world_; }
  int rank() const { return world_.rank(); }
  // The communicator of this rank's group over `names` (e.g. {"dp", "cp"} for ZeRO over both).
  comm::Comm& get(const std::vector<std::string>& names) const;
  comm::Comm& operator[](std::string_view name) const { return get({std::string(name)}); }
  // This rank's coordinate along a dimension.
  int coord(std::string_view name) const { return mesh_.coord(rank(), name); }

 private:
  Mesh mesh_;
  comm::Comm& world_;
  std::vector<std::unique_ptr<comm::Comm>> comms_;  // by mask; [0] unused
};

}  // namespace loom::parallel
