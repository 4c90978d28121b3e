// The dtype switch and the math dtype, shared by the CPU kernels (csrc/cpu/cpu_util.h) and the CUDA
// kernels' host code (csrc/cuda/common.cuh), both on torch's stable ABI: AT_DISPATCH_* and
// at::opmath_type are not part of it.  Header-only: only torch/headeronly and checks.h.
#pragma once

#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Half.h>

#include <stdexcept>

#include "checks.h"

namespace drmoo {

using Half = torch::headeronly::Half;
using BFloat16 = torch::headeronly::BFloat16;

// The math dtype of a storage dtype: float16/bfloat16 compute in float32, as at::opmath_type says.
template <typename T>
struct OpMath {
  using type = T;
};
template <>
struct OpMath<Half> {
  using type = float;
};
template <>
struct OpMath<BFloat16> {
  using type = float;
};
template <typename T>
using opmath_t = typename OpMath<T>::type;

template <typename T>
struct TypeTag {
  using type = T;
};

// Calls body(TypeTag<scalar_t>{}) for the four floating dtypes; the callers validated the dtype
// (check_float), so another one here is a bug of the caller, reported as such.  `device` names the
// kernels in that message ("CPU", "CUDA").
template <typename Body>
void dispatch_floating_on(const char* device, ScalarType type, const char* op, const Body& body) {
  switch (type) {
    case ScalarType::Float:
      return body(TypeTag<float>{});
    case ScalarType::Double:
      return body(TypeTag<double>{});
    case ScalarType::Half:
      return body(TypeTag<Half>{});
    case ScalarType::BFloat16:
      return body(TypeTag<BFloat16>{});
    default:
      throw std::runtime_error(
          message::concat("drmoo.", op, ": no ", device, " kernel for dtype ", dtype_str(type)));
  }
}

}  // namespace drmoo
