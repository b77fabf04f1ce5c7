// What the planner knows of the hardware: a device (peak FLOP/s per dtype, the fraction of it
// the transformer's matrix products reach, memory and its bandwidth) and the cluster around it
// (devices per node, the link inside a node and between nodes: bandwidth per device and latency).
//
// Built in: a100-80gb (A100 80GB SXM, DGX A100: NVLink/NVSwitch 300 GB/s per GPU per direction,
// 8 x 200 Gb/s HDR InfiniBand per node = 25 GB/s per GPU), h100-sxm and h200 (DGX H100/H200:
// NVLink 450 GB/s, 8 x 400 Gb/s NDR = 50 GB/s per GPU), with each GPU's PCIe link to the host
// (A100: Gen4 x16, 32 GB/s raw, 25 assumed reached; H100/H200: Gen5 x16, 64 raw, 50 assumed) and
// its eighth of the host's memory bandwidth (DGX A100: 2 EPYC 7742, 16 channels of DDR4-3200,
// 410 GB/s; DGX H100/H200: 2 Xeon 8480C, 16 channels of DDR5-4800, 614 GB/s) and of its 2 TB of
// memory, and cpu (this host's one process per
// rank with shared memory between ranks; its rates come from `loom calibrate` when it has run).
// Peaks are the vendors' dense figures; `efficiency` is the GPU profiles' one calibrated number:
// the share of peak the matrix products reach end to end (the cpu profile's measured kernels,
// linear layers and blocks are below).
//
// A cluster file is TOML:
//   [device]  name, peak_tflops_bf16, peak_tflops_f32, efficiency, gemm_half, memory_gb, memory_gbs
//   [cluster] gpus_per_node, intra_gbs, intra_latency_us, inter_gbs, inter_latency_us, host_gbs,
//             host_latency_us, host_memory_gbs, host_memory_gb
// with GB = 10^9 bytes; every field of a built-in can be given, the rest come from `base` (a
// built-in's name, default a100-80gb).
#pragma once
#include <array>
#include <map>
#include <string>
#include <vector>

namespace loom::plan {

// One of loom's own CPU kernels timed at two sizes (`loom calibrate`): seconds = call + units x unit.
struct KernelCost {
  double call = 0;  // seconds per call beyond its work (the OpenMP team's start, small rows)
  double unit = 0;  // seconds per unit of work (an element, a parameter or, for attention, a FLOP)
  double seconds(double units, double calls = 1) const { return calls * call + units * unit; }
};

// The kernels `loom calibrate` times (HostProfile::kernels, Device::kernels), in its order: the
// planner uses them only when the profile has every one.
inline constexpr std::array<const char*, 9> kKernelNames{
    "norm_forward", "norm_backward", "gelu_forward", "gelu_backward", "residual", "attention_forward",
    "attention_backward", "crossentropy", "adamw"};

// A transformer layer's four linear layers (qkv, attention output, MLP up and down; bias
// included) as loom runs them on `tokens` rows of width `width`: FLOP/s of forward and backward.
struct LinearRate {
  double tokens = 0, width = 0, forward = 0, backward = 0;
};

// loom's own chain as a training step runs it (`loom calibrate`, the cpu only): `ranks` ranks at
// once on the host (its threads divided among them, at least one each; in lockstep as a layout's
// ranks are), each a
// GPT of width `width` (heads of 64, feed-forward 4 x width) on micro-batches of `tokens` tokens
// (sequences of `seq`, vocabulary `vocab`): the slowest rank's median seconds of a transformer
// layer's forward and backward and of the head's (final norm, logits, fused cross-entropy).
struct BlockTime {
  int ranks = 1;
  double tokens = 0, width = 0, seq = 0, vocab = 0;
  double layer_forward = 0, layer_backward = 0, head_forward = 0, head_backward = 0;
};

struct Device {
  std::string name;
  double peak_bf16 = 0;     // FLOP/s, dense
  double peak_f32 = 0;      // FLOP/s
  double efficiency = 0.5;  // share of peak large matrix products reach
  // Smaller products reach less: a product of n output elements (rows x columns on one device)
  // runs at efficiency x n / (n + gemm_half) (0: no size effect).
  double gemm_half = 0;
  double memory = 0;        // bytes
  double memory_bw = 0;     // bytes/s
  // Measured costs of loom's non-GEMM kernels by name (HostProfile::kernels; the calibrated cpu
  // only): where present, the planner costs the element-wise work, attention, the cross-entropy
  // and the optimizer with them instead of with memory_bw and the GEMM rate.
  std::map<std::string, KernelCost> kernels;
  // Measured rates of loom's linear layers (the calibrated cpu only): a grid over tokens and layer
  // width of a transformer layer's four linears' forward and backward FLOP/s (LinearRate); where
  // present, a layer's products are costed at the rate interpolated at its tokens and width.
  std::vector<LinearRate> linear;
  // Measured blocks (the calibrated cpu only, BlockTime): where present, the planner scales its
  // kernel-by-kernel cost of a layer and of the head by what the same blocks measured against that
  // cost at the calibrated points (interpolated at the layout's tokens and width, clamped to the
  // grid, for as many ranks at once as the layout computes with, at most as many as cores): what
  // running the kernels one after another over a step's buffers, and beside other ranks, costs
  // beyond each kernel timed alone.
  std::vector<BlockTime> blocks;
};

struct Link {
  double bandwidth = 0;  // bytes/s per device, each direction
  double latency = 0;    // seconds per message
};

struct Cluster {
  std::string name;
  Device device;
  int per_node = 8;  // devices per node
  // The devices of a node are ranks sharing one host's cores and memory (the cpu cluster): a
  // node's ranks divide its compute rate and memory bandwidth among them.
  bool shared_host = false;
  // A shared host's cores (the threads its ranks' OpenMP teams share; 0: per_node): at most this
  // many ranks compute at once at full speed, more divide the host among them.
  int cores = 0;
  // A shared host's cost of one synchronisation (a collective, a received message) beyond its
  // latency while more ranks than cores run (HostProfile::crowded_sync), in seconds.
  double crowded_sync = 0;
  // A shared host's scheduling of ranks (HostProfile::wake, crowded_wake, balance), in seconds.
  double wake = 0, crowded_wake = 0, balance = 0;
  Link intra, inter;
  // A device's link to its node's host memory (PCIe), bytes/s per device each direction, and its
  // share of the host's memory bandwidth (bytes/s): what an offloaded optimizer's transfers and
  // update run at. (A shared host's devices are its memory: the planner copies and updates at the
  // device's memory rate there.)
  Link host;
  double host_memory_bw = 0;
  double host_memory = 0;  // bytes of host memory per device (its share of the node's; 0: unknown)
  // The link between ranks `stride` apart in a group of `size` consecutive strides: inside a node
  // when the group's span fits one.
  const Link& link(int stride, int size) const {
    return int64_t(stride) * size <= per_node ? intra : inter;
  }
};

// A built-in by name (a100-80gb, h100-sxm, h200, cpu), or a cluster file; throws naming it.
Cluster cluster_named(const std::string& name_or_path);
// The built-in cluster whose GPU a device name (CUDA's, "NVIDIA H100 80GB HBM3") is, by a whole
// word of it: h200, h100-sxm (every H100), a100-80gb (every A100); "" for any other.
std::string cluster_for_gpu(const std::string& gpu_name);
Cluster read_cluster(const std::string& path);

}  // namespace loom::plan
