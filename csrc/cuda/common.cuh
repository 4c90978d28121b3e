// Helpers shared by the CUDA kernels (drmoo_kernels._C_cuda).
//
// The host code is written against torch's LibTorch stable ABI, as the CPU kernels are (csrc/cpu/
// cpu_util.h): torch::stable::Tensor, STABLE_TORCH_LIBRARY_IMPL, torch/headeronly, and the C shim
// for what the stable C++ API does not wrap at the oldest supported torch: the current CUDA stream
// (aoti_torch_get_current_cuda_stream, declared only with USE_CUDA) and tensor allocation
// (aoti_torch_empty_strided).  Built with TORCH_TARGET_VERSION = that torch (setup.py), one build
// loads under it and every later torch.  No ATen or c10 headers beyond the header-only ones; the CUDA
// runtime itself (cudaGetLastError, device attributes) is called directly.
#pragma once

#ifndef USE_CUDA
#error "setup.py compiles csrc/cuda with -DUSE_CUDA: torch's C shim declares its CUDA functions only then"
#endif

#include <cuda_runtime.h>
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/device.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <initializer_list>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "../allocate.h"
#include "../checks.h"
#include "../dispatch.h"
#include "../drmoo_math.h"

namespace drmoo {

using Tensor = torch::stable::Tensor;

// Calls body(TypeTag<scalar_t>{}) for the four floating dtypes (dispatch.h).
template <typename Body>
void dispatch_floating(ScalarType type, const char* op, const Body& body) {
  dispatch_floating_on("CUDA", type, op, body);
}

// A failed CUDA runtime call as a RuntimeError (what C10_CUDA_CHECK raised), naming the call.
inline void check_cuda_status(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    throw std::runtime_error(message::concat("drmoo: ", what, " failed: CUDA error: ", cudaGetErrorString(status)));
  }
}

// After a kernel launch: a launch error (bad configuration, no kernel image for the GPU) is raised
// at once, as C10_CUDA_KERNEL_LAUNCH_CHECK did.
#define DRMOO_CUDA_LAUNCH_CHECK() ::drmoo::check_cuda_status(cudaGetLastError(), "a CUDA kernel launch")

// The CUDA device current on this thread: the device the DeviceGuard of every op selected.
inline int current_device() {
  int device = 0;
  check_cuda_status(cudaGetDevice(&device), "cudaGetDevice");
  return device;
}

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
  const int device = current_device();
  const std::lock_guard<std::mutex> lock(mutex);
  const auto found = counts.find(device);
  if (found != counts.end()) return found->second;
  int sms = 0;
  check_cuda_status(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "cudaDeviceGetAttribute");
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
  const int device = current_device();
  const auto key = std::make_tuple(device, kernel, threads, shared_bytes);
  const std::lock_guard<std::mutex> lock(mutex);
  const auto found = cache.find(key);
  if (found != cache.end()) return found->second;
  int blocks = 0;
  check_cuda_status(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, threads, shared_bytes),
                    "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
  return cache[key] = std::max(blocks, 1);
}

// The current CUDA stream of `device` (torch's, so that the kernels run in order with the caller's
// work and under CUDA graph capture), through the C shim: the stable C++ API wraps streams only as
// an opaque torch::stable::accelerator::Stream, whose native handle it exposes from torch 2.13 on.
inline cudaStream_t current_stream(int32_t device) {
  void* stream = nullptr;
  DRMOO_CHECK(aoti_torch_get_current_cuda_stream(device, &stream) == AOTI_TORCH_SUCCESS,
              "drmoo: could not get the current CUDA stream of device cuda:", device);
  return static_cast<cudaStream_t>(stream);
}

inline void check_cuda(const char* op, const Tensor& t) {
  DRMOO_CHECK(t.is_cuda(), "drmoo.", op, ": the CUDA kernel got tensors on ", device_str(t.device()));
}

// A new contiguous tensor on CUDA device `device` in a floating dtype (outputs and workspaces), on torch's
// caching allocator and current stream (allocate.h says why through the C shim).
inline Tensor new_cuda_tensor(const std::vector<int64_t>& sizes, ScalarType dtype, int32_t device) {
  return new_floating_tensor(sizes, dtype, aoti_torch_device_type_cuda(), device, "CUDA", "a CUDA tensor",
                             " on cuda:" + std::to_string(device), std::numeric_limits<double>::infinity());
}

inline Tensor new_cuda_tensor(std::initializer_list<int64_t> shape, ScalarType dtype, int32_t device) {
  return new_cuda_tensor(std::vector<int64_t>(shape), dtype, device);
}

// A contiguous copy of the CUDA tensor `t` in `dtype`, on t's device (new_cuda_tensor, then copy_).
inline Tensor contiguous_copy(const Tensor& t, ScalarType dtype) {
  const auto sizes = t.sizes();
  Tensor out = new_cuda_tensor(std::vector<int64_t>(sizes.begin(), sizes.end()), dtype, t.get_device_index());
  torch::stable::copy_(out, t);
  return out;
}

// `t` itself when it is contiguous (what Tensor::contiguous() returns then), else a contiguous copy.
inline Tensor contiguous_or_copy(const Tensor& t) {
  return t.is_contiguous() ? t : contiguous_copy(t, t.scalar_type());
}

// J validated for `op`, with rows of unit column stride (the kernels step between rows by stride(0)).
inline Tensor cuda_jacobian(const char* op, const Tensor& J) {
  check_jacobian(op, J);
  check_cuda(op, J);
  return J.stride(1) == 1 ? J : contiguous_or_copy(J);
}

// A small tensor (a vector or one value) read or written in its own dtype by a kernel, so that the
// host needs no conversion launches (w.to(float64) and the like) before or after the kernel.
struct ValueRef {
  void* ptr;
  int code;        // StorageCode of the dtype
  int64_t stride;  // elements between consecutive entries
};

inline ValueRef value_ref(const Tensor& t) {
  return ValueRef{t.data_ptr(), storage_code(t.scalar_type()), t.dim() > 0 ? t.stride(0) : 0};
}

// A value ref of a one-element tensor on CUDA device `device` in a float dtype: `t` itself when it is
// one, else a float64 copy on that device (kept alive by `keep`).
inline ValueRef scalar_ref(const Tensor& t, int32_t device, std::optional<Tensor>* keep) {
  const bool on_device = t.is_cuda() && t.get_device_index() == device;
  if (on_device && is_supported_float(t.scalar_type())) {
    *keep = t;
  } else {
    *keep = torch::stable::to(t, ScalarType::Double, std::nullopt, torch::stable::Device(DeviceType::CUDA, device));
  }
  return ValueRef{(*keep)->data_ptr(), storage_code((*keep)->scalar_type()), 0};
}

__device__ __forceinline__ double load_value(const ValueRef& ref, int64_t i) {
  const int64_t at = i * ref.stride;
  switch (ref.code) {
    case kStoreDouble:
      return static_cast<const double*>(ref.ptr)[at];
    case kStoreHalf:
      return static_cast<double>(static_cast<float>(static_cast<const Half*>(ref.ptr)[at]));
    case kStoreBFloat16:
      return static_cast<double>(static_cast<float>(static_cast<const BFloat16*>(ref.ptr)[at]));
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
      static_cast<Half*>(ref.ptr)[at] = Half(static_cast<float>(x));
      break;
    case kStoreBFloat16:
      static_cast<BFloat16*>(ref.ptr)[at] = BFloat16(static_cast<float>(x));
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
