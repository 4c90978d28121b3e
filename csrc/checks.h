// Input validation shared by the CPU kernels (torch's stable ABI: torch::stable::Tensor) and the CUDA
// kernels (torch's regular C++ API: at::Tensor).  Only metadata is inspected (shapes, dtypes,
// devices), never values, so the checks cost no device synchronisation.
//
// The checks are templates over the tensor type: both tensor classes answer dim(), size(),
// stride(), numel(), scalar_type() and device() (whose type() and index() are the same
// torch/headeronly enums), and nothing here includes ATen, so the stable build can use this file.
//
// Every failed check throws std::runtime_error, which torch reports as a Python RuntimeError: the
// stable ABI has no ValueError/TypeError (STD_TORCH_CHECK is a RuntimeError too), and the CUDA
// kernels raise the same type so that a direct torch.ops.drmoo.* call fails alike on every device.
// The documented ValueError/TypeError of the backends' Python wrappers are raised by the wrappers
// before they call the ops; these checks keep a direct op call from reading out of bounds.
#pragma once

#include <torch/headeronly/core/DeviceType.h>
#include <torch/headeronly/core/ScalarType.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "drmoo_math.h"

// Throws std::runtime_error with the message assembled by message::concat, only when the check fails.
#define DRMOO_CHECK(cond, ...)                                             \
  do {                                                                     \
    if (!(cond)) throw std::runtime_error(::drmoo::message::concat(__VA_ARGS__)); \
  } while (false)

namespace drmoo {

using ScalarType = torch::headeronly::ScalarType;
using DeviceType = torch::headeronly::DeviceType;

// Messages are built with std::string, std::to_string and snprintf only, never with a
// std::ostringstream (c10::str, STD_TORCH_CHECK with several message arguments): on the torch
// 2.11.0+cu130 GPU image, every TORCH_CHECK whose message was streamed inside the extension killed
// the interpreter (SIGSEGV) while single-string messages raised.  (With this repository's g++ 12.2
// and the same torch wheel both raise; the exact fault was not observed.)
namespace message {
inline void append(std::string& out, const char* text) { out += text; }
inline void append(std::string& out, const std::string& text) { out += text; }
inline void append(std::string& out, char c) { out += c; }
template <typename Int, std::enable_if_t<std::is_integral_v<Int>, int> = 0>
inline void append(std::string& out, Int value) {
  out += std::to_string(value);
}
// "%g": what an ostream prints for a double by default (6 significant digits).
inline void append(std::string& out, double value) {
  char buffer[32];
  std::snprintf(buffer, sizeof(buffer), "%g", value);
  out += buffer;
}
template <typename... Parts>
inline std::string concat(const Parts&... parts) {
  std::string out;
  (append(out, parts), ...);
  return out;
}
}  // namespace message

// "[2, 3]" for a tensor of shape (2, 3); "[]" for a 0-d tensor.
template <typename Tensor>
std::string shape_str(const Tensor& t) {
  const int64_t rank = t.dim();
  std::string out = "[";
  for (int64_t k = 0; k < rank; ++k) {
    if (k > 0) out += ", ";
    out += std::to_string(t.size(k));
  }
  out += "]";
  return out;
}

// "cpu", "cuda:0", "meta"...: the device as torch prints it (c10::DeviceTypeName is not header-only).
inline std::string device_type_name(DeviceType type) {
  switch (type) {
    case DeviceType::CPU:
      return "cpu";
    case DeviceType::CUDA:
      return "cuda";
    case DeviceType::Meta:
      return "meta";
    case DeviceType::MPS:
      return "mps";
    case DeviceType::XPU:
      return "xpu";
    case DeviceType::HIP:
      return "hip";
    case DeviceType::PrivateUse1:
      return "privateuseone";
    default:
      return "device type " + std::to_string(static_cast<int>(type));
  }
}

template <typename Device>
std::string device_str(const Device& device) {
  std::string out = device_type_name(device.type());
  if (device.index() >= 0) out += ":" + std::to_string(static_cast<int>(device.index()));
  return out;
}

template <typename Tensor>
bool same_device(const Tensor& a, const Tensor& b) {
  const auto da = a.device(), db = b.device();
  return da.type() == db.type() && da.index() == db.index();
}

// "Float", "Double", "Long"...: torch's name of the dtype (a C string).
inline const char* dtype_str(ScalarType t) { return torch::headeronly::toString(t); }

inline bool is_supported_float(ScalarType t) {
  return t == ScalarType::Float || t == ScalarType::Double || t == ScalarType::Half || t == ScalarType::BFloat16;
}

// Accumulation dtype, as the reference's _acc: float64 stays float64, everything else is float32.
inline ScalarType acc_dtype(ScalarType t) { return t == ScalarType::Double ? ScalarType::Double : ScalarType::Float; }

inline int storage_code(ScalarType t) {
  switch (t) {
    case ScalarType::Double:
      return kStoreDouble;
    case ScalarType::Half:
      return kStoreHalf;
    case ScalarType::BFloat16:
      return kStoreBFloat16;
    default:
      return kStoreFloat;
  }
}

template <typename Tensor>
void check_float(const char* op, const char* name, const Tensor& t) {
  DRMOO_CHECK(is_supported_float(t.scalar_type()), "drmoo.", op, ": ", name,
              " must be float32, float64, float16 or bfloat16, got ", dtype_str(t.scalar_type()));
}

template <typename Tensor>
void check_device(const char* op, const char* name, const Tensor& t, const Tensor& ref) {
  DRMOO_CHECK(same_device(t, ref), "drmoo.", op, ": ", name, " is on ", device_str(t.device()),
              " but the other inputs are on ", device_str(ref.device()));
}

template <typename Tensor>
void check_vector(const char* op, const char* name, const Tensor& t, int64_t m, const Tensor& ref) {
  check_float(op, name, t);
  check_device(op, name, t, ref);
  DRMOO_CHECK(t.dim() == 1 && t.size(0) == m, "drmoo.", op, ": ", name, " must have shape [", m,
              "] (one entry per task), got ", shape_str(t));
}

inline void check_divergence(const char* op, int64_t code, double param, double lam) {
  DRMOO_CHECK(code >= kChi2 && code <= kCressieRead, "drmoo.", op, ": unknown divergence code ", code,
              " (0 chi2, 1 kl, 2 cvar_smooth, 3 cressie_read)");
  DRMOO_CHECK(code != kCVaRSmooth || (param > 0.0 && param < 1.0), "drmoo.", op,
              ": cvar_smooth needs 0 < alpha < 1, got ", param);
  DRMOO_CHECK(code != kCressieRead || (param > 1.0 && std::isfinite(param)), "drmoo.", op,
              ": cressie_read needs k > 1, got ", param);
  DRMOO_CHECK(lam > 0.0, "drmoo.", op, ": lam must be > 0, got ", lam);
}

// losses [B, m] with B >= 1, eta [m], optional sample_weight [B, m], all on one device.
template <typename Tensor>
void check_dual_inputs(const char* op, const Tensor& losses, const Tensor& eta, const Tensor* sample_weight,
                       int64_t code, double param, double lam) {
  check_float(op, "losses", losses);
  DRMOO_CHECK(losses.dim() == 2, "drmoo.", op, ": losses must be per-sample losses of shape [B, m], got ",
              shape_str(losses));
  DRMOO_CHECK(losses.size(0) > 0, "drmoo.", op, ": empty batch (B = 0): the dual objective needs at least one sample");
  check_vector(op, "eta", eta, losses.size(1), losses);
  if (sample_weight != nullptr) {
    check_float(op, "sample_weight", *sample_weight);
    check_device(op, "sample_weight", *sample_weight, losses);
    DRMOO_CHECK(sample_weight->dim() == 2 && sample_weight->size(0) == losses.size(0) &&
                    sample_weight->size(1) == losses.size(1),
                "drmoo.", op, ": sample_weight must have the shape of losses ", shape_str(losses), ", got ",
                shape_str(*sample_weight));
  }
  check_divergence(op, code, param, lam);
}

// J [m, n] with m >= 1.  The kernels walk each row with unit stride and step between rows by
// J.stride(0): a J whose stride(1) is not 1 is made contiguous by the caller.
template <typename Tensor>
void check_jacobian(const char* op, const Tensor& J) {
  check_float(op, "J", J);
  DRMOO_CHECK(J.dim() == 2, "drmoo.", op, ": J must be the [m, n] per-task gradient matrix, got shape ",
              shape_str(J));
  DRMOO_CHECK(J.size(0) >= 1, "drmoo.", op, ": J has no rows (m = 0 tasks)");
}

// params: tensors on J's device with J's dtype whose numels add up to n = J.size(1).
template <typename Tensor, typename TensorList>
void check_params(const char* op, const Tensor& J, const TensorList& params) {
  int64_t total = 0;
  for (size_t k = 0; k < params.size(); ++k) {
    const Tensor& p = params[k];
    DRMOO_CHECK(same_device(p, J), "drmoo.", op, ": params[", k, "] is on ", device_str(p.device()),
                " but J is on ", device_str(J.device()));
    DRMOO_CHECK(p.scalar_type() == J.scalar_type(), "drmoo.", op, ": params[", k, "] has dtype ",
                dtype_str(p.scalar_type()), " but J has ", dtype_str(J.scalar_type()),
                "; the compiled kernels need the parameters in J's dtype");
    total += p.numel();
  }
  DRMOO_CHECK(total == J.size(1), "drmoo.", op, ": J has ", J.size(1), " columns but the parameters hold ", total,
              " elements");
}

// mu, lr: one value.
template <typename Tensor>
void check_one_value(const char* op, const char* name, const Tensor& t) {
  DRMOO_CHECK(t.numel() == 1, "drmoo.", op, ": ", name, " must hold one value, got shape ", shape_str(t));
}

}  // namespace drmoo
