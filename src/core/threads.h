// The OpenMP team of the calling thread, set so that every parallel region gets exactly the threads
// asked for. oneDNN (loom's f32 GEMMs and bf16 matmuls) splits its work over the number of threads
// omp_get_max_threads() promises and runs the parts of threads the runtime did not start nowhere: a
// runtime that delivers fewer (OMP_THREAD_LIMIT below the request, OMP_DYNAMIC) made loom compute
// wrong products (a loss of 8.330 for 8.339, a gradient norm of 121885 for 1.39, no error).
#pragma once

namespace loom {

// omp_set_num_threads(n) clamped to the runtime's thread limit (omp_get_thread_limit), with dynamic
// teams off; returns the threads set (at least 1).
int set_omp_threads(int n);
// The same for the threads the calling thread already asks for (loom's start, before any region).
int settle_omp_threads();

}  // namespace loom
