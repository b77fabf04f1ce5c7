// The nccl backend: collectives on CUDA device buffers, one GPU per rank, bootstrapped over a host
// communicator (normally the mpi backend: `mpirun -n N loom train CONFIG --train.device cuda
// --parallel.dp N --parallel.comm nccl`). Exists in CUDA builds (LOOM_HAVE_CUDA); NCCL itself is used when loom found it
// (LOOM_HAVE_NCCL). This header declares it either way, so guard uses with LOOM_HAVE_CUDA.
//
// A device communicator wraps a host communicator and takes one of two paths, chosen when it is
// made (collectively, the same on every rank):
//   nccl    every rank drives its own GPU: NCCL's unique id is created on rank 0 and broadcast over
//           the host communicator, then NCCL runs the collectives on the GPUs. Results follow
//           NCCL's reduction order: within floating-point tolerance of the host backends, not
//           bit-identical to them.
//   staged  ranks share a GPU (NCCL refuses two ranks of one communicator on one device) or NCCL
//           is missing: each call copies the device buffers to pinned host staging memory, runs
//           the host communicator's collective (the mpi backend's deterministic ring; its results
//           are bit-identical to the CPU backends') and copies the result back.
// Path::automatic picks nccl when NCCL is available and every rank has a GPU of its own (device
// UUIDs all-gathered over the host communicator), else staged.
//
// Buffers are device pointers of the communicator's GPU (the staged path also takes host
// pointers). A call is ordered after the work queued on the communicator's stream (the one given
// in the options, else a stream of its own that waits for the legacy default stream) and returns
// once the result is in place. Tags of send/recv: the staged path matches them like its host
// communicator; NCCL has no tags, so on the nccl path messages between two ranks are matched in
// the order they were posted and counts are not checked against the sender's.
//
// Timeouts: NCCL calls are asynchronous; every wait polls the CUDA stream and
// ncclCommGetAsyncError against the communicator's timeout. On a timeout or an NCCL error the
// NCCL communicator is aborted (ncclCommAbort) and loom::Error names the call; the communicator
// is then unusable (every later call throws). ncclCommAbort stops NCCL's own stalled kernels but
// waits for work queued on the stream ahead of them, so a stream held by other work delays the
// error until that work is done. The staged path times out like its host
// communicator (the mpi backend aborts the job).
#pragma once
#include <memory>
#include <string_view>

#include "comm/comm.h"

namespace loom::comm {

enum class DevicePath : uint8_t { automatic, nccl, staged };
std::string_view device_path_name(DevicePath p);

struct DeviceCommOptions {
  DevicePath path = DevicePath::automatic;
  // CUDA device ordinal of this rank; -1: the calling thread's current device.
  int device = -1;
  // cudaStream_t the collectives are enqueued on (ordered after the work already queued there);
  // nullptr: a stream of the communicator's own (created blocking, so it also waits for work on
  // the legacy default stream).
  void* stream = nullptr;
};

// Collective over `host`: every rank of host calls it with the same path. The returned
// communicator has host's ranks, size and timeout (host's CommOptions; its pool holds the staging
// memory, tagged MemTag::comm), and keeps host for bootstrap, splits and the staged path.
// Throws loom::Error when the path cannot be taken (nccl requested while ranks share a GPU or
// without NCCL in the build, no CUDA device).
std::unique_ptr<Comm> make_device_comm(std::unique_ptr<Comm> host, DeviceCommOptions opts = {});

// The path a device communicator made by make_device_comm took (nccl or staged); throws for
// communicators of other backends.
DevicePath device_comm_path(const Comm& c);

// Whether this build has NCCL (LOOM_HAVE_NCCL).
bool nccl_available();

}  // namespace loom::comm
