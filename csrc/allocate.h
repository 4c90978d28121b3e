// New contiguous floating tensors through torch's C shim, shared by the CPU kernels (csrc/cpu/cpu_util.h,
// new_cpu_tensor) and the CUDA kernels' host code (csrc/cuda/common.cuh, new_cuda_tensor).
//
// aoti_torch_empty_strided (part of the stable C ABI that torch::stable::Tensor itself is built on) rather
// than torch::stable::empty / new_empty, which box their arguments through the dispatcher: measured on the
// CPU, that costs ~4 us per tensor, more than the small ops' own work, and every op allocates one to three
// outputs per optimizer step.  The shim also returns a failure as a status, so the error can name the size
// (a failure inside a dispatcher call would reach the user as "API call failed" under torch 2.11, behind a
// backtrace under 2.14).
#pragma once

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/tensor.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

#include "checks.h"

namespace drmoo {

// A contiguous `dtype` tensor of `sizes` on (shim device type, index).  `kernels` names the caller in the
// dtype error ("CPU", "CUDA"); `what` names the tensor in the allocation error ("a CPU tensor"), `where`
// its device after the size ("" or " on cuda:0").  A request of more than `byte_limit` bytes fails without
// asking torch (the CPU kernels pass the machine's memory; see new_cpu_tensor).
inline torch::stable::Tensor new_floating_tensor(const std::vector<int64_t>& sizes, ScalarType dtype,
                                                 int32_t device_type, int32_t device_index, const char* kernels,
                                                 const char* what, const std::string& where, double byte_limit) {
  std::vector<int64_t> strides(sizes.size(), 1);
  for (size_t k = sizes.size(); k-- > 1;) strides[k - 1] = strides[k] * std::max<int64_t>(sizes[k], 1);
  int32_t code = aoti_torch_dtype_float32();
  switch (dtype) {
    case ScalarType::Double:
      code = aoti_torch_dtype_float64();
      break;
    case ScalarType::Half:
      code = aoti_torch_dtype_float16();
      break;
    case ScalarType::BFloat16:
      code = aoti_torch_dtype_bfloat16();
      break;
    default:
      DRMOO_CHECK(dtype == ScalarType::Float, "drmoo: the ", kernels, " kernels allocate floating tensors, not ",
                  dtype_str(dtype));
  }
  double requested_bytes = static_cast<double>(float_bytes(dtype));
  for (const int64_t size : sizes) requested_bytes *= static_cast<double>(size);
  AtenTensorHandle handle = nullptr;
  const AOTITorchError status = requested_bytes > byte_limit
                                    ? AOTI_TORCH_FAILURE
                                    : aoti_torch_empty_strided(static_cast<int64_t>(sizes.size()), sizes.data(),
                                                               strides.data(), code, device_type, device_index,
                                                               &handle);
  if (status != AOTI_TORCH_SUCCESS) {
    std::string shape_text = "[";
    for (size_t k = 0; k < sizes.size(); ++k) shape_text += (k > 0 ? ", " : "") + std::to_string(sizes[k]);
    char bytes_text[32];
    std::snprintf(bytes_text, sizeof(bytes_text), "%.0f", requested_bytes);
    throw std::runtime_error(message::concat("drmoo: allocating ", what, " of shape ", shape_text, "] (",
                                             dtype_str(dtype), ", ", bytes_text, " bytes)", where,
                                             " failed: out of memory?"));
  }
  return torch::stable::Tensor(handle);
}

}  // namespace drmoo
