#include "kernels/cuda/common.cuh"

namespace loom::cuda {

int num_sms() {
  static const int n = [] {
    int dev = 0, count = 0;
    LOOM_CUDA_CHECK(cudaGetDevice(&dev));
    LOOM_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, dev));
    return count;
  }();
  return n;
}

}  // namespace loom::cuda
