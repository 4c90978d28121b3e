// CUDA kernels of dual_forward and dual_step.  Launched on the current stream; scalars that the
// next kernel needs (z, mu, the updated eta) stay on the device, so there is no host sync.
//   dual_forward: one block per task column reduces over the batch and writes that column's weights.
//   dual_step:    the same column reduction for z at eta_t; a one-thread kernel for mu and
//                 eta_{t+1} (mu couples all tasks); an elementwise kernel for the weights at eta_{t+1}.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <torch/library.h>

#include "../checks.h"
#include "../drmoo_math.h"
#include "common.cuh"

namespace drmoo {
namespace {

// Block i: over the batch, sums of omega f*'(u) and omega f*(u) for task i (float64), then z[i]
// and objective[i]; weights[:, i] = omega f*'(u) / B when `weights` is given.
template <typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kThreads)
    dual_column_kernel(const scalar_t* __restrict__ losses, const acc_t* __restrict__ omega, int64_t batch, int64_t m,
                       const double* __restrict__ eta, acc_t lam, acc_t scale, Divergence<acc_t> div,
                       acc_t* __restrict__ z, acc_t* __restrict__ objective, acc_t* __restrict__ weights) {
  __shared__ double shared[kWarps];
  const int64_t i = blockIdx.x;
  const acc_t eta_i = static_cast<acc_t>(eta[i]);
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

// mu = min(f1, f2 / ||z w||) and eta -= gamma mu (z w), each value rounded to eta's dtype.
template <typename acc_t>
__global__ void dual_eta_kernel(const acc_t* __restrict__ z, const double* __restrict__ w, int64_t m, acc_t gamma,
                                acc_t f1, acc_t f2, int eta_code, double* __restrict__ eta, acc_t* __restrict__ mu_out) {
  double norm_sq = 0.0;
  for (int64_t i = 0; i < m; ++i) {
    const double d = static_cast<double>(z[i] * static_cast<acc_t>(w[i]));
    norm_sq += d * d;
  }
  const acc_t mu = clip_factor(f1, f2, static_cast<acc_t>(sqrt(norm_sq)));
  *mu_out = mu;
  const acc_t step = gamma * mu;
  for (int64_t i = 0; i < m; ++i) {
    const acc_t direction = z[i] * static_cast<acc_t>(w[i]);
    const double update = round_to(eta_code, static_cast<double>(step * direction));
    eta[i] = round_to(eta_code, eta[i] - update);
  }
}

// weights[b, i] = omega f*'((loss - scale eta_i) / lam) / B
template <typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kThreads)
    dual_weights_kernel(const scalar_t* __restrict__ losses, const acc_t* __restrict__ omega, int64_t batch,
                        int64_t m, const double* __restrict__ eta, acc_t lam, acc_t scale, Divergence<acc_t> div,
                        acc_t* __restrict__ weights) {
  const int64_t total = batch * m;
  const acc_t count = static_cast<acc_t>(batch);
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = idx % m;
    const acc_t u = (static_cast<acc_t>(losses[idx]) - scale * static_cast<acc_t>(eta[i])) / lam;
    const acc_t w = omega != nullptr ? omega[idx] : acc_t(1);
    weights[idx] = conj_grad(div, u) * w / count;
  }
}

DualInputs prepare(const char* op, const at::Tensor& losses, const at::Tensor& eta,
                   const c10::optional<at::Tensor>& sample_weight, int64_t code, double param, double lam) {
  check_cuda(op, losses);
  return prepare_dual_inputs(op, losses, eta, sample_weight, code, param, lam);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> dual_forward_cuda(const at::Tensor& losses_in, const at::Tensor& eta,
                                                                 double lam, double scale, int64_t code,
                                                                 double param,
                                                                 const c10::optional<at::Tensor>& sample_weight) {
  const c10::cuda::OptionalCUDAGuard guard(losses_in.device());
  DualInputs in = prepare("dual_forward", losses_in, eta, sample_weight, code, param, lam);
  const int64_t batch = in.losses.size(0), m = in.losses.size(1);
  const auto options = in.losses.options().dtype(in.acc);
  at::Tensor objective = at::empty({m}, options);
  at::Tensor grad_eta = at::empty({m}, options);
  at::Tensor weights = at::empty({batch, m}, options);
  const at::Tensor eta64 = eta.to(at::kDouble).contiguous();
  const cudaStream_t stream = current_stream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, in.losses.scalar_type(), "drmoo_dual_forward_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    dual_column_kernel<scalar_t, acc_t><<<m, kThreads, 0, stream>>>(
        in.losses.data_ptr<scalar_t>(), in.sample_weight.defined() ? in.sample_weight.data_ptr<acc_t>() : nullptr,
        batch, m, eta64.data_ptr<double>(), static_cast<acc_t>(lam), static_cast<acc_t>(scale),
        make_divergence<acc_t>(code, param), grad_eta.data_ptr<acc_t>(), objective.data_ptr<acc_t>(),
        weights.data_ptr<acc_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {objective, grad_eta, weights};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> dual_step_cuda(const at::Tensor& losses_in, at::Tensor& eta,
                                                              const at::Tensor& w, double lam, double scale,
                                                              int64_t code, double param, double gamma, double f1,
                                                              double f2,
                                                              const c10::optional<at::Tensor>& sample_weight) {
  const c10::cuda::OptionalCUDAGuard guard(losses_in.device());
  DualInputs in = prepare("dual_step", losses_in, eta, sample_weight, code, param, lam);
  const int64_t batch = in.losses.size(0), m = in.losses.size(1);
  check_vector("dual_step", "w", w, m, in.losses);
  const auto options = in.losses.options().dtype(in.acc);
  at::Tensor z = at::empty({m}, options);
  at::Tensor mu = at::empty({}, options);
  at::Tensor weights = at::empty({batch, m}, options);
  // eta is updated through a float64 work copy rounded to eta's dtype at each write (see
  // drmoo_math.h round_to); copied back at the end, on the stream.
  at::Tensor eta_work = eta.to(at::kDouble).contiguous();
  const at::Tensor w64 = w.to(at::kDouble).contiguous();
  const cudaStream_t stream = current_stream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, in.losses.scalar_type(), "drmoo_dual_step_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const auto div = make_divergence<acc_t>(code, param);
    const scalar_t* losses = in.losses.data_ptr<scalar_t>();
    const acc_t* omega = in.sample_weight.defined() ? in.sample_weight.data_ptr<acc_t>() : nullptr;
    double* eta64 = eta_work.data_ptr<double>();
    dual_column_kernel<scalar_t, acc_t><<<m, kThreads, 0, stream>>>(
        losses, omega, batch, m, eta64, static_cast<acc_t>(lam), static_cast<acc_t>(scale), div,
        z.data_ptr<acc_t>(), nullptr, nullptr);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    dual_eta_kernel<acc_t><<<1, 1, 0, stream>>>(z.data_ptr<acc_t>(), w64.data_ptr<double>(), m,
                                                 static_cast<acc_t>(gamma), static_cast<acc_t>(f1),
                                                 static_cast<acc_t>(f2), storage_code(eta.scalar_type()), eta64,
                                                 mu.data_ptr<acc_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    const int64_t blocks = std::max<int64_t>(1, std::min(ceil_div(batch * m, kThreads), resident_blocks()));
    dual_weights_kernel<scalar_t, acc_t><<<blocks, kThreads, 0, stream>>>(
        losses, omega, batch, m, eta64, static_cast<acc_t>(lam), static_cast<acc_t>(scale), div,
        weights.data_ptr<acc_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  if (!eta_work.is_same(eta)) eta.copy_(eta_work);
  return {z, mu, weights};
}

}  // namespace

TORCH_LIBRARY_IMPL(drmoo, CUDA, m) {
  m.impl("dual_forward", &dual_forward_cuda);
  m.impl("dual_step", &dual_step_cuda);
}

}  // namespace drmoo
