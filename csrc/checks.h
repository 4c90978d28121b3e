// Input validation shared by the CPU and the CUDA kernels (both on torch's stable ABI:
// torch::stable::Tensor): what a direct torch.ops.drmoo.* call meets.  The
// rules are drmoo_kernels/_checks.py's (the backends' Python checker, which the fake kernels share),
// with the same messages, so that a direct call is refused like a call through a backend:
//   - metadata: shapes, dtypes, devices;
//   - the scalar arguments' values (finite, > 0 or >= 0) and the divergence's parameter range;
//   - memory: a tensor the op writes has no two elements at one address (no stride 0) and shares no
//     memory with another argument (params with each other, with J, w, z, lr or mu; eta with losses,
//     w or sample_weight; w with J or z), so every update is applied once, after everything passed.
// Tensor *values* (sample_weight, the one-value tensors lr and mu) are checked by the CPU kernels,
// which read them anyway; the CUDA kernels do not read them on the host (that would synchronise the
// device on every call and break CUDA-graph capture), as the Python checker does not while
// capturing.
//
// The checks are templates over the tensor type (written when the CUDA kernels were on at::Tensor):
// a tensor class that answers dim(), size(), stride(), numel(), data_ptr(), element_size(),
// scalar_type() and device() (whose type() and index() are torch/headeronly enums) will do, and
// nothing here includes ATen, so the stable builds can use this file.
//
// Every failed check throws std::runtime_error, which torch reports as a Python RuntimeError: the
// stable ABI has no ValueError/TypeError (STD_TORCH_CHECK is a RuntimeError too), and the CUDA
// kernels raise the same type so that a direct torch.ops.drmoo.* call fails alike on every device.
// The documented ValueError/TypeError of the backends' Python wrappers are raised by the wrappers
// before they call the ops.  Everything is checked before the kernels call into torch (contiguous,
// to, copy_): an error from such a nested call would reach the user under torch 2.11 as
// "torch_call_dispatcher(...) API call failed" and under later torches behind a C++ backtrace.
#pragma once

#include <torch/headeronly/core/DeviceType.h>
#include <torch/headeronly/core/ScalarType.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

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

// The divergences' parameter ranges: those where the float32 kernels keep the divergence's meaning
// (drmoo_kernels/divergences.py holds the same numbers and explains them).  Below alpha = 1e-6 the
// smoothed CVaR's weights sigmoid(u + log(alpha / (1 - alpha))) / alpha underflow to 0 in float32;
// for k - 1 < 1e-3 Cressie-Read's base 1 + (k - 1) u rounds towards 1 (k = 1 + 1e-8: plain ERM), and
// above k = 1e4 the scaled argument (k - 1) u overflows (k = 1e308: NaN).
constexpr double kMinCVaRAlpha = 1e-6;
constexpr double kMinCressieK = 1.001;
constexpr double kMaxCressieK = 1e4;

// A scalar argument: finite and > 0 (>= 0 with allow_zero), as _checks.check_positive says it.
inline void check_number(const char* op, const char* name, double value, bool allow_zero = false) {
  const bool in_range = allow_zero ? value >= 0.0 : value > 0.0;  // NaN fails both
  DRMOO_CHECK(in_range && std::isfinite(value), "drmoo.", op, ": ", name, " must be finite and ",
              allow_zero ? ">= 0" : "> 0", ", got ", value);
}

inline void check_divergence(const char* op, int64_t code, double param, double lam) {
  DRMOO_CHECK(code >= kChi2 && code <= kCressieRead, "drmoo.", op, ": unknown divergence code ", code,
              " (0 chi2, 1 kl, 2 cvar_smooth, 3 cressie_read)");
  DRMOO_CHECK(code != kCVaRSmooth || (param >= kMinCVaRAlpha && param < 1.0), "drmoo.", op,
              ": invalid alpha=", param,
              " for divergence 'cvar_smooth': need 1e-06 <= alpha < 1 (the divergence needs 0 < alpha < 1; below "
              "1e-06 float32 loses its meaning)");
  DRMOO_CHECK(code != kCressieRead || (param >= kMinCressieK && param <= kMaxCressieK), "drmoo.", op,
              ": invalid k=", param,
              " for divergence 'cressie_read': need 1.001 <= k <= 10000 (the divergence needs k > 1; outside this "
              "range float32 loses its meaning)");
  check_number(op, "lam", lam);
}

// ------------------------------------------------------------------------------------------ memory
// The bytes [begin, end) that a tensor's elements span (empty without elements), and whether two of
// its elements share an address for sure: a dimension of size > 1 with stride 0 (what expand() gives;
// torch's own "internal overlap" test says yes in exactly these cases).  Two tensors whose spans
// intersect are treated as sharing memory (interleaved views of one buffer, which touch different
// elements, are refused too: the conservative rule, as torch's is for overlaps it cannot decide).
// One pass over sizes() and strides(): these checks run on every call (an optimizer step's combine
// walks every parameter), and each query of a stable-ABI tensor is a call into libtorch.
struct Layout {
  uintptr_t begin = 0, end = 0;
  bool repeats_elements = false;
  bool empty() const { return begin == end; }
  bool intersects(const Layout& other) const {
    return !empty() && !other.empty() && begin < other.end && other.begin < end;
  }
};

inline int64_t float_bytes(ScalarType t) {
  return t == ScalarType::Double ? 8 : (t == ScalarType::Float ? 4 : 2);  // the four floating dtypes
}

// `t` holds one of the four floating dtypes (checked before).
template <typename Tensor>
Layout layout_of(const Tensor& t) {
  const auto sizes = t.sizes();
  const auto strides = t.strides();
  Layout layout;
  int64_t last = 0;  // the offset of the last element, in elements (torch's strides are >= 0)
  for (size_t k = 0; k < sizes.size(); ++k) {
    if (sizes[k] == 0) return {};
    if (sizes[k] > 1 && strides[k] == 0) layout.repeats_elements = true;
    last += (sizes[k] - 1) * strides[k];
  }
  layout.begin = reinterpret_cast<uintptr_t>(t.data_ptr());
  layout.end = layout.begin + static_cast<uintptr_t>((last + 1) * float_bytes(t.scalar_type()));
  return layout;
}

// `t` (shape `shape`) is written in place: none of its elements may share an address.
inline void check_writable(const char* op, const std::string& name, const Layout& layout, const std::string& shape) {
  DRMOO_CHECK(!layout.repeats_elements, "drmoo.", op, ": ", name,
              " is written in place, but several of its elements share memory (an expanded or stride-0 tensor, "
              "shape ", shape, "); pass ", name, ".clone()");
}

template <typename Tensor>
void check_writable(const char* op, const std::string& name, const Tensor& t) {
  const Layout layout = layout_of(t);
  if (layout.repeats_elements) check_writable(op, name, layout, shape_str(t));
}

// Another argument of the op, as the alias checks see it.
struct Input {
  const char* name;
  Layout layout;
  bool on_device;  // on the written tensors' device: addresses on different devices (a CPU lr beside
                   // CUDA parameters) never refer to the same memory
};

template <typename Tensor>
Input input(const char* name, const Tensor& t, const Tensor& ref) {
  return {name, layout_of(t), same_device(t, ref)};
}

// `written` (written in place) shares no memory with `other`.
inline void check_no_alias(const char* op, const std::string& written_name, const Layout& written, const Input& other) {
  DRMOO_CHECK(!other.on_device || !written.intersects(other.layout), "drmoo.", op, ": ", written_name,
              " shares memory with ", other.name, "; the op writes ", written_name, " while it reads ", other.name,
              ": pass a copy (.clone()) of one of them");
}

// ------------------------------------------------------------------------------------- arguments
// losses [B, m] with B >= 1, eta [m], optional sample_weight [B, m], all on one device; lam, scale and
// the divergence in range.
template <typename Tensor>
void check_dual_inputs(const char* op, const Tensor& losses, const Tensor& eta, const Tensor* sample_weight,
                       int64_t code, double param, double lam, double scale) {
  check_float(op, "losses", losses);
  DRMOO_CHECK(losses.dim() == 2, "drmoo.", op, ": losses must be per-sample losses of shape [B, m], got ",
              shape_str(losses));
  DRMOO_CHECK(losses.size(0) > 0, "drmoo.", op, ": empty batch (B = 0): the dual objective needs at least one sample");
  DRMOO_CHECK(losses.size(1) > 0, "drmoo.", op, ": losses have no task columns (m = 0)");
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
  check_number(op, "scale", scale);
}

// dual_step's further arguments, after check_dual_inputs: w [m]; gamma >= 0, f1, f2 > 0; eta
// (written in place) without repeated elements and sharing memory with no input.
template <typename Tensor>
void check_dual_step_inputs(const Tensor& losses, const Tensor& eta, const Tensor& w, const Tensor* sample_weight,
                            double gamma, double f1, double f2) {
  const char* op = "dual_step";
  check_vector(op, "w", w, losses.size(1), losses);
  check_number(op, "gamma", gamma, /*allow_zero=*/true);
  check_number(op, "f1", f1);
  check_number(op, "f2", f2);
  check_writable(op, "eta", eta);
  const Layout eta_layout = layout_of(eta);
  check_no_alias(op, "eta", eta_layout, input("losses", losses, eta));
  check_no_alias(op, "eta", eta_layout, input("w", w, eta));
  if (sample_weight != nullptr) check_no_alias(op, "eta", eta_layout, input("sample_weight", *sample_weight, eta));
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

// mu, lr: one floating value, on J's device or the CPU (the kernels move a CPU value themselves).
template <typename Tensor>
void check_one_value(const char* op, const char* name, const Tensor& t, const Tensor& ref) {
  check_float(op, name, t);
  DRMOO_CHECK(t.numel() == 1, "drmoo.", op, ": ", name, " must hold one value, got shape ", shape_str(t));
  DRMOO_CHECK(same_device(t, ref) || t.device().type() == DeviceType::CPU, "drmoo.", op, ": ", name, " is on ",
              device_str(t.device()), " but the other inputs are on ", device_str(ref.device()));
}

inline std::string indexed(const char* name, size_t index) { return message::concat(name, "[", index, "]"); }

// params (written in place): tensors on J's device with J's dtype whose numels add up to n = J.size(1),
// none with repeated elements, none sharing memory with another parameter or with `inputs` (the
// op's other tensor arguments).  All of it before the first write.
template <typename Tensor, typename TensorList>
void check_params(const char* op, const Tensor& J, const TensorList& params, std::initializer_list<Input> inputs) {
  const ScalarType dtype = J.scalar_type();
  int64_t total = 0;
  // (layout, index) of every parameter with elements
  std::vector<std::pair<Layout, size_t>> layouts;
  layouts.reserve(params.size());
  for (size_t k = 0; k < params.size(); ++k) {
    const Tensor& p = params[k];
    DRMOO_CHECK(same_device(p, J), "drmoo.", op, ": params[", k, "] is on ", device_str(p.device()),
                " but J is on ", device_str(J.device()));
    const ScalarType type = p.scalar_type();
    DRMOO_CHECK(type == dtype, "drmoo.", op, ": params[", k, "] has dtype ", dtype_str(type), " but J has ",
                dtype_str(dtype), "; the compiled kernels need the parameters in J's dtype");
    total += p.numel();
    const Layout layout = layout_of(p);
    if (layout.repeats_elements) check_writable(op, indexed("params", k), layout, shape_str(p));
    if (!layout.empty()) layouts.emplace_back(layout, k);
  }
  DRMOO_CHECK(total == J.size(1), "drmoo.", op, ": J has ", J.size(1), " columns but the parameters hold ", total,
              " elements");
  for (const auto& [layout, k] : layouts) {
    for (const Input& other : inputs) {
      if (other.on_device && layout.intersects(other.layout)) check_no_alias(op, indexed("params", k), layout, other);
    }
  }
  // Sorted by start, two spans intersect iff one starts before the furthest end so far.
  std::sort(layouts.begin(), layouts.end(), [](const auto& a, const auto& b) {
    return a.first.begin != b.first.begin ? a.first.begin < b.first.begin : a.second < b.second;
  });
  for (size_t s = 1, widest = 0; s < layouts.size(); ++s) {
    const auto& [layout, k] = layouts[s];
    const auto& [earlier, j] = layouts[widest];
    if (layout.begin < earlier.end) {
      const size_t first = std::min(j, k), second = std::max(j, k);
      const bool same = layout.begin == earlier.begin && layout.end == earlier.end;
      DRMOO_CHECK(!same, "drmoo.", op, ": params[", second, "] is params[", first,
                  "] again (the same memory): it would be updated twice");
      DRMOO_CHECK(false, "drmoo.", op, ": params[", second, "] and params[", first,
                  "] share memory (overlapping views of one tensor): the shared elements would be updated twice");
    }
    if (layout.end > earlier.end) widest = s;
  }
}

// combine's arguments: J [m, n] (validated by the caller), w [m], lr, params.
template <typename Tensor, typename TensorList>
void check_combine_inputs(const Tensor& J, const Tensor& w, const TensorList& params, const Tensor& lr) {
  const char* op = "combine";
  check_vector(op, "w", w, J.size(0), J);
  check_one_value(op, "lr", lr, J);
  check_params(op, J, params, {input("J", J, J), input("w", w, J), input("lr", lr, J)});
}

// gram_step's arguments: J (validated by the caller), w [m] and z [m], mu, the scalars, params; w is
// written in place too.
template <typename Tensor, typename TensorList>
void check_gram_step_inputs(const Tensor& J, const Tensor& w, const TensorList& params, double gamma, double c1,
                            double c2, double beta, double rho, const Tensor& mu, const Tensor& z) {
  const char* op = "gram_step";
  const int64_t m = J.size(0);
  check_vector(op, "w", w, m, J);
  check_vector(op, "z", z, m, J);
  check_one_value(op, "mu", mu, J);
  check_number(op, "gamma", gamma, /*allow_zero=*/true);
  check_number(op, "c1", c1);
  check_number(op, "c2", c2);
  check_number(op, "beta", beta, /*allow_zero=*/true);
  check_number(op, "rho", rho, /*allow_zero=*/true);
  check_writable(op, "w", w);
  const Input J_in = input("J", J, J), w_in = input("w", w, J), z_in = input("z", z, J), mu_in = input("mu", mu, J);
  check_no_alias(op, "w", w_in.layout, J_in);
  check_no_alias(op, "w", w_in.layout, z_in);
  check_no_alias(op, "w", w_in.layout, mu_in);
  check_params(op, J, params, {J_in, w_in, z_in, mu_in});
}

// sum_squares' arguments: every tensor floating, all on tensors[0]'s device (any shape, stride or size; none
// is written).
template <typename TensorList>
void check_sum_squares_inputs(const TensorList& tensors) {
  const char* op = "sum_squares";
  for (size_t k = 0; k < tensors.size(); ++k) {
    const std::string name = indexed("tensors", k);
    check_float(op, name.c_str(), tensors[k]);
    check_device(op, name.c_str(), tensors[k], tensors[0]);
  }
}

// The value of lr or mu (read by the CPU kernels, which need it on the host anyway): finite and >= 0.
inline void check_one_value_range(const char* op, const char* name, double value) {
  check_number(op, name, value, /*allow_zero=*/true);
}

}  // namespace drmoo
