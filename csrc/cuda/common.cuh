// Helpers shared by the CUDA kernels.
//
// The CUDA kernels (drmoo_kernels._C_cuda) are written against torch's regular C++ API (at::Tensor,
// c10's CUDA guard and stream, TORCH_LIBRARY_IMPL), so a build loads only under the torch it was
// compiled with; the CPU kernels and the schemas (drmoo_kernels._C) use the stable ABI.  README,
// "One build for every supported torch", says why the CUDA host code was not ported yet.
//
// Only c10/cuda headers: ATen/cuda/CUDAContext.h would pull in cuBLAS/cuSPARSE headers, which a
// minimal CUDA toolkit (nvcc + runtime, as on the CI machines) does not ship.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>

#include "../checks.h"
#include "../drmoo_math.h"

namespace drmoo {

constexpr int kThreads = 256;  // threads per block of the streaming kernels
constexpr int kWarps = kThreads / 32;
constexpr unsigned kFullMask = 0xffffffffu;

// Sum of v over the block (kThreads threads); the result is valid in thread 0.  `shared` holds
// kWarps doubles; the trailing barrier lets the caller reuse it right away.
__device__ __forceinline__ double block_sum(double v, double* shared) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_down_sync(kFullMask, v, offset);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = threadIdx.x < kWarps ? shared[threadIdx.x] : 0.0;
  if (warp == 0) {
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_down_sync(kFullMask, v, offset);
  }
  __syncthreads();
  return v;
}

// Sum over the 32 lanes of a warp in a fixed butterfly order; every lane gets the same value.
__device__ __forceinline__ double warp_sum(double v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(kFullMask, v, offset);
  return v;
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

__host__ __device__ __forceinline__ bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Streaming multiprocessors of the current device, looked up once per device (a host-side
// attribute query: no device synchronisation, allowed during CUDA graph capture).
inline int sm_count() {
  static std::mutex mutex;
  static std::map<int, int> counts;
  const int device = c10::cuda::current_device();
  const std::lock_guard<std::mutex> lock(mutex);
  const auto found = counts.find(device);
  if (found != counts.end()) return found->second;
  int sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return counts[device] = std::max(sms, 1);
}

// Enough blocks of a simple kernel to fill the device a few times over.
inline int64_t resident_blocks() { return static_cast<int64_t>(sm_count()) * 8; }

// How many blocks of `kernel` (threads per block, dynamic shared bytes) fit on one SM at once,
// per device, cached: the grid of a grid-stride kernel is this times the SM count, which keeps
// every SM full without making more per-block partial sums than needed.
inline int blocks_per_sm(const void* kernel, int threads, size_t shared_bytes) {
  static std::mutex mutex;
  static std::map<std::tuple<int, const void*, int, size_t>, int> cache;
  const int device = c10::cuda::current_device();
  const auto key = std::make_tuple(device, kernel, threads, shared_bytes);
  const std::lock_guard<std::mutex> lock(mutex);
  const auto found = cache.find(key);
  if (found != cache.end()) return found->second;
  int blocks = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, threads, shared_bytes));
  return cache[key] = std::max(blocks, 1);
}

inline cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

inline void check_cuda(const char* op, const at::Tensor& t) {
  DRMOO_CHECK(t.is_cuda(), "drmoo.", op, ": the CUDA kernel got tensors on ", device_str(t.device()));
}

// J validated for `op`, with rows of unit column stride (the kernels step between rows by stride(0)).
inline at::Tensor cuda_jacobian(const char* op, const at::Tensor& J) {
  check_jacobian(op, J);
  check_cuda(op, J);
  return J.stride(1) == 1 ? J : J.contiguous();
}

// A small tensor (a vector or one value) read or written in its own dtype by a kernel, so that the
// host needs no conversion launches (w.to(float64) and the like) before or after the kernel.
struct ValueRef {
  void* ptr;
  int code;        // StorageCode of the dtype
  int64_t stride;  // elements between consecutive entries
};

inline ValueRef value_ref(const at::Tensor& t) {
  return ValueRef{t.data_ptr(), storage_code(t.scalar_type()), t.dim() > 0 ? t.stride(0) : 0};
}

// A value ref of a one-element tensor on `device` in a float dtype: `t` itself when it is one,
// else a float64 copy (kept alive by `keep`).
inline ValueRef scalar_ref(const at::Tensor& t, const at::Device& device, at::Tensor* keep) {
  *keep = t;
  if (t.device() != device || !is_supported_float(t.scalar_type())) *keep = t.to(device, at::kDouble);
  return ValueRef{keep->data_ptr(), storage_code(keep->scalar_type()), 0};
}

__device__ __forceinline__ double load_value(const ValueRef& ref, int64_t i) {
  const int64_t at = i * ref.stride;
  switch (ref.code) {
    case kStoreDouble:
      return static_cast<const double*>(ref.ptr)[at];
    case kStoreHalf:
      return static_cast<double>(static_cast<float>(static_cast<const c10::Half*>(ref.ptr)[at]));
    case kStoreBFloat16:
      return static_cast<double>(static_cast<float>(static_cast<const c10::BFloat16*>(ref.ptr)[at]));
    default:
      return static_cast<double>(static_cast<const float*>(ref.ptr)[at]);
  }
}

// Stores x rounded to the ref's dtype, the way torch's copy_ from a float64 tensor rounds it.
__device__ __forceinline__ void store_value(const ValueRef& ref, int64_t i, double x) {
  const int64_t at = i * ref.stride;
  switch (ref.code) {
    case kStoreDouble:
      static_cast<double*>(ref.ptr)[at] = x;
      break;
    case kStoreHalf:
      static_cast<c10::Half*>(ref.ptr)[at] = c10::Half(static_cast<float>(x));
      break;
    case kStoreBFloat16:
      static_cast<c10::BFloat16*>(ref.ptr)[at] = c10::BFloat16(static_cast<float>(x));
      break;
    default:
      static_cast<float*>(ref.ptr)[at] = static_cast<float>(x);
  }
}

// Upper-triangle pair index p -> (i, j), i <= j, row by row as pair_from_index (drmoo_math.h),
// in O(1): row i starts at S(i) = i*m - i*(i-1)/2; a float64 estimate of the largest i with
// S(i) <= p, corrected by exact integer steps.
__device__ __forceinline__ void pair_of_index(int64_t m, int64_t p, int64_t* i_out, int64_t* j_out) {
  auto row_start = [m](int64_t i) { return i * m - i * (i - 1) / 2; };
  const double b = 2.0 * static_cast<double>(m) + 1.0;
  const double disc = b * b - 8.0 * static_cast<double>(p);
  int64_t i = static_cast<int64_t>((b - sqrt(disc > 0.0 ? disc : 0.0)) / 2.0);
  i = i < 0 ? 0 : (i > m - 1 ? m - 1 : i);
  while (i > 0 && row_start(i) > p) --i;
  while (i + 1 < m && row_start(i + 1) <= p) ++i;
  *i_out = i;
  *j_out = i + (p - row_start(i));
}

// Index of pair (i, j), i <= j < m, in that order.
__host__ __device__ __forceinline__ int64_t index_of_pair(int64_t m, int64_t i, int64_t j) {
  return i * m - i * (i - 1) / 2 + (j - i);
}

// 16 bytes of T, loaded and stored as one 128-bit access.
template <typename T>
struct alignas(16) Vec16 {
  static constexpr int kSize = 16 / static_cast<int>(sizeof(T));
  T v[kSize];
};

// cp.async (sm_80+): copy 16 bytes global -> shared without staging in registers; only the first
// `src_bytes` are read, the rest of the 16 are zero-filled.  Older architectures copy synchronously.
__device__ __forceinline__ void copy_async_16(void* shared_dst, const void* global_src, int src_bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(shared_dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(global_src), "r"(src_bytes)
               : "memory");
#else
  unsigned char* dst = static_cast<unsigned char*>(shared_dst);
  const unsigned char* src = static_cast<const unsigned char*>(global_src);
  for (int k = 0; k < 16; ++k) dst[k] = k < src_bytes ? src[k] : 0;
#endif
}

__device__ __forceinline__ void copy_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

// Wait until at most `Pending` committed groups of this thread are still in flight.
template <int Pending>
__device__ __forceinline__ void copy_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(Pending) : "memory");
#endif
}

}  // namespace drmoo
