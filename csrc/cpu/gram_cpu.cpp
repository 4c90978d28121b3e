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
// sum_squares: the Gram's diagonal of a list of tensors, each read once: entry i = sum of squares of
// tensors[i], chunks summed in the math dtype and added in float64 like gram's.
// Written against torch's stable ABI (see cpu_util.h).
#include <torch/csrc/stable/library.h>

#include <algorithm>
#include <tuple>
#include <type_traits>
#include <vector>

#include "../checks.h"
#include "../drmoo_math.h"
#include "cpu_util.h"

namespace drmoo {
namespace {

constexpr int64_t kChunkBytes = 64 * 1024;  // math-dtype bytes of one chunk (all m rows)
constexpr int64_t kChunksPerTask = 8;       // chunks per parallel task (fixed: deterministic sums)
constexpr int64_t kCombineGrain = 16384;    // columns per parallel task of the update pass
constexpr int64_t kCombineBlock = 512;      // columns per inner block of the update pass
// A second thread joins a pass only when each thread gets at least this many bytes of traffic
// (~50-100 us at this machine's bandwidth); for less, waking it and joining it costs more than it
// saves, and far more when the other core is busy (see cpu_util.h).
constexpr int64_t kMinBytesPerThread = 1 << 20;
// sum_squares: elements summed in the math dtype before the chunk sum joins a float64 one (the error
// bound of the tests, tests/kernels/error_bounds.py, follows this constant), and elements per parallel
// task (a multiple of the chunk: chunks start at the same offsets whatever the tasks).
constexpr int64_t kSquaresChunk = 4096;
constexpr int64_t kSquaresGrain = 16 * kSquaresChunk;

int64_t chunk_columns(int64_t m, int64_t elem_bytes) {
  const int64_t cols = kChunkBytes / (m * elem_bytes) / 64 * 64;
  return std::clamp<int64_t>(cols, 64, 4096);
}

// The inner loops, compiled twice (see gram_kernels.inc): kernels::avx2 for CPUs with AVX2, FMA and
// F16C (every CPU with AVX2 has it), kernels::base for any x86-64 (and other architectures).
namespace kernels {
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define DRMOO_HAVE_AVX2_KERNELS 1
namespace avx2 {
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define DRMOO_KERNELS_F16C 1
#include "gram_kernels.inc"
#undef DRMOO_KERNELS_F16C
#pragma GCC pop_options
}  // namespace avx2
#endif
namespace base {
#include "gram_kernels.inc"
}  // namespace base
}  // namespace kernels

bool use_avx2() {
#ifdef DRMOO_HAVE_AVX2_KERNELS
  static const bool yes =
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  return yes;
#else
  return false;
#endif
}

template <typename T>
void chunk_gram(const T* const* rows, int64_t m, int64_t len, double* acc) {
#ifdef DRMOO_HAVE_AVX2_KERNELS
  if (use_avx2()) return kernels::avx2::chunk_gram(rows, m, len, acc);
#endif
  kernels::base::chunk_gram(rows, m, len, acc);
}

template <typename S>
double squares_chunk(const S* x, int64_t len) {
#ifdef DRMOO_HAVE_AVX2_KERNELS
  if (use_avx2()) return kernels::avx2::squares_chunk(x, len);
#endif
  return kernels::base::squares_chunk(x, len);
}

template <typename scalar_t, typename acc_t>
void combine_columns(const scalar_t* J_cols, int64_t ld, int64_t m, const acc_t* w, acc_t lr, scalar_t* out,
                     int64_t first, int64_t last) {
#ifdef DRMOO_HAVE_AVX2_KERNELS
  if (use_avx2()) return kernels::avx2::combine_columns(J_cols, ld, m, w, lr, out, first, last);
#endif
  kernels::base::combine_columns(J_cols, ld, m, w, lr, out, first, last);
}

// The m(m+1)/2 Gram entries of J (row stride ld) as float64 sums.
template <typename scalar_t>
std::vector<double> gram_sums(const scalar_t* J, int64_t ld, int64_t m, int64_t n) {
  using acc_t = opmath_t<scalar_t>;
  constexpr bool convert = !std::is_same_v<scalar_t, acc_t>;
  const int64_t pairs = m * (m + 1) / 2;
  const int64_t cols = chunk_columns(m, sizeof(acc_t));
  const int64_t chunks = (n + cols - 1) / cols;
  const int64_t tasks = (chunks + kChunksPerTask - 1) / kChunksPerTask;
  std::vector<double> partial(static_cast<size_t>(tasks * pairs), 0.0);
  const int64_t task_bytes = kChunksPerTask * cols * m * static_cast<int64_t>(sizeof(scalar_t));
  run_tasks(tasks, tasks_for(kMinBytesPerThread, task_bytes), [&](int64_t t) {
    std::vector<acc_t> buffer(convert ? static_cast<size_t>(m * cols) : 0);
    std::vector<const acc_t*> rows(m);
    // Task-local sums, stored once at the end (partials of neighbouring tasks share cache lines).
    std::vector<double> local(static_cast<size_t>(pairs), 0.0);
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
      chunk_gram(rows.data(), m, len, local.data());
    }
    std::copy(local.begin(), local.end(), partial.begin() + t * pairs);
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

// One task of the update pass: columns [first, last) of parameter `param`.
struct CombineTask {
  int64_t param, first, last;
};

// params -= lr * J^T w (J's columns follow the parameters' order), in one parallel region over
// fixed column blocks of all parameters: one fork/join per call instead of one per parameter.
template <typename scalar_t>
void combine_impl(const scalar_t* J, int64_t ld, int64_t m, const std::vector<opmath_t<scalar_t>>& w,
                  const std::vector<Tensor>& params, opmath_t<scalar_t> lr) {
  // A non-contiguous parameter is updated through a contiguous copy that is written back.
  std::vector<Tensor> targets;
  std::vector<bool> copied(params.size(), false);
  std::vector<scalar_t*> outs(params.size());
  std::vector<int64_t> offsets(params.size());
  std::vector<CombineTask> tasks;
  targets.reserve(params.size());
  int64_t offset = 0;
  for (size_t k = 0; k < params.size(); ++k) {
    const Tensor& param = params[k];
    const int64_t count = param.numel();
    copied[k] = count != 0 && !param.is_contiguous();
    targets.push_back(copied[k] ? contiguous_copy(param, param.scalar_type()) : param);
    outs[k] = count == 0 ? nullptr : targets.back().mutable_data_ptr<scalar_t>();
    offsets[k] = offset;
    for (int64_t first = 0; first < count; first += kCombineGrain) {
      tasks.push_back({static_cast<int64_t>(k), first, std::min(count, first + kCombineGrain)});
    }
    offset += count;
  }
  // Traffic per full task: m rows of J read, the parameter read and written.
  const int64_t task_bytes = kCombineGrain * (m + 2) * static_cast<int64_t>(sizeof(scalar_t));
  const int64_t ntasks = static_cast<int64_t>(tasks.size());
  run_tasks(ntasks, tasks_for(kMinBytesPerThread, task_bytes), [&](int64_t t) {
    // Last task first: after gram_step's Gram pass, the end of J is what is still in the cache.
    const CombineTask& task = tasks[ntasks - 1 - t];
    combine_columns(J + offsets[task.param], ld, m, w.data(), lr, outs[task.param], task.first, task.last);
  });
  for (size_t k = 0; k < params.size(); ++k) {
    if (copied[k]) {
      Tensor param = params[k];
      torch::stable::copy_(param, targets[k]);
    }
  }
}

// A small CPU vector (w, z: one value per task) in the math dtype, read in place.
template <typename acc_t>
std::vector<acc_t> to_acc_vector(const Tensor& t) {
  std::vector<double> values(static_cast<size_t>(t.numel()));
  read_f64(t, values.data());
  return std::vector<acc_t>(values.begin(), values.end());
}

// A 0-d float32 CPU tensor holding `value` (as at::scalar_tensor rounds it).
Tensor float_scalar(double value) {
  Tensor out = new_cpu_tensor({}, ScalarType::Float);
  *out.mutable_data_ptr<float>() = static_cast<float>(value);
  return out;
}

// J checked for `op` (on the CPU).
void check_cpu_jacobian(const char* op, const Tensor& J) {
  check_jacobian(op, J);
  check_cpu(op, J);
}

Tensor gram_cpu(const Tensor& J_in) {
  check_cpu_jacobian("gram", J_in);
  const Tensor J = with_unit_column_stride(J_in);
  const int64_t m = J.size(0), n = J.size(1);
  Tensor out = new_cpu_tensor({m, m}, acc_dtype(J.scalar_type()));
  dispatch_floating(J.scalar_type(), "gram", [&](auto tag) {
    using scalar_t = typename decltype(tag)::type;
    using acc_t = opmath_t<scalar_t>;
    fill_gram(gram_sums(J.const_data_ptr<scalar_t>(), J.stride(0), m, n), m, out.mutable_data_ptr<acc_t>());
  });
  return out;
}

// params are declared mutated (Tensor(a!)[]): their values are written through their data pointers.
void combine_cpu(const Tensor& J_in, const Tensor& w, const std::vector<Tensor>& params, const Tensor& lr) {
  // Everything is checked before the first parameter is written (and before J is copied).
  check_cpu_jacobian("combine", J_in);
  check_combine_inputs(J_in, w, params, lr);
  const double lr_value = scalar_f64("combine", "lr", lr);
  const Tensor J = with_unit_column_stride(J_in);
  const int64_t m = J.size(0);
  dispatch_floating(J.scalar_type(), "combine", [&](auto tag) {
    using scalar_t = typename decltype(tag)::type;
    using acc_t = opmath_t<scalar_t>;
    combine_impl<scalar_t>(J.const_data_ptr<scalar_t>(), J.stride(0), m, to_acc_vector<acc_t>(w), params,
                           static_cast<acc_t>(lr_value));
  });
}

// w and params are declared mutated (Tensor(a!), Tensor(b!)[]).
std::tuple<Tensor, Tensor, Tensor> gram_step_cpu(const Tensor& J_in, const Tensor& w, const std::vector<Tensor>& params,
                                                 double gamma, double c1, double c2, double beta, double rho,
                                                 const Tensor& mu, const Tensor& z) {
  check_cpu_jacobian("gram_step", J_in);
  check_gram_step_inputs(J_in, w, params, gamma, c1, c2, beta, rho, mu, z);
  const double mu_value = scalar_f64("gram_step", "mu", mu);
  const Tensor J = with_unit_column_stride(J_in);
  const int64_t m = J.size(0), n = J.size(1);
  Tensor gram = new_cpu_tensor({m, m}, acc_dtype(J.scalar_type()));
  GramStepResult result{};
  dispatch_floating(J.scalar_type(), "gram_step", [&](auto tag) {
    using scalar_t = typename decltype(tag)::type;
    using acc_t = opmath_t<scalar_t>;
    const scalar_t* J_ptr = J.const_data_ptr<scalar_t>();
    acc_t* G = gram.mutable_data_ptr<acc_t>();
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
    write_f64(w, w64.data());  // rounds to w's dtype like the reference's copy_
  });
  return {gram, float_scalar(result.d_norm), float_scalar(result.alpha)};
}

// The sum of squares of x[first, last) (contiguous), first a multiple of kSquaresChunk: chunk sums in
// the math dtype, added in float64.
template <typename scalar_t>
double squares_range(const scalar_t* x, int64_t first, int64_t last) {
  double total = 0.0;
  for (int64_t c = first; c < last; c += kSquaresChunk) {
    total += squares_chunk(x + c, std::min(kSquaresChunk, last - c));
  }
  return total;
}

// One task of sum_squares: elements [first, last) of tensor `tensor`.
struct SquaresTask {
  int64_t tensor, first, last;
};

// [k]: entry i = sum of tensors[i]'s squared entries, float64 when any tensor is float64, else float32.
// Each entry is summed in its own tensor's math dtype (chunks) and float64 (chunk sums), over fixed
// tasks combined in task order: the result does not depend on the thread count.  A NaN entry makes its
// sum NaN, an infinite one +Inf; a finite tensor gives a finite sum unless it overflows the result's dtype
// (a norm above ~1.8e19 in float32), as an unscaled L2 norm would.
Tensor sum_squares_cpu(const std::vector<Tensor>& tensors) {
  check_sum_squares_inputs(tensors);
  const int64_t count = static_cast<int64_t>(tensors.size());
  ScalarType out_type = ScalarType::Float;
  for (const Tensor& t : tensors) {
    check_cpu("sum_squares", t);
    if (t.scalar_type() == ScalarType::Double) out_type = ScalarType::Double;
  }
  // A non-contiguous tensor is read through a contiguous copy (one more pass over it).
  std::vector<Tensor> sources;
  std::vector<SquaresTask> tasks;
  sources.reserve(tensors.size());
  for (int64_t i = 0; i < count; ++i) {
    const Tensor& t = tensors[i];
    const int64_t numel = t.numel();
    sources.push_back(numel != 0 && !t.is_contiguous() ? contiguous_copy(t, t.scalar_type()) : t);
    for (int64_t first = 0; first < numel; first += kSquaresGrain) {
      tasks.push_back({i, first, std::min(numel, first + kSquaresGrain)});
    }
  }
  const int64_t ntasks = static_cast<int64_t>(tasks.size());
  std::vector<double> partial(static_cast<size_t>(ntasks), 0.0);
  // Traffic per full task counted in float32 bytes whatever the dtypes: a threshold, not a measurement.
  const int64_t task_bytes = kSquaresGrain * static_cast<int64_t>(sizeof(float));
  run_tasks(ntasks, tasks_for(kMinBytesPerThread, task_bytes), [&](int64_t t) {
    const SquaresTask& task = tasks[t];
    const Tensor& source = sources[task.tensor];
    dispatch_floating(source.scalar_type(), "sum_squares", [&](auto tag) {
      using scalar_t = typename decltype(tag)::type;
      partial[t] = squares_range(source.const_data_ptr<scalar_t>(), task.first, task.last);
    });
  });
  std::vector<double> sums(static_cast<size_t>(count), 0.0);
  for (int64_t t = 0; t < ntasks; ++t) sums[tasks[t].tensor] += partial[t];
  Tensor out = new_cpu_tensor({count}, out_type);
  dispatch_floating(out_type, "sum_squares", [&](auto tag) {
    using out_t = typename decltype(tag)::type;
    out_t* dst = out.mutable_data_ptr<out_t>();
    for (int64_t i = 0; i < count; ++i) dst[i] = static_cast<out_t>(sums[i]);
  });
  return out;
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(drmoo, CPU, m) {
  m.impl("gram", TORCH_BOX(&gram_cpu));
  m.impl("combine", TORCH_BOX(&combine_cpu));
  m.impl("gram_step", TORCH_BOX(&gram_step_cpu));
  m.impl("sum_squares", TORCH_BOX(&sum_squares_cpu));
}

}  // namespace drmoo
