// CUDA kernels of dual_forward and dual_step.  Launched on the current stream, nothing waits for
// the device, and eta / w are read (and eta written) in their own dtypes inside the kernels, so
// the host adds no conversion launches.
//
// Small batches (B*m <= kFusedMaxElements, m <= kFusedThreads, e.g. B = 256, m = 8): ONE launch
// of one block does the whole op.
//   dual_forward: per-task column sums of omega f*'(u) and omega f*(u) -> z, objective, weights;
//   dual_step:    the column sums at eta_t -> z; thread 0: mu and eta_{t+1} (mu couples all tasks);
//                 then the weights at eta_{t+1}.
// Larger batches spread the column sums over m blocks: dual_forward is still one launch;
// dual_step is three (column sums, the one-thread mu/eta kernel, the elementwise weights).
#include <torch/csrc/stable/library.h>

#include <optional>
#include <tuple>

#include "../checks.h"
#include "../drmoo_math.h"
#include "common.cuh"

namespace drmoo {
namespace {

constexpr int kFusedThreads = 512;
// One block streams this many losses per pass in a few round trips to memory (at most 32 per
// thread); past it, one block per task column spreads the reduction over the device.
constexpr int64_t kFusedMaxElements = 16 * 1024;

// One thread: mu = min(f1, f2 / ||z w||) and eta -= gamma mu (z w), each value rounded to eta's
// dtype as the reference's in-place update on a tensor of that dtype.  w_at(i) is w[i] in the math
// dtype, eta_at(i) the current eta[i] (exact, as float64); the new eta is stored through `eta` and,
// when eta_next is given, kept there in the math dtype.
template <typename acc_t, typename WAt, typename EtaAt>
__device__ void update_eta(const acc_t* z, WAt w_at, EtaAt eta_at, int64_t m, acc_t gamma, acc_t f1, acc_t f2,
                           ValueRef eta, acc_t* mu_out, acc_t* eta_next) {
  double norm_sq = 0.0;
  for (int64_t i = 0; i < m; ++i) {
    const double d = static_cast<double>(z[i] * w_at(i));
    norm_sq += d * d;
  }
  const acc_t mu = clip_factor(f1, f2, static_cast<acc_t>(sqrt(norm_sq)));
  *mu_out = mu;
  const acc_t step = gamma * mu;
  for (int64_t i = 0; i < m; ++i) {
    const acc_t direction = z[i] * w_at(i);
    const double update = round_to(eta.code, static_cast<double>(step * direction));
    const double next = round_to(eta.code, eta_at(i) - update);
    store_value(eta, i, next);
    if (eta_next != nullptr) eta_next[i] = static_cast<acc_t>(next);
  }
}

// ------------------------------------------------------------------------- one block, one launch
// Thread t handles task column i = t % m and rows t / m, t / m + per_col, ... (consecutive threads
// read consecutive losses).  Column sums are deterministic: each thread's float64 partial goes to
// shared memory, then warp w adds columns w, w + 16, ...: lane l adds every 32nd partial of the
// column in order, then a fixed butterfly adds the lanes.
template <typename scalar_t, typename acc_t, bool kStep>
__global__ void __launch_bounds__(kFusedThreads)
    dual_fused_kernel(const scalar_t* __restrict__ losses, const acc_t* __restrict__ omega, int64_t batch, int m,
                      ValueRef eta, ValueRef w, acc_t lam, acc_t scale, Divergence<acc_t> div, acc_t gamma, acc_t f1,
                      acc_t f2, acc_t* __restrict__ z_out, acc_t* __restrict__ objective, acc_t* __restrict__ mu_out,
                      acc_t* __restrict__ weights) {
  __shared__ double part_grad[kFusedThreads];
  __shared__ double part_conj[kStep ? 1 : kFusedThreads];
  __shared__ acc_t eta_shared[kFusedThreads];
  __shared__ acc_t z_shared[kFusedThreads];
  // eta (exact) and w for thread 0's serial update, loaded in parallel up front.
  __shared__ double eta64_shared[kStep ? kFusedThreads : 1];
  __shared__ acc_t w_shared[kStep ? kFusedThreads : 1];
  const int tid = threadIdx.x;
  for (int i = tid; i < m; i += blockDim.x) {
    const double eta_i = load_value(eta, i);
    eta_shared[i] = static_cast<acc_t>(eta_i);
    if constexpr (kStep) {
      eta64_shared[i] = eta_i;
      w_shared[i] = static_cast<acc_t>(load_value(w, i));
    }
  }
  __syncthreads();

  const int per_col = blockDim.x / m;  // >= 1: the host launches this kernel only for m <= blockDim
  const acc_t count = static_cast<acc_t>(batch);
  double sum_grad = 0.0, sum_conj = 0.0;
  if (tid < per_col * m) {
    const int i = tid % m;
    const acc_t shift = scale * eta_shared[i];
#pragma unroll 4
    for (int64_t b = tid / m; b < batch; b += per_col) {
      const int64_t idx = b * m + i;
      const acc_t u = (static_cast<acc_t>(losses[idx]) - shift) / lam;
      const acc_t om = omega != nullptr ? omega[idx] : acc_t(1);
      const acc_t g = conj_grad(div, u) * om;
      sum_grad += static_cast<double>(g);
      if constexpr (!kStep) {
        sum_conj += static_cast<double>(conj(div, u) * om);
        weights[idx] = g / count;
      }
    }
  }
  part_grad[tid] = sum_grad;
  if constexpr (!kStep) part_conj[tid] = sum_conj;
  __syncthreads();

  const int warp = tid >> 5, lane = tid & 31, warps = blockDim.x >> 5;
  for (int i = warp; i < m; i += warps) {
    double g = 0.0, c = 0.0;
    for (int k = lane; k < per_col; k += 32) {
      g += part_grad[k * m + i];
      if constexpr (!kStep) c += part_conj[k * m + i];
    }
    g = warp_sum(g);
    if constexpr (!kStep) c = warp_sum(c);
    if (lane == 0) {
      const acc_t mean_grad = static_cast<acc_t>(g / static_cast<double>(batch));
      const acc_t z = scale * (acc_t(1) - mean_grad);
      z_out[i] = z;
      z_shared[i] = z;
      if constexpr (!kStep) {
        objective[i] = lam * static_cast<acc_t>(c / static_cast<double>(batch)) + scale * eta_shared[i];
      }
    }
  }
  if constexpr (kStep) {
    __syncthreads();
    if (tid == 0) {
      update_eta<acc_t>(
          z_shared, [=](int64_t i) { return w_shared[i]; }, [=](int64_t i) { return eta64_shared[i]; }, m, gamma, f1,
          f2, eta, mu_out, eta_shared);
    }
    __syncthreads();
    const int64_t total = batch * m;
#pragma unroll 4
    for (int64_t idx = tid; idx < total; idx += blockDim.x) {
      const int i = static_cast<int>(idx % m);
      const acc_t u = (static_cast<acc_t>(losses[idx]) - scale * eta_shared[i]) / lam;
      const acc_t om = omega != nullptr ? omega[idx] : acc_t(1);
      weights[idx] = conj_grad(div, u) * om / count;
    }
  }
}

// ------------------------------------------------------------------------- larger batches
// Block i: over the batch, sums of omega f*'(u) and omega f*(u) for task i (float64), then z[i]
// and objective[i]; weights[:, i] = omega f*'(u) / B when `weights` is given.
template <typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kThreads)
    dual_column_kernel(const scalar_t* __restrict__ losses, const acc_t* __restrict__ omega, int64_t batch, int64_t m,
                       ValueRef eta, acc_t lam, acc_t scale, Divergence<acc_t> div, acc_t* __restrict__ z,
                       acc_t* __restrict__ objective, acc_t* __restrict__ weights) {
  __shared__ double shared[kWarps];
  const int64_t i = blockIdx.x;
  const acc_t eta_i = static_cast<acc_t>(load_value(eta, i));
  const acc_t shift = scale * eta_i;
  const acc_t count = static_cast<acc_t>(batch);
  double sum_grad = 0.0, sum_conj = 0.0;
  for (int64_t b = threadIdx.x; b < batch; b += blockDim.x) {
    const int64_t idx = b * m + i;
    const acc_t u = (static_cast<acc_t>(losses[idx]) - shift) / lam;
    const acc_t w = omega != nullptr ? omega[idx] : acc_t(1);
    const acc_t g = conj_grad(div, u) * w;
    sum_grad += static_cast<double>(g);
    if (objective != nullptr) sum_conj += static_cast<double>(conj(div, u) * w);
    if (weights != nullptr) weights[idx] = g / count;
  }
  sum_grad = block_sum(sum_grad, shared);
  if (objective != nullptr) sum_conj = block_sum(sum_conj, shared);  // uniform branch
  if (threadIdx.x == 0) {
    const acc_t mean_grad = static_cast<acc_t>(sum_grad / static_cast<double>(batch));
    z[i] = scale * (acc_t(1) - mean_grad);
    if (objective != nullptr) {
      objective[i] = lam * static_cast<acc_t>(sum_conj / static_cast<double>(batch)) + scale * eta_i;
    }
  }
}

template <typename acc_t>
__global__ void dual_eta_kernel(const acc_t* __restrict__ z, ValueRef w, int64_t m, acc_t gamma, acc_t f1, acc_t f2,
                                ValueRef eta, acc_t* __restrict__ mu_out) {
  update_eta<acc_t>(
      z, [=](int64_t i) { return static_cast<acc_t>(load_value(w, i)); }, [=](int64_t i) { return load_value(eta, i); },
      m, gamma, f1, f2, eta, mu_out, nullptr);
}

// weights[b, i] = omega f*'((loss - scale eta_i) / lam) / B, eta read in its own dtype.
template <typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kThreads)
    dual_weights_kernel(const scalar_t* __restrict__ losses, const acc_t* __restrict__ omega, int64_t batch,
                        int64_t m, ValueRef eta, acc_t lam, acc_t scale, Divergence<acc_t> div,
                        acc_t* __restrict__ weights) {
  const int64_t total = batch * m;
  const acc_t count = static_cast<acc_t>(batch);
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = idx % m;
    const acc_t u = (static_cast<acc_t>(losses[idx]) - scale * static_cast<acc_t>(load_value(eta, i))) / lam;
    const acc_t w = omega != nullptr ? omega[idx] : acc_t(1);
    weights[idx] = conj_grad(div, u) * w / count;
  }
}

bool use_fused(int64_t batch, int64_t m) { return m <= kFusedThreads && batch * m <= kFusedMaxElements; }

// The dual ops' inputs after validation (check_dual_inputs, by the caller): losses with contiguous
// rows, the math dtype, and the sample weights (if any) converted to the math dtype, as the reference
// converts them before use.
struct DualInputs {
  Tensor losses;
  std::optional<Tensor> sample_weight;
  ScalarType acc;
};

DualInputs prepare(const Tensor& losses, const std::optional<Tensor>& sample_weight) {
  DualInputs in{contiguous_or_copy(losses), std::nullopt, acc_dtype(losses.scalar_type())};
  if (sample_weight.has_value()) {
    const Tensor& given = *sample_weight;
    in.sample_weight = given.scalar_type() == in.acc && given.is_contiguous() ? given : contiguous_copy(given, in.acc);
  }
  return in;
}

// The sample weights' data in the math dtype, or nullptr when there are none.
template <typename acc_t>
const acc_t* weights_ptr(const DualInputs& in) {
  return in.sample_weight.has_value() ? in.sample_weight->const_data_ptr<acc_t>() : nullptr;
}

std::tuple<Tensor, Tensor, Tensor> dual_forward_cuda(const Tensor& losses_in, const Tensor& eta, double lam,
                                                     double scale, int64_t code, double param,
                                                     const std::optional<Tensor>& sample_weight) {
  check_cuda("dual_forward", losses_in);
  const int32_t device = losses_in.get_device_index();
  const torch::stable::accelerator::DeviceGuard guard(device);
  check_dual_inputs("dual_forward", losses_in, eta, sample_weight.has_value() ? &*sample_weight : nullptr, code,
                    param, lam, scale);
  DualInputs in = prepare(losses_in, sample_weight);
  const int64_t batch = in.losses.size(0), m = in.losses.size(1);
  Tensor objective = new_cuda_tensor({m}, in.acc, device);
  Tensor grad_eta = new_cuda_tensor({m}, in.acc, device);
  Tensor weights = new_cuda_tensor({batch, m}, in.acc, device);
  const ValueRef eta_ref = value_ref(eta);
  const cudaStream_t stream = current_stream(device);
  dispatch_floating(in.losses.scalar_type(), "dual_forward", [&](auto tag) {
    using scalar_t = typename decltype(tag)::type;
    using acc_t = opmath_t<scalar_t>;
    const scalar_t* losses = in.losses.const_data_ptr<scalar_t>();
    const acc_t* omega = weights_ptr<acc_t>(in);
    const auto div = make_divergence<acc_t>(code, param);
    if (use_fused(batch, m)) {
      dual_fused_kernel<scalar_t, acc_t, false><<<1, kFusedThreads, 0, stream>>>(
          losses, omega, batch, static_cast<int>(m), eta_ref, ValueRef{}, static_cast<acc_t>(lam),
          static_cast<acc_t>(scale), div, acc_t(0), acc_t(0), acc_t(0), grad_eta.mutable_data_ptr<acc_t>(),
          objective.mutable_data_ptr<acc_t>(), nullptr, weights.mutable_data_ptr<acc_t>());
    } else {
      dual_column_kernel<scalar_t, acc_t><<<m, kThreads, 0, stream>>>(
          losses, omega, batch, m, eta_ref, static_cast<acc_t>(lam), static_cast<acc_t>(scale), div,
          grad_eta.mutable_data_ptr<acc_t>(), objective.mutable_data_ptr<acc_t>(), weights.mutable_data_ptr<acc_t>());
    }
    DRMOO_CUDA_LAUNCH_CHECK();
  });
  return {objective, grad_eta, weights};
}

// eta is declared mutated (Tensor(a!)): the kernels write it in place.
std::tuple<Tensor, Tensor, Tensor> dual_step_cuda(const Tensor& losses_in, const Tensor& eta, const Tensor& w,
                                                  double lam, double scale, int64_t code, double param, double gamma,
                                                  double f1, double f2, const std::optional<Tensor>& sample_weight) {
  check_cuda("dual_step", losses_in);
  const int32_t device = losses_in.get_device_index();
  const torch::stable::accelerator::DeviceGuard guard(device);
  check_dual_inputs("dual_step", losses_in, eta, sample_weight.has_value() ? &*sample_weight : nullptr, code, param,
                    lam, scale);
  check_dual_step_inputs(losses_in, eta, w, sample_weight.has_value() ? &*sample_weight : nullptr, gamma, f1, f2);
  DualInputs in = prepare(losses_in, sample_weight);
  const int64_t batch = in.losses.size(0), m = in.losses.size(1);
  Tensor z = new_cuda_tensor({m}, in.acc, device);
  Tensor mu = new_cuda_tensor({}, in.acc, device);
  Tensor weights = new_cuda_tensor({batch, m}, in.acc, device);
  // eta is updated in place in its own dtype (each value rounded as drmoo_math.h round_to says).
  const ValueRef eta_ref = value_ref(eta);
  const ValueRef w_ref = value_ref(w);
  const cudaStream_t stream = current_stream(device);
  dispatch_floating(in.losses.scalar_type(), "dual_step", [&](auto tag) {
    using scalar_t = typename decltype(tag)::type;
    using acc_t = opmath_t<scalar_t>;
    const auto div = make_divergence<acc_t>(code, param);
    const scalar_t* losses = in.losses.const_data_ptr<scalar_t>();
    const acc_t* omega = weights_ptr<acc_t>(in);
    if (use_fused(batch, m)) {
      dual_fused_kernel<scalar_t, acc_t, true><<<1, kFusedThreads, 0, stream>>>(
          losses, omega, batch, static_cast<int>(m), eta_ref, w_ref, static_cast<acc_t>(lam),
          static_cast<acc_t>(scale), div, static_cast<acc_t>(gamma), static_cast<acc_t>(f1), static_cast<acc_t>(f2),
          z.mutable_data_ptr<acc_t>(), nullptr, mu.mutable_data_ptr<acc_t>(), weights.mutable_data_ptr<acc_t>());
      DRMOO_CUDA_LAUNCH_CHECK();
      return;
    }
    dual_column_kernel<scalar_t, acc_t><<<m, kThreads, 0, stream>>>(losses, omega, batch, m, eta_ref,
                                                                     static_cast<acc_t>(lam),
                                                                     static_cast<acc_t>(scale), div,
                                                                     z.mutable_data_ptr<acc_t>(), nullptr, nullptr);
    DRMOO_CUDA_LAUNCH_CHECK();
    dual_eta_kernel<acc_t><<<1, 1, 0, stream>>>(z.mutable_data_ptr<acc_t>(), w_ref, m, static_cast<acc_t>(gamma),
                                                 static_cast<acc_t>(f1), static_cast<acc_t>(f2), eta_ref,
                                                 mu.mutable_data_ptr<acc_t>());
    DRMOO_CUDA_LAUNCH_CHECK();
    const int64_t blocks = std::max<int64_t>(1, std::min(ceil_div(batch * m, kThreads), resident_blocks()));
    dual_weights_kernel<scalar_t, acc_t><<<blocks, kThreads, 0, stream>>>(
        losses, omega, batch, m, eta_ref, static_cast<acc_t>(lam), static_cast<acc_t>(scale), div,
        weights.mutable_data_ptr<acc_t>());
    DRMOO_CUDA_LAUNCH_CHECK();
  });
  return {z, mu, weights};
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(drmoo, CUDA, m) {
  m.impl("dual_forward", TORCH_BOX(&dual_forward_cuda));
  m.impl("dual_step", TORCH_BOX(&dual_step_cuda));
}

}  // namespace drmoo
