// CPU kernels of dual_forward and dual_step: one pass over the [B, m] losses per eta value.
// Written against torch's stable ABI (see cpu_util.h).
#include <torch/csrc/stable/library.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <tuple>
#include <vector>

#include "../checks.h"
#include "../drmoo_math.h"
#include "cpu_util.h"

namespace drmoo {
namespace {

// Rows per parallel task.  Fixed (not derived from the thread count) so that the order of the
// floating-point sums, and hence the result, is the same whatever the number of threads.
constexpr int64_t kRowsPerTask = 1024;
// A second thread joins only when each thread gets at least this many loss entries (~50-100 us of
// work): below that, its wake-up and the join cost more than they save (see cpu_util.h).
constexpr int64_t kMinEntriesPerThread = 64 * 1024;

// Over the batch, per task i, with u = (loss - scale*eta) / lam and omega the sample weight:
//   sum_grad[i] = sum_b omega f*'(u),  sum_conj[i] = sum_b omega f*(u)  (float64 accumulators),
// and weights[b, i] = omega f*'(u) / B when `weights` is given.
template <typename scalar_t, typename acc_t>
void dual_pass(const scalar_t* losses, const acc_t* sample_weight, int64_t batch, int64_t m, const acc_t* eta,
               acc_t lam, acc_t scale, const Divergence<acc_t>& div, double* sum_grad, double* sum_conj,
               acc_t* weights) {
  std::vector<acc_t> shift(m);
  for (int64_t i = 0; i < m; ++i) shift[i] = scale * eta[i];
  const int64_t tasks = (batch + kRowsPerTask - 1) / kRowsPerTask;
  std::vector<double> partial(static_cast<size_t>(tasks * 2 * m), 0.0);
  const acc_t count = static_cast<acc_t>(batch);
  run_tasks(tasks, tasks_for(kMinEntriesPerThread, kRowsPerTask * m), [&](int64_t t) {
    // Accumulate in task-local memory and store once: neighbouring tasks' partials share cache
    // lines, and two threads updating them per element would keep stealing the lines.
    std::vector<double> local(static_cast<size_t>(2 * m), 0.0);
    double* grad_acc = local.data();
    double* conj_acc = grad_acc + m;
    const int64_t row_end = std::min(batch, (t + 1) * kRowsPerTask);
    for (int64_t b = t * kRowsPerTask; b < row_end; ++b) {
      const int64_t row = b * m;
      for (int64_t i = 0; i < m; ++i) {
        const acc_t u = (static_cast<acc_t>(losses[row + i]) - shift[i]) / lam;
        const acc_t omega = sample_weight != nullptr ? sample_weight[row + i] : acc_t(1);
        const acc_t g = conj_grad(div, u) * omega;
        grad_acc[i] += static_cast<double>(g);
        if (sum_conj != nullptr) conj_acc[i] += static_cast<double>(conj(div, u) * omega);
        if (weights != nullptr) weights[row + i] = g / count;
      }
    }
    std::copy(local.begin(), local.end(), partial.begin() + t * 2 * m);
  });
  for (int64_t i = 0; i < m; ++i) {
    double g = 0.0, c = 0.0;
    for (int64_t t = 0; t < tasks; ++t) {
      g += partial[t * 2 * m + i];
      c += partial[t * 2 * m + m + i];
    }
    sum_grad[i] = g;
    if (sum_conj != nullptr) sum_conj[i] = c;
  }
}

// The dual ops' inputs after validation: losses with contiguous rows, the math dtype, and the
// sample weights (if any) converted to the math dtype, as the reference converts them before use.
struct DualInputs {
  Tensor losses;
  std::optional<Tensor> sample_weight;
  ScalarType acc;
};

// Checks every argument of a dual op (check_dual_inputs; the sample weights' values too) before
// anything is converted or written.
void check_dual_cpu(const char* op, const Tensor& losses, const Tensor& eta, const std::optional<Tensor>& sample_weight,
                    int64_t code, double param, double lam, double scale) {
  check_cpu(op, losses);
  check_dual_inputs(op, losses, eta, sample_weight.has_value() ? &*sample_weight : nullptr, code, param, lam, scale);
  if (sample_weight.has_value()) check_sample_weight_values(op, *sample_weight);
}

// The checked inputs with contiguous rows, in the math dtype.
DualInputs prepare(const Tensor& losses, const std::optional<Tensor>& sample_weight) {
  DualInputs in{losses.is_contiguous() ? losses : contiguous_copy(losses, losses.scalar_type()), std::nullopt,
                acc_dtype(losses.scalar_type())};
  if (sample_weight.has_value()) {
    const Tensor& given = *sample_weight;
    in.sample_weight =
        given.scalar_type() == in.acc && given.is_contiguous() ? given : contiguous_copy(given, in.acc);
  }
  return in;
}

// The sample weights' data in the math dtype, or nullptr when there are none.
template <typename acc_t>
const acc_t* weights_ptr(const DualInputs& in) {
  return in.sample_weight.has_value() ? in.sample_weight->const_data_ptr<acc_t>() : nullptr;
}

std::tuple<Tensor, Tensor, Tensor> dual_forward_cpu(const Tensor& losses_in, const Tensor& eta, double lam,
                                                    double scale, int64_t code, double param,
                                                    const std::optional<Tensor>& sample_weight) {
  check_dual_cpu("dual_forward", losses_in, eta, sample_weight, code, param, lam, scale);
  DualInputs in = prepare(losses_in, sample_weight);
  const int64_t batch = in.losses.size(0), m = in.losses.size(1);
  Tensor objective = new_cpu_tensor({m}, in.acc);
  Tensor grad_eta = new_cpu_tensor({m}, in.acc);
  Tensor weights = new_cpu_tensor({batch, m}, in.acc);
  std::vector<double> eta64(m);
  read_f64(eta, eta64.data());
  dispatch_floating(in.losses.scalar_type(), "dual_forward", [&](auto tag) {
    using scalar_t = typename decltype(tag)::type;
    using acc_t = opmath_t<scalar_t>;
    const auto div = make_divergence<acc_t>(code, param);
    std::vector<double> sum_grad(m), sum_conj(m);
    // eta in the math dtype, rounded once as the reference's eta.to(acc) rounds it
    std::vector<acc_t> eta_acc(eta64.begin(), eta64.end());
    const acc_t* eta_ptr = eta_acc.data();
    dual_pass<scalar_t, acc_t>(in.losses.const_data_ptr<scalar_t>(), weights_ptr<acc_t>(in), batch, m, eta_ptr,
                               static_cast<acc_t>(lam), static_cast<acc_t>(scale), div, sum_grad.data(),
                               sum_conj.data(), weights.mutable_data_ptr<acc_t>());
    acc_t* obj = objective.mutable_data_ptr<acc_t>();
    acc_t* z = grad_eta.mutable_data_ptr<acc_t>();
    for (int64_t i = 0; i < m; ++i) {
      const acc_t mean_conj = static_cast<acc_t>(sum_conj[i] / static_cast<double>(batch));
      const acc_t mean_grad = static_cast<acc_t>(sum_grad[i] / static_cast<double>(batch));
      obj[i] = static_cast<acc_t>(lam) * mean_conj + static_cast<acc_t>(scale) * eta_ptr[i];
      z[i] = static_cast<acc_t>(scale) * (acc_t(1) - mean_grad);
    }
  });
  return {objective, grad_eta, weights};
}

// eta is declared mutated (Tensor(a!)): its values are written through its data pointer.
std::tuple<Tensor, Tensor, Tensor> dual_step_cpu(const Tensor& losses_in, const Tensor& eta, const Tensor& w,
                                                 double lam, double scale, int64_t code, double param, double gamma,
                                                 double f1, double f2, const std::optional<Tensor>& sample_weight) {
  check_dual_cpu("dual_step", losses_in, eta, sample_weight, code, param, lam, scale);
  check_dual_step_inputs(losses_in, eta, w, sample_weight.has_value() ? &*sample_weight : nullptr, gamma, f1, f2);
  DualInputs in = prepare(losses_in, sample_weight);
  const int64_t batch = in.losses.size(0), m = in.losses.size(1);
  Tensor z_out = new_cpu_tensor({m}, in.acc);
  Tensor mu_out = new_cpu_tensor({}, in.acc);
  Tensor weights = new_cpu_tensor({batch, m}, in.acc);
  // eta is updated through a float64 copy whose values are rounded to eta's dtype at each write,
  // i.e. exactly the values an in-place update of eta itself would hold.
  std::vector<double> eta_work(m), w_work(m);
  read_f64(eta, eta_work.data());
  read_f64(w, w_work.data());
  const int eta_code = storage_code(eta.scalar_type());
  dispatch_floating(in.losses.scalar_type(), "dual_step", [&](auto tag) {
    using scalar_t = typename decltype(tag)::type;
    using acc_t = opmath_t<scalar_t>;
    const auto div = make_divergence<acc_t>(code, param);
    const scalar_t* losses = in.losses.const_data_ptr<scalar_t>();
    const acc_t* omega = weights_ptr<acc_t>(in);
    double* eta64 = eta_work.data();
    const double* w64 = w_work.data();
    std::vector<acc_t> eta_acc(m), direction(m);
    std::vector<double> sum_grad(m);
    for (int64_t i = 0; i < m; ++i) eta_acc[i] = static_cast<acc_t>(eta64[i]);

    // Steps 1-2: z at eta_t, the clipped step mu, eta_{t+1}.
    dual_pass<scalar_t, acc_t>(losses, omega, batch, m, eta_acc.data(), static_cast<acc_t>(lam),
                               static_cast<acc_t>(scale), div, sum_grad.data(), nullptr, nullptr);
    acc_t* z = z_out.mutable_data_ptr<acc_t>();
    double norm_sq = 0.0;
    for (int64_t i = 0; i < m; ++i) {
      const acc_t mean_grad = static_cast<acc_t>(sum_grad[i] / static_cast<double>(batch));
      z[i] = static_cast<acc_t>(scale) * (acc_t(1) - mean_grad);
      direction[i] = z[i] * static_cast<acc_t>(w64[i]);
      norm_sq += static_cast<double>(direction[i]) * static_cast<double>(direction[i]);
    }
    const acc_t mu = clip_factor(static_cast<acc_t>(f1), static_cast<acc_t>(f2),
                                 static_cast<acc_t>(std::sqrt(norm_sq)));
    *mu_out.mutable_data_ptr<acc_t>() = mu;
    const acc_t step = static_cast<acc_t>(gamma) * mu;
    for (int64_t i = 0; i < m; ++i) {
      const double update = round_to(eta_code, static_cast<double>(step * direction[i]));
      eta64[i] = round_to(eta_code, eta64[i] - update);
      eta_acc[i] = static_cast<acc_t>(eta64[i]);
    }

    // Step 3's weights at eta_{t+1}.
    dual_pass<scalar_t, acc_t>(losses, omega, batch, m, eta_acc.data(), static_cast<acc_t>(lam),
                               static_cast<acc_t>(scale), div, sum_grad.data(), nullptr,
                               weights.mutable_data_ptr<acc_t>());
  });
  write_f64(eta, eta_work.data());
  return {z_out, mu_out, weights};
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(drmoo, CPU, m) {
  m.impl("dual_forward", TORCH_BOX(&dual_forward_cpu));
  m.impl("dual_step", TORCH_BOX(&dual_step_cpu));
}

}  // namespace drmoo
