#include "kernels/cuda/common.cuh"
#include "kernels/cuda/tune.cuh"

#include <cstdlib>
#include <map>
#include <mutex>
#include <string>

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

int gemm_tuning() {
  static const int mode = [] {
    const char* e = std::getenv("LOOM_GEMM_TUNE");
    if (!e || !*e) return 1;
    const std::string v(e);
    LOOM_CHECK(v == "0" || v == "1" || v == "2", "LOOM_GEMM_TUNE='{}': must be 0 (off), 1 (on) or 2 (on, verbose)", v);
    return std::stoi(v);
  }();
  return mode;
}

bool stream_capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
  LOOM_CUDA_CHECK(cudaStreamIsCapturing(stream, &cap));
  return cap != cudaStreamCaptureStatusNone;
}

}  // namespace loom::cuda
