// Input validation shared by the CPU and CUDA kernels.  Only metadata is inspected (shapes, dtypes,
// devices), never values, so the checks cost no device synchronisation.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>

#include <cstdint>
#include <cstdio>
#include <string>
#include <type_traits>

#include "drmoo_math.h"

// TORCH_CHECK / TORCH_CHECK_VALUE / TORCH_CHECK_TYPE with the message assembled by message::concat
// (only when the check fails) and passed on as one C string.
#define DRMOO_CHECK_WITH(TORCH_MACRO, cond, ...)                                   \
  do {                                                                             \
    if (!(cond)) {                                                                 \
      const std::string drmoo_check_message_ = ::drmoo::message::concat(__VA_ARGS__); \
      TORCH_MACRO(false, drmoo_check_message_.c_str());                            \
    }                                                                              \
  } while (false)
#define DRMOO_CHECK(cond, ...) DRMOO_CHECK_WITH(TORCH_CHECK, cond, __VA_ARGS__)
#define DRMOO_CHECK_VALUE(cond, ...) DRMOO_CHECK_WITH(TORCH_CHECK_VALUE, cond, __VA_ARGS__)
#define DRMOO_CHECK_TYPE(cond, ...) DRMOO_CHECK_WITH(TORCH_CHECK_TYPE, cond, __VA_ARGS__)


namespace drmoo {

// Error messages never go through c10::str (TORCH_CHECK with several message arguments), which
// formats with a std::ostringstream instantiated inside this extension by whatever compiler the
// user has.  On the torch 2.11.0+cu130 GPU image (its own g++), every check whose message had a
// number or a std::string in it killed the interpreter (SIGSEGV), while checks whose message was
// one C string raised normally -- also after shapes were formatted by shape_str below instead of
// streaming IntArrayRef, so the stream itself, not IntArrayRef, is the common factor.  (With this
// repository's g++ 12.2 and the same torch wheel both raise; the exact fault was not observed.)
// DRMOO_CHECK* build the message with std::string, std::to_string and snprintf only, and hand
// TORCH_CHECK* a single C string: the path every passing check already takes.
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
inline std::string shape_str(const at::Tensor& t) {
  const c10::IntArrayRef sizes = t.sizes();
  const int64_t* dims = sizes.data();
  const size_t rank = sizes.size();
  std::string out = "[";
  for (size_t k = 0; k < rank; ++k) {
    if (k > 0) out += ", ";
    out += std::to_string(dims[k]);
  }
  out += "]";
  return out;
}

// "cpu", "cuda:0", "meta"...: the device as torch prints it.
inline std::string device_str(const c10::Device& device) {
  std::string out = c10::DeviceTypeName(device.type(), /*lower_case=*/true);
  if (device.has_index()) out += ":" + std::to_string(static_cast<int>(device.index()));
  return out;
}

// "Float", "Double", "Long"...: c10's name of the dtype (a C string).
inline const char* dtype_str(at::ScalarType t) { return c10::toString(t); }

inline bool is_supported_float(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
}

// Accumulation dtype, as the reference's _acc: float64 stays float64, everything else is float32.
inline at::ScalarType acc_dtype(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

inline int storage_code(at::ScalarType t) {
  switch (t) {
    case at::kDouble:
      return kStoreDouble;
    case at::kHalf:
      return kStoreHalf;
    case at::kBFloat16:
      return kStoreBFloat16;
    default:
      return kStoreFloat;
  }
}

inline void check_float(const char* op, const char* name, const at::Tensor& t) {
  DRMOO_CHECK_TYPE(is_supported_float(t.scalar_type()), "drmoo.", op, ": ", name,
                   " must be float32, float64, float16 or bfloat16, got ", dtype_str(t.scalar_type()));
}

inline void check_device(const char* op, const char* name, const at::Tensor& t, const at::Tensor& ref) {
  DRMOO_CHECK(t.device() == ref.device(), "drmoo.", op, ": ", name, " is on ", device_str(t.device()),
              " but the other inputs are on ", device_str(ref.device()));
}

inline void check_vector(const char* op, const char* name, const at::Tensor& t, int64_t m, const at::Tensor& ref) {
  check_float(op, name, t);
  check_device(op, name, t, ref);
  DRMOO_CHECK_VALUE(t.dim() == 1 && t.size(0) == m, "drmoo.", op, ": ", name, " must have shape [", m,
                    "] (one entry per task), got ", shape_str(t));
}

inline void check_divergence(const char* op, int64_t code, double param, double lam) {
  DRMOO_CHECK_VALUE(code >= kChi2 && code <= kCressieRead, "drmoo.", op, ": unknown divergence code ", code,
                    " (0 chi2, 1 kl, 2 cvar_smooth, 3 cressie_read)");
  DRMOO_CHECK_VALUE(code != kCVaRSmooth || (param > 0.0 && param < 1.0), "drmoo.", op,
                    ": cvar_smooth needs 0 < alpha < 1, got ", param);
  DRMOO_CHECK_VALUE(code != kCressieRead || (param > 1.0 && std::isfinite(param)), "drmoo.", op,
                    ": cressie_read needs k > 1, got ", param);
  DRMOO_CHECK_VALUE(lam > 0.0, "drmoo.", op, ": lam must be > 0, got ", lam);
}

// losses [B, m] with B >= 1, eta [m], optional sample_weight [B, m], all on one device.
inline void check_dual_inputs(const char* op, const at::Tensor& losses, const at::Tensor& eta,
                              const c10::optional<at::Tensor>& sample_weight, int64_t code, double param,
                              double lam) {
  check_float(op, "losses", losses);
  DRMOO_CHECK_VALUE(losses.dim() == 2, "drmoo.", op, ": losses must be per-sample losses of shape [B, m], got ",
                    shape_str(losses));
  DRMOO_CHECK_VALUE(losses.size(0) > 0, "drmoo.", op,
                    ": empty batch (B = 0): the dual objective needs at least one sample");
  check_vector(op, "eta", eta, losses.size(1), losses);
  if (sample_weight.has_value()) {
    check_float(op, "sample_weight", *sample_weight);
    check_device(op, "sample_weight", *sample_weight, losses);
    DRMOO_CHECK_VALUE(sample_weight->sizes() == losses.sizes(), "drmoo.", op,
                      ": sample_weight must have the shape of losses ", shape_str(losses), ", got ",
                      shape_str(*sample_weight));
  }
  check_divergence(op, code, param, lam);
}

// The dual ops' inputs after validation, as both kernels (csrc/cpu/dual_cpu.cpp,
// csrc/cuda/dual_cuda.cu) consume them: losses with contiguous rows, the math dtype, and the sample
// weights (if any) converted to the math dtype, as the reference converts them before use.
struct DualInputs {
  at::Tensor losses, sample_weight;
  at::ScalarType acc;
};

// Validates the dual ops' arguments (the caller checks the device type first) and prepares them.
inline DualInputs prepare_dual_inputs(const char* op, const at::Tensor& losses, const at::Tensor& eta,
                                      const c10::optional<at::Tensor>& sample_weight, int64_t code, double param,
                                      double lam) {
  check_dual_inputs(op, losses, eta, sample_weight, code, param, lam);
  DualInputs in;
  in.losses = losses.contiguous();  // no copy (and no ATen call beyond a flag check) when contiguous
  in.acc = acc_dtype(losses.scalar_type());
  if (sample_weight.has_value()) in.sample_weight = sample_weight->to(in.acc).contiguous();
  return in;
}

// J [m, n] (m >= 1), returned as a 2-D tensor whose rows are contiguous.
inline at::Tensor check_jacobian(const char* op, const at::Tensor& J) {
  check_float(op, "J", J);
  DRMOO_CHECK_VALUE(J.dim() == 2, "drmoo.", op, ": J must be the [m, n] per-task gradient matrix, got shape ",
                    shape_str(J));
  DRMOO_CHECK_VALUE(J.size(0) >= 1, "drmoo.", op, ": J has no rows (m = 0 tasks)");
  // The kernels walk each row with unit stride and step between rows by J.stride(0).
  return J.stride(1) == 1 ? J : J.contiguous();
}

// params: tensors on J's device with J's dtype whose numels add up to n = J.size(1).
inline void check_params(const char* op, const at::Tensor& J, at::TensorList params) {
  int64_t total = 0;
  for (size_t k = 0; k < params.size(); ++k) {
    const at::Tensor& p = params[k];
    DRMOO_CHECK(p.device() == J.device(), "drmoo.", op, ": params[", k, "] is on ", device_str(p.device()),
                " but J is on ", device_str(J.device()));
    DRMOO_CHECK_TYPE(p.scalar_type() == J.scalar_type(), "drmoo.", op, ": params[", k, "] has dtype ",
                     dtype_str(p.scalar_type()), " but J has ", dtype_str(J.scalar_type()),
                     "; the compiled kernels need the parameters in J's dtype");
    total += p.numel();
  }
  DRMOO_CHECK_VALUE(total == J.size(1), "drmoo.", op, ": J has ", J.size(1),
                    " columns but the parameters hold ", total, " elements");
}

}  // namespace drmoo
