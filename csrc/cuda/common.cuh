// Helpers shared by the CUDA kernels.
//
// Only c10/cuda headers: ATen/cuda/CUDAContext.h would pull in cuBLAS/cuSPARSE headers, which a
// minimal CUDA toolkit (nvcc + runtime, as on the CI machines) does not ship.
#pragma once

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

namespace drmoo {

constexpr int kThreads = 256;  // threads per block of every kernel but the one-thread ones
constexpr int kWarps = kThreads / 32;

// Sum of v over the block (kThreads threads); the result is valid in thread 0.  `shared` holds
// kWarps doubles; the trailing barrier lets the caller reuse it right away.
__device__ __forceinline__ double block_sum(double v, double* shared) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_down_sync(0xffffffffu, v, offset);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = threadIdx.x < kWarps ? shared[threadIdx.x] : 0.0;
  if (warp == 0) {
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_down_sync(0xffffffffu, v, offset);
  }
  __syncthreads();
  return v;
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Enough blocks to fill the device a few times over, not more: each extra block only adds a
// partial sum to reduce.
// (A cudaDeviceGetAttribute query is a host-side lookup: no device synchronisation.)
inline int64_t resident_blocks() {
  int sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, c10::cuda::current_device()));
  return static_cast<int64_t>(std::max(sms, 1)) * 8;
}

inline cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

inline void check_cuda(const char* op, const at::Tensor& t) {
  TORCH_CHECK(t.is_cuda(), "drmoo.", op, ": the CUDA kernel got tensors on ", device_str(t.device()));
}

}  // namespace drmoo
