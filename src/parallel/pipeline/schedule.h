// Pipeline schedules kept as data: for p stages, v model chunks per rank, m micro-batches and a
// kind, every rank gets an instruction list (compute, point-to-point transfers, optimizer step).
// The same lists are run by the executor, proved by the checker, drawn by draw.h and costed by a
// simulator, so none of them can drift from the others.
//
// Layout: the model chain is cut into V = p * v virtual stages; virtual stage s = chunk * p + rank
// (Megatron's interleaving: rank r owns chunks r, r + p, r + 2p, ...). Activations flow from
// virtual stage s to s + 1, gradients from s + 1 back to s.
//
// Transfers are point-to-point calls with one tag per pipeline communicator. The generator orders
// every rank's transfers consistently with one global order of messages, which makes the lists
// deadlock-free even when every send blocks until its receive (checker.h proves it for each
// generated schedule instead of trusting this argument). Each message is placed where the two
// ranks meet between computes: either from the planned compute times or by simulating the
// blocking execution event by event. The executor's sends do not block, so each send then moves
// up to right after the compute producing it and each receive down to right before the compute
// using it (transfers keep their order); the checker times both placements as the executor runs
// them and the shorter is kept (the simulation is what brings interleaved to (p - 1) / (v m) for
// small p * v).
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace loom::parallel::pipeline {

enum class Kind : uint8_t {
  gpipe,        // all forwards, then all backwards
  one_f_one_b,  // PipeDream-flush: p - rank - 1 warm-up forwards, then one forward / one backward
  interleaved,  // 1F1B over v > 1 chunks per rank (Megatron), m divisible by p
  zb_h1,        // zero bubble H1: backward split into input (B) and weight (W) parts, rank r's W
                // delayed by r micro-batches (every rank up to p in flight: 1F1B's peak)
};
std::string_view kind_name(Kind k);  // "gpipe", "1f1b", "interleaved", "zb-h1"
// Parses a kind name; throws naming `field` and the accepted names.
Kind parse_kind(std::string_view s, std::string_view field = "kind");

enum class Op : uint8_t {
  forward,          // forward of (mb, chunk)
  backward,         // full backward of (mb, chunk): input and weight gradients
  backward_input,   // zb: gradient of the chunk's input only
  backward_weight,  // zb: the deferred weight gradients of (mb, chunk)
  send_act,         // send the output activation of (mb, chunk) to peer
  recv_act,         // receive the input activation of (mb, chunk) from peer
  send_grad,        // send the input gradient of (mb, chunk) to peer
  recv_grad,        // receive the output gradient of (mb, chunk) from peer
  optimizer_step,   // all gradients of this rank are complete
};
std::string_view op_name(Op op);
bool is_compute(Op op);
bool is_transfer(Op op);

struct Instr {
  Op op = Op::forward;
  int mb = -1;     // micro-batch (-1 for optimizer_step)
  int chunk = -1;  // this rank's chunk (-1 for optimizer_step)
  int peer = -1;   // pipeline rank on the other side of a transfer (-1 otherwise)
  bool operator==(const Instr&) const = default;
};
std::string to_string(const Instr& in);  // "F(mb 3, c 0)", "send_act(mb 3, c 0) -> 2", ...

struct ScheduleSpec {
  Kind kind = Kind::one_f_one_b;
  int stages = 1;          // p: pipeline ranks
  int virtual_stages = 1;  // v: chunks per rank (> 1 only for interleaved)
  int micro_batches = 1;   // m
  // Throws a loom::Error naming the field for combinations that cannot be generated.
  void validate() const;
};

struct Schedule {
  ScheduleSpec spec;
  std::vector<std::vector<Instr>> ranks;  // [p] instruction lists

  int p() const { return spec.stages; }
  int v() const { return spec.virtual_stages; }
  int m() const { return spec.micro_batches; }
  int num_virtual_stages() const { return p() * v(); }
  int virtual_stage(int rank, int chunk) const { return chunk * p() + rank; }
  int rank_of(int vstage) const { return vstage % p(); }
  int chunk_of(int vstage) const { return vstage / p(); }
  bool split_backward() const { return spec.kind == Kind::zb_h1; }
  std::string str() const;  // one line per rank
};

// Relative durations used to order instructions and to draw and simulate schedules. The
// defaults: a full backward costs twice a forward, and zb splits it into two equal halves. The
// executor passes the model's own ratios (op_costs in executor.h): the input-gradient half also
// carries the attention backward, so it is dearer than the weight half.
struct OpCosts {
  double forward = 1.0;
  double backward = 2.0;
  double backward_input = 1.0;
  double backward_weight = 1.0;
  double transfer = 0.0;
  double optimizer_step = 0.0;
  double of(Op op) const;
  // Throws naming the field when a compute cost is not positive or a cost is not finite.
  void validate() const;
};

// Under a split backward, the (micro-batches forwarded and not yet through their weight pass,
// of them those past their input-gradient pass) pairs a rank's list reaches after each forward
// and input-gradient pass, without the pairs another exceeds in both: where its holdings can
// peak.
std::vector<std::pair<int, int>> split_peaks_of(const std::vector<Instr>& list);

// The schedule of a spec (validated first). The place of each transfer is chosen for `costs`:
// with blocking transfers, where a message meets both ranks depends on how long each compute
// takes. (The compute orders are fixed by the kind.)
Schedule generate(const ScheduleSpec& spec, const OpCosts& costs = {});

}  // namespace loom::parallel::pipeline
