#include "kernels/cuda/common.cuh"

#include <map>
#include <mutex>

namespace loom::cuda {

int num_sms() {
  static std::mutex mu;
  static std::map<int, int> counts;  // device -> multiprocessors
  int dev = 0;
  LOOM_CUDA_CHECK(cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lk(mu);
  auto it = counts.find(dev);
  if (it != counts.end()) return it->second;
  int count = 0;
  LOOM_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, dev));
  counts.emplace(dev, count);
  return count;
}

bool stream_capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
  LOOM_CUDA_CHECK(cudaStreamIsCapturing(stream, &cap));
  return cap != cudaStreamCaptureStatusNone;
}

}  // namespace loom::cuda
