// CUDA kernels of gram, combine and gram_step over J [m, n].  Everything runs on the current
// stream and nothing waits for the device:
//   1. split reduction: each block sums the m(m+1)/2 products over its columns into one float64
//      partial per pair (register accumulators for m <= 8; a shared-memory tile for larger m);
//   2. a one-block kernel sums the partials in a fixed order (deterministic), writes the Gram and,
//      for gram_step, does the m x m work (drmoo_math.h) and leaves lr = gamma*alpha, the
//      finiteness flag and the incoming w in a small device buffer;
//   3. the update pass params -= lr * J^T w, which returns without writing when the flag is 0.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <torch/library.h>

#include <vector>

#include "../checks.h"
#include "../drmoo_math.h"
#include "common.cuh"

namespace drmoo {
namespace {

constexpr int kMaxSmallTasks = 8;         // m up to this uses register accumulators
constexpr int kPairsPerThread = 4;        // tile kernel: pairs owned by one thread per launch
constexpr int kColumnsPerThread = 4;      // update kernel
constexpr int kColumnsPerBlock = kThreads * kColumnsPerThread;
constexpr int kMaxTensorsPerLaunch = 32;  // update kernel: parameters per launch
constexpr int64_t kTileBytes = 48 * 1024;

// ----------------------------------------------------------------------------------- 1. partials
// Register accumulators for m <= M rows (M a compile-time bound: 2, 4 or 8, so that only three
// variants per dtype are compiled); rows m..M-1 read as zeros and their pairs are not written.
template <int M, typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kThreads)
    gram_small_kernel(const scalar_t* __restrict__ J, int64_t ld, int64_t m, int64_t n,
                      double* __restrict__ partials) {
  constexpr int P = M * (M + 1) / 2;
  __shared__ double warp_sums[kWarps][P];
  acc_t acc[P];
#pragma unroll
  for (int p = 0; p < P; ++p) acc[p] = acc_t(0);
  for (int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; c < n;
       c += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    acc_t x[M];
#pragma unroll
    for (int r = 0; r < M; ++r) x[r] = r < m ? static_cast<acc_t>(J[r * ld + c]) : acc_t(0);
    int p = 0;
#pragma unroll
    for (int i = 0; i < M; ++i) {
#pragma unroll
      for (int j = i; j < M; ++j) acc[p++] += x[i] * x[j];
    }
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int p = 0; p < P; ++p) {
    double v = static_cast<double>(acc[p]);
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_down_sync(0xffffffffu, v, offset);
    if (lane == 0) warp_sums[warp][p] = v;
  }
  __syncthreads();
  const int64_t pairs = m * (m + 1) / 2;
  for (int p = threadIdx.x; p < P; p += blockDim.x) {
    int64_t i, j;
    pair_from_index(M, p, &i, &j);
    if (j >= m) continue;
    double s = 0.0;
    for (int w = 0; w < kWarps; ++w) s += warp_sums[w][p];
    // (i, j) in the pair order of m rows
    partials[blockIdx.x * pairs + i * m - i * (i - 1) / 2 + (j - i)] = s;
  }
}

// Larger m: the block stages m x tile_cols values in shared memory (read from global memory once)
// and each thread owns up to kPairsPerThread pairs of [pair_begin, pair_begin + kThreads*kPairsPerThread).
template <typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kThreads)
    gram_tile_kernel(const scalar_t* __restrict__ J, int64_t ld, int64_t m, int64_t n, int tile_cols,
                     int64_t pair_begin, int64_t pairs_total, double* __restrict__ partials) {
  extern __shared__ unsigned char tile_raw[];
  acc_t* tile = reinterpret_cast<acc_t*>(tile_raw);
  const int stride = tile_cols + 1;  // padding: rows start in different banks
  int64_t pi[kPairsPerThread], pj[kPairsPerThread];
  acc_t acc[kPairsPerThread];
#pragma unroll
  for (int k = 0; k < kPairsPerThread; ++k) {
    const int64_t p = pair_begin + threadIdx.x + static_cast<int64_t>(k) * blockDim.x;
    pi[k] = -1;
    pj[k] = -1;
    if (p < pairs_total) pair_from_index(m, p, &pi[k], &pj[k]);
    acc[k] = acc_t(0);
  }
  for (int64_t base = blockIdx.x * static_cast<int64_t>(tile_cols); base < n;
       base += static_cast<int64_t>(gridDim.x) * tile_cols) {
    const int len = static_cast<int>(min(static_cast<int64_t>(tile_cols), n - base));
    for (int64_t e = threadIdx.x; e < m * tile_cols; e += blockDim.x) {
      const int64_t r = e / tile_cols;
      const int c = static_cast<int>(e % tile_cols);
      tile[r * stride + c] = c < len ? static_cast<acc_t>(J[r * ld + base + c]) : acc_t(0);
    }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < kPairsPerThread; ++k) {
      if (pi[k] < 0) continue;
      const acc_t* a = tile + pi[k] * stride;
      const acc_t* b = tile + pj[k] * stride;
      acc_t s = acc_t(0);
      for (int c = 0; c < len; ++c) s += a[c] * b[c];
      acc[k] += s;
    }
    __syncthreads();
  }
#pragma unroll
  for (int k = 0; k < kPairsPerThread; ++k) {
    const int64_t p = pair_begin + threadIdx.x + static_cast<int64_t>(k) * blockDim.x;
    if (p < pairs_total) partials[blockIdx.x * pairs_total + p] = static_cast<double>(acc[k]);
  }
}

template <int M, typename scalar_t, typename acc_t>
void launch_small(const scalar_t* J, int64_t ld, int64_t m, int64_t n, int64_t blocks, double* partials,
                  cudaStream_t stream) {
  gram_small_kernel<M, scalar_t, acc_t><<<blocks, kThreads, 0, stream>>>(J, ld, m, n, partials);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Per-block partial sums [blocks, m(m+1)/2] (float64) of J's pair products.
template <typename scalar_t>
at::Tensor gram_partials(const at::Tensor& J, cudaStream_t stream) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t m = J.size(0), n = J.size(1), ld = J.stride(0);
  const int64_t pairs = m * (m + 1) / 2;
  const scalar_t* data = J.data_ptr<scalar_t>();
  if (m <= kMaxSmallTasks) {
    const int64_t blocks = std::max<int64_t>(1, std::min(ceil_div(n, kThreads * 4), resident_blocks()));
    at::Tensor partials = at::empty({blocks, pairs}, J.options().dtype(at::kDouble));
    double* out = partials.data_ptr<double>();
    if (m <= 2) {
      launch_small<2, scalar_t, acc_t>(data, ld, m, n, blocks, out, stream);
    } else if (m <= 4) {
      launch_small<4, scalar_t, acc_t>(data, ld, m, n, blocks, out, stream);
    } else {
      launch_small<8, scalar_t, acc_t>(data, ld, m, n, blocks, out, stream);
    }
    return partials;
  }
  int tile_cols = 64;
  while (tile_cols > 1 && m * (tile_cols + 1) * static_cast<int64_t>(sizeof(acc_t)) > kTileBytes) tile_cols /= 2;
  TORCH_CHECK(m * (tile_cols + 1) * static_cast<int64_t>(sizeof(acc_t)) <= kTileBytes,
              "drmoo: the CUDA gram supports up to ", kTileBytes / (2 * sizeof(acc_t)), " tasks, got m = ", m);
  const int64_t blocks = std::max<int64_t>(1, std::min(ceil_div(n, tile_cols), resident_blocks()));
  at::Tensor partials = at::empty({blocks, pairs}, J.options().dtype(at::kDouble));
  const size_t smem = static_cast<size_t>(m * (tile_cols + 1)) * sizeof(acc_t);
  for (int64_t begin = 0; begin < pairs; begin += static_cast<int64_t>(kThreads) * kPairsPerThread) {
    gram_tile_kernel<scalar_t, acc_t><<<blocks, kThreads, smem, stream>>>(data, ld, m, n, tile_cols, begin, pairs,
                                                                           partials.data_ptr<double>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return partials;
}

// ------------------------------------------------------------------------------------ 2. finalize
// Sums the partials into the Gram (rounded to acc_t).  With `w` given (gram_step) thread 0 then
// runs the m x m step: control = [gamma*alpha, finite, incoming w (m values)], w updated in place
// (float64 work copy), d_norm / alpha written as float32.
template <typename acc_t>
__global__ void __launch_bounds__(kThreads)
    gram_finalize_kernel(const double* __restrict__ partials, int64_t blocks, int64_t m, acc_t* __restrict__ gram,
                         double* __restrict__ w, const double* __restrict__ z, const double* __restrict__ mu,
                         double gamma, double c1, double c2, double beta, double rho, double* __restrict__ scratch,
                         double* __restrict__ control, float* __restrict__ d_norm_out,
                         float* __restrict__ alpha_out) {
  const int64_t pairs = m * (m + 1) / 2;
  for (int64_t p = threadIdx.x; p < pairs; p += blockDim.x) {
    double s = 0.0;
    for (int64_t b = 0; b < blocks; ++b) s += partials[b * pairs + p];
    int64_t i, j;
    pair_from_index(m, p, &i, &j);
    const acc_t value = static_cast<acc_t>(s);
    gram[i * m + j] = value;
    gram[j * m + i] = value;
  }
  if (w == nullptr) return;
  __syncthreads();  // the Gram written above is visible to thread 0
  if (threadIdx.x != 0) return;
  for (int64_t i = 0; i < m; ++i) control[2 + i] = w[i];
  auto gram_at = [gram, m](int64_t i, int64_t j) { return static_cast<double>(gram[i * m + j]); };
  const GramStepResult r = gram_step_small(m, gram_at, w, z, *mu, c1, c2, beta, rho, scratch);
  control[0] = gamma * r.alpha;
  control[1] = r.finite ? 1.0 : 0.0;
  *d_norm_out = static_cast<float>(r.d_norm);
  *alpha_out = static_cast<float>(r.alpha);
}

// -------------------------------------------------------------------------------------- 3. update
template <typename scalar_t>
struct ParamBatch {
  scalar_t* ptr[kMaxTensorsPerLaunch];
  int64_t col0[kMaxTensorsPerLaunch];       // first column of J belonging to the parameter
  int64_t numel[kMaxTensorsPerLaunch];
  int64_t block_end[kMaxTensorsPerLaunch];  // cumulative block counts
  int count;
};

// params -= lr * J^T w over up to kMaxTensorsPerLaunch parameters, kColumnsPerBlock columns per
// block.  control = [lr, flag]; flag 0 (non-finite Gram) means no write at all.
template <typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kThreads)
    update_kernel(const scalar_t* __restrict__ J, int64_t ld, int64_t m, const double* __restrict__ control,
                  const double* __restrict__ w, ParamBatch<scalar_t> batch) {
  if (control[1] == 0.0) return;  // uniform over the grid
  extern __shared__ unsigned char w_raw[];
  acc_t* w_shared = reinterpret_cast<acc_t*>(w_raw);
  for (int64_t i = threadIdx.x; i < m; i += blockDim.x) w_shared[i] = static_cast<acc_t>(w[i]);
  __syncthreads();
  const acc_t lr = static_cast<acc_t>(control[0]);
  int t = 0;
  while (blockIdx.x >= batch.block_end[t]) ++t;
  const int64_t first_block = t == 0 ? 0 : batch.block_end[t - 1];
  const int64_t base = (blockIdx.x - first_block) * kColumnsPerBlock;
  const int64_t count = batch.numel[t];
  const scalar_t* cols = J + batch.col0[t];
  scalar_t* out = batch.ptr[t];
#pragma unroll
  for (int k = 0; k < kColumnsPerThread; ++k) {
    const int64_t c = base + k * blockDim.x + threadIdx.x;
    if (c >= count) break;
    acc_t d = w_shared[0] * static_cast<acc_t>(cols[c]);
    for (int64_t i = 1; i < m; ++i) d += w_shared[i] * static_cast<acc_t>(cols[i * ld + c]);
    out[c] = static_cast<scalar_t>(static_cast<acc_t>(out[c]) - lr * d);
  }
}

template <typename scalar_t>
void launch_update(const at::Tensor& J, at::TensorList params, const double* control, const double* w,
                   cudaStream_t stream) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t m = J.size(0), ld = J.stride(0);
  const size_t smem = static_cast<size_t>(m) * sizeof(acc_t);
  std::vector<at::Tensor> staged;  // contiguous copies of non-contiguous parameters, written back
  ParamBatch<scalar_t> batch{};
  int64_t blocks = 0, offset = 0;
  auto flush = [&] {
    if (batch.count == 0) return;
    update_kernel<scalar_t, acc_t><<<blocks, kThreads, smem, stream>>>(J.data_ptr<scalar_t>(), ld, m, control, w,
                                                                        batch);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    batch = ParamBatch<scalar_t>{};
    blocks = 0;
  };
  for (const at::Tensor& param : params) {
    const int64_t count = param.numel();
    if (count == 0) continue;
    at::Tensor target = param;
    if (!param.is_contiguous()) {
      target = param.contiguous();
      staged.push_back(target);
    }
    const int k = batch.count++;
    batch.ptr[k] = target.data_ptr<scalar_t>();
    batch.col0[k] = offset;
    batch.numel[k] = count;
    blocks += ceil_div(count, kColumnsPerBlock);
    batch.block_end[k] = blocks;
    offset += count;
    if (batch.count == kMaxTensorsPerLaunch) flush();
  }
  flush();
  // Write the staged copies back (unchanged values when the guard skipped the update).
  size_t next = 0;
  for (const at::Tensor& param : params) {
    if (param.numel() > 0 && !param.is_contiguous()) param.copy_(staged[next++]);
  }
}

// -------------------------------------------------------------------------------------------- ops
at::Tensor gram_cuda(const at::Tensor& J_in) {
  const c10::cuda::OptionalCUDAGuard guard(J_in.device());
  const at::Tensor J = check_jacobian("gram", J_in);
  check_cuda("gram", J);
  const int64_t m = J.size(0);
  at::Tensor out = at::empty({m, m}, J.options().dtype(acc_dtype(J.scalar_type())));
  const cudaStream_t stream = current_stream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, J.scalar_type(), "drmoo_gram_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const at::Tensor partials = gram_partials<scalar_t>(J, stream);
    gram_finalize_kernel<acc_t><<<1, kThreads, 0, stream>>>(partials.data_ptr<double>(), partials.size(0), m,
                                                             out.data_ptr<acc_t>(), nullptr, nullptr, nullptr, 0.0,
                                                             0.0, 0.0, 0.0, 0.0, nullptr, nullptr, nullptr, nullptr);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

void combine_cuda(const at::Tensor& J_in, const at::Tensor& w, at::TensorList params, const at::Tensor& lr) {
  const c10::cuda::OptionalCUDAGuard guard(J_in.device());
  const at::Tensor J = check_jacobian("combine", J_in);
  check_cuda("combine", J);
  check_vector("combine", "w", w, J.size(0), J);
  check_params("combine", J, params);
  TORCH_CHECK_VALUE(lr.numel() == 1, "drmoo.combine: lr must hold one value, got shape ", shape_str(lr));
  // control = [lr, 1]: always write.  Built with device copies, no host round trip.
  at::Tensor control = at::ones({2}, J.options().dtype(at::kDouble));
  control.narrow(0, 0, 1).copy_(lr.reshape({1}));
  const at::Tensor w64 = w.to(at::kDouble).contiguous();
  const cudaStream_t stream = current_stream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, J.scalar_type(), "drmoo_combine_cuda", [&] {
    launch_update<scalar_t>(J, params, control.data_ptr<double>(), w64.data_ptr<double>(), stream);
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> gram_step_cuda(const at::Tensor& J_in, at::Tensor& w,
                                                              at::TensorList params, double gamma, double c1,
                                                              double c2, double beta, double rho,
                                                              const at::Tensor& mu, const at::Tensor& z) {
  const c10::cuda::OptionalCUDAGuard guard(J_in.device());
  const at::Tensor J = check_jacobian("gram_step", J_in);
  check_cuda("gram_step", J);
  const int64_t m = J.size(0);
  check_vector("gram_step", "w", w, m, J);
  check_vector("gram_step", "z", z, m, J);
  check_params("gram_step", J, params);
  TORCH_CHECK_VALUE(mu.numel() == 1, "drmoo.gram_step: mu must hold one value, got shape ", shape_str(mu));
  const auto f64 = J.options().dtype(at::kDouble);
  at::Tensor gram = at::empty({m, m}, J.options().dtype(acc_dtype(J.scalar_type())));
  at::Tensor d_norm = at::empty({}, J.options().dtype(at::kFloat));
  at::Tensor alpha = at::empty({}, J.options().dtype(at::kFloat));
  at::Tensor w_work = w.to(at::kDouble).contiguous();
  const at::Tensor z64 = z.to(at::kDouble).contiguous();
  const at::Tensor mu64 = mu.to(J.device(), at::kDouble).reshape({1});
  at::Tensor control = at::empty({2 + m}, f64);
  at::Tensor scratch = at::empty({2 * m}, f64);
  const cudaStream_t stream = current_stream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, J.scalar_type(), "drmoo_gram_step_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const at::Tensor partials = gram_partials<scalar_t>(J, stream);
    gram_finalize_kernel<acc_t><<<1, kThreads, 0, stream>>>(
        partials.data_ptr<double>(), partials.size(0), m, gram.data_ptr<acc_t>(), w_work.data_ptr<double>(),
        z64.data_ptr<double>(), mu64.data_ptr<double>(), gamma, c1, c2, beta, rho, scratch.data_ptr<double>(),
        control.data_ptr<double>(), d_norm.data_ptr<float>(), alpha.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    // The update reads the incoming w that the finalize kernel saved in control[2:].
    launch_update<scalar_t>(J, params, control.data_ptr<double>(), control.data_ptr<double>() + 2, stream);
  });
  // w_work holds w's own values when the Gram was not finite, so this copy changes nothing then.
  if (!w_work.is_same(w)) w.copy_(w_work);
  return {gram, d_norm, alpha};
}

}  // namespace

TORCH_LIBRARY_IMPL(drmoo, CUDA, m) {
  m.impl("gram", &gram_cuda);
  m.impl("combine", &combine_cuda);
  m.impl("gram_step", &gram_step_cuda);
}

}  // namespace drmoo
