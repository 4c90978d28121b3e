// CPU kernels of gram, combine and gram_step over the per-task gradient matrix J [m, n].
//
// gram: J is read once.  Columns are cut into chunks small enough to stay in cache (m rows x a few
// thousand columns); each chunk is loaded from memory once and all m(m+1)/2 dot products are taken
// over it while it is cache-resident.  Chunk sums use the math dtype (float32, float64 for float64 J)
// and are added into float64 per-task accumulators; tasks are a fixed number of chunks, so the
// result does not depend on the thread count.
// combine: one pass over J and the parameters, params -= lr * J^T w in the math dtype.
// gram_step: gram, the m x m work on the host (drmoo_math.h), then combine unless the Gram is not
// finite, in which case nothing is written.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "../checks.h"
#include "../drmoo_math.h"

namespace drmoo {
namespace {

constexpr int64_t kChunkBytes = 64 * 1024;  // math-dtype bytes of one chunk (all m rows)
constexpr int64_t kChunksPerTask = 8;       // chunks per parallel task (fixed: deterministic sums)
constexpr int64_t kCombineGrain = 16384;    // columns per parallel task of the update pass
constexpr int64_t kCombineBlock = 512;      // columns per inner block of the update pass

int64_t chunk_columns(int64_t m, int64_t elem_bytes) {
  const int64_t cols = kChunkBytes / (m * elem_bytes) / 64 * 64;
  return std::clamp<int64_t>(cols, 64, 4096);
}

// out[k] += x . y[k] for K rows y at once, so that x is loaded once per K products.  The simd
// reduction pragma lets the compiler vectorize the sums (it may reassociate them).
template <int K, typename T>
inline void dot_rows(const T* x, const T* const* y, int64_t len, double* out) {
  const T* y0 = y[0];
  const T* y1 = y[K > 1 ? 1 : 0];
  const T* y2 = y[K > 2 ? 2 : 0];
  const T* y3 = y[K > 3 ? 3 : 0];
  T a0 = 0, a1 = 0, a2 = 0, a3 = 0;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
  for (int64_t c = 0; c < len; ++c) {
    const T xv = x[c];
    a0 += xv * y0[c];
    if constexpr (K > 1) a1 += xv * y1[c];
    if constexpr (K > 2) a2 += xv * y2[c];
    if constexpr (K > 3) a3 += xv * y3[c];
  }
  out[0] += static_cast<double>(a0);
  if constexpr (K > 1) out[1] += static_cast<double>(a1);
  if constexpr (K > 2) out[2] += static_cast<double>(a2);
  if constexpr (K > 3) out[3] += static_cast<double>(a3);
}

// acc[p] += chunk dot product of pair p = (i, j), i <= j, in pair_from_index order.
template <typename T>
void chunk_gram(const T* const* rows, int64_t m, int64_t len, double* acc) {
  int64_t p = 0;
  for (int64_t i = 0; i < m; ++i) {
    int64_t j = i;
    for (; j + 4 <= m; j += 4, p += 4) dot_rows<4>(rows[i], rows + j, len, acc + p);
    switch (m - j) {
      case 3:
        dot_rows<3>(rows[i], rows + j, len, acc + p);
        break;
      case 2:
        dot_rows<2>(rows[i], rows + j, len, acc + p);
        break;
      case 1:
        dot_rows<1>(rows[i], rows + j, len, acc + p);
        break;
      default:
        break;
    }
    p += m - j;
  }
}

// The m(m+1)/2 Gram entries of J (row stride ld) as float64 sums.
template <typename scalar_t>
std::vector<double> gram_sums(const scalar_t* J, int64_t ld, int64_t m, int64_t n) {
  using acc_t = at::opmath_type<scalar_t>;
  constexpr bool convert = !std::is_same_v<scalar_t, acc_t>;
  const int64_t pairs = m * (m + 1) / 2;
  const int64_t cols = chunk_columns(m, sizeof(acc_t));
  const int64_t chunks = (n + cols - 1) / cols;
  const int64_t tasks = (chunks + kChunksPerTask - 1) / kChunksPerTask;
  std::vector<double> partial(static_cast<size_t>(tasks * pairs), 0.0);
  at::parallel_for(0, tasks, 1, [&](int64_t first, int64_t last) {
    std::vector<acc_t> buffer(convert ? static_cast<size_t>(m * cols) : 0);
    std::vector<const acc_t*> rows(m);
    for (int64_t t = first; t < last; ++t) {
      const int64_t chunk_end = std::min(chunks, (t + 1) * kChunksPerTask);
      for (int64_t c = t * kChunksPerTask; c < chunk_end; ++c) {
        const int64_t col0 = c * cols;
        const int64_t len = std::min(cols, n - col0);
        for (int64_t i = 0; i < m; ++i) {
          const scalar_t* src = J + i * ld + col0;
          if constexpr (convert) {
            acc_t* dst = buffer.data() + i * cols;
            for (int64_t k = 0; k < len; ++k) dst[k] = static_cast<acc_t>(src[k]);
            rows[i] = dst;
          } else {
            rows[i] = src;
          }
        }
        chunk_gram(rows.data(), m, len, partial.data() + t * pairs);
      }
    }
  });
  std::vector<double> sums(pairs, 0.0);
  for (int64_t t = 0; t < tasks; ++t) {
    for (int64_t p = 0; p < pairs; ++p) sums[p] += partial[t * pairs + p];
  }
  return sums;
}

// Gram tensor [m, m] in the math dtype from the pair sums.
template <typename acc_t>
void fill_gram(const std::vector<double>& sums, int64_t m, acc_t* out) {
  int64_t p = 0;
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = i; j < m; ++j, ++p) {
      out[i * m + j] = static_cast<acc_t>(sums[p]);
      out[j * m + i] = out[i * m + j];
    }
  }
}

// params -= lr * J^T w, parameter by parameter (J's columns follow the parameters' order).
template <typename scalar_t>
void combine_impl(const scalar_t* J, int64_t ld, int64_t m, const std::vector<at::opmath_type<scalar_t>>& w,
                  at::TensorList params, at::opmath_type<scalar_t> lr) {
  using acc_t = at::opmath_type<scalar_t>;
  int64_t offset = 0;
  for (const at::Tensor& param : params) {
    const int64_t count = param.numel();
    if (count == 0) continue;
    // A non-contiguous parameter is updated through a contiguous copy that is written back.
    at::Tensor target = param.is_contiguous() ? param : param.contiguous();
    scalar_t* out = target.data_ptr<scalar_t>();
    const scalar_t* J_cols = J + offset;
    at::parallel_for(0, count, kCombineGrain, [&](int64_t first, int64_t last) {
      acc_t d[kCombineBlock];
      for (int64_t c0 = first; c0 < last; c0 += kCombineBlock) {
        const int64_t len = std::min(kCombineBlock, last - c0);
        const scalar_t* row = J_cols + c0;
        for (int64_t k = 0; k < len; ++k) d[k] = w[0] * static_cast<acc_t>(row[k]);
        for (int64_t i = 1; i < m; ++i) {
          row = J_cols + i * ld + c0;
          const acc_t wi = w[i];
          for (int64_t k = 0; k < len; ++k) d[k] += wi * static_cast<acc_t>(row[k]);
        }
        scalar_t* dst = out + c0;
        for (int64_t k = 0; k < len; ++k) dst[k] = static_cast<scalar_t>(static_cast<acc_t>(dst[k]) - lr * d[k]);
      }
    });
    if (!target.is_same(param)) param.copy_(target);
    offset += count;
  }
}

template <typename acc_t>
std::vector<acc_t> to_acc_vector(const at::Tensor& t) {
  const at::Tensor t64 = t.to(at::kDouble).contiguous();
  const double* src = t64.data_ptr<double>();
  return std::vector<acc_t>(src, src + t64.numel());
}

void check_cpu(const char* op, const at::Tensor& J) {
  TORCH_CHECK(J.device().is_cpu(), "drmoo.", op, ": the CPU kernel got tensors on ", J.device());
}

double scalar_value(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK_VALUE(t.numel() == 1, "drmoo.", op, ": ", name, " must hold one value, got shape ", t.sizes());
  return t.item<double>();
}

at::Tensor gram_cpu(const at::Tensor& J_in) {
  const at::Tensor J = check_jacobian("gram", J_in);
  check_cpu("gram", J);
  const int64_t m = J.size(0), n = J.size(1);
  at::Tensor out = at::empty({m, m}, J.options().dtype(acc_dtype(J.scalar_type())));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, J.scalar_type(), "drmoo_gram_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    fill_gram(gram_sums(J.data_ptr<scalar_t>(), J.stride(0), m, n), m, out.data_ptr<acc_t>());
  });
  return out;
}

void combine_cpu(const at::Tensor& J_in, const at::Tensor& w, at::TensorList params, const at::Tensor& lr) {
  const at::Tensor J = check_jacobian("combine", J_in);
  check_cpu("combine", J);
  const int64_t m = J.size(0);
  check_vector("combine", "w", w, m, J);
  check_params("combine", J, params);
  const double lr_value = scalar_value("combine", "lr", lr);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, J.scalar_type(), "drmoo_combine_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    combine_impl<scalar_t>(J.data_ptr<scalar_t>(), J.stride(0), m, to_acc_vector<acc_t>(w), params,
                           static_cast<acc_t>(lr_value));
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> gram_step_cpu(const at::Tensor& J_in, at::Tensor& w,
                                                             at::TensorList params, double gamma, double c1,
                                                             double c2, double beta, double rho,
                                                             const at::Tensor& mu, const at::Tensor& z) {
  const at::Tensor J = check_jacobian("gram_step", J_in);
  check_cpu("gram_step", J);
  const int64_t m = J.size(0), n = J.size(1);
  check_vector("gram_step", "w", w, m, J);
  check_vector("gram_step", "z", z, m, J);
  check_params("gram_step", J, params);
  const double mu_value = scalar_value("gram_step", "mu", mu);
  at::Tensor gram = at::empty({m, m}, J.options().dtype(acc_dtype(J.scalar_type())));
  GramStepResult result{};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, J.scalar_type(), "drmoo_gram_step_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* J_ptr = J.data_ptr<scalar_t>();
    acc_t* G = gram.data_ptr<acc_t>();
    fill_gram(gram_sums(J_ptr, J.stride(0), m, n), m, G);

    // The m x m work in float64 on the Gram's rounded values, as the reference does.
    const std::vector<acc_t> w_acc = to_acc_vector<acc_t>(w);  // the incoming w, for the theta step
    std::vector<double> w64 = to_acc_vector<double>(w);
    const std::vector<double> z64 = to_acc_vector<double>(z);
    std::vector<double> scratch(2 * m);
    auto gram_at = [&](int64_t i, int64_t j) { return static_cast<double>(G[i * m + j]); };
    result = gram_step_small(m, gram_at, w64.data(), z64.data(), mu_value, c1, c2, beta, rho, scratch.data());
    if (!result.finite) return;  // the no-write guard: params and w keep their values

    combine_impl<scalar_t>(J_ptr, J.stride(0), m, w_acc, params, static_cast<acc_t>(gamma * result.alpha));
    w.copy_(at::from_blob(w64.data(), {m}, at::TensorOptions().dtype(at::kDouble)));
  });
  const auto scalar_options = J.options().dtype(at::kFloat);
  return {gram, at::scalar_tensor(result.d_norm, scalar_options), at::scalar_tensor(result.alpha, scalar_options)};
}

}  // namespace

TORCH_LIBRARY_IMPL(drmoo, CPU, m) {
  m.impl("gram", &gram_cpu);
  m.impl("combine", &combine_cpu);
  m.impl("gram_step", &gram_step_cpu);
}

}  // namespace drmoo
