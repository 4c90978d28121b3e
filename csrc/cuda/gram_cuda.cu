// CUDA kernels of gram, combine and gram_step over J [m, n].  Everything runs on the current
// stream and nothing waits for the device.  gram_step is three launches, whatever the number of
// parameter tensors (up to kMaxTensorsPerLaunch):
//   1. split reduction: each block sums the m(m+1)/2 products over its columns and writes one
//      float64 partial per pair to a workspace ([pairs][blocks]), no atomics:
//        m <= 8: every thread holds all pairs in registers and streams J with 128-bit loads;
//        m >  8: each warp owns an R x R register tile of the Gram (R = 8, 4 for float64), the
//                block stages J's rows in shared memory with cp.async, double-buffered;
//   2. one block sums the partials in a fixed order (deterministic run to run), writes the Gram
//      and, for gram_step, runs the m x m step (drmoo_math.h) on it: control = [gamma*alpha,
//      finite, incoming w], w written back in its own dtype, d_norm and alpha;
//   3. the update pass params -= lr * J^T w over a table of parameter pointers (one launch for up
//      to kMaxTensorsPerLaunch tensors), 128-bit loads where J's columns and the parameter are both
//      16-byte aligned; it returns without writing when the finiteness flag is 0.
// gram is passes 1-2; combine is pass 3 with lr and w read in their own dtypes.
#include <torch/csrc/stable/library.h>

#include <optional>
#include <tuple>
#include <vector>

#include "../checks.h"
#include "../drmoo_math.h"
#include "common.cuh"

namespace drmoo {
namespace {

constexpr int kMaxSmallTasks = 8;        // m up to this: register accumulators for every pair
constexpr int kFinalizeThreads = 512;    // the one-block reduction of the partials
constexpr int kTileWarps = 8;            // tile kernel: warps (= Gram register tiles) per block
constexpr int kMaxSlots = 2 * kTileWarps;  // row blocks one tile block can touch
constexpr int kTileShared = 44 * 1024;  // tile kernel: both stages of the J tile (+ static < 48 KB)
constexpr int kMaxTensorsPerLaunch = 96;  // update kernel: parameter pointers per launch (4 KB params)
constexpr int kUpdatePerThread = 8;      // update kernel: elements per thread
constexpr int kUpdateChunk = kThreads * kUpdatePerThread;  // elements per block

// ----------------------------------------------------------------------- 1a. partials, m <= 8
// All M(M+1)/2 pair sums in registers (M a compile-time bound: 2, 3, 4 or 8; rows m..M-1 are
// neither read nor written).  Columns [head, head + groups*V) are read V at a time with 16-byte
// loads (V = 16 / sizeof(scalar_t)); the rest (a misaligned head, a tail shorter than V, or all
// columns when the rows cannot be read 16 bytes at a time) one by one.
template <int M, typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kThreads)
    gram_small_kernel(const scalar_t* __restrict__ J, int64_t ld, int m, int64_t n, int64_t head, int64_t groups,
                      double* __restrict__ partials) {
  using Vec = Vec16<scalar_t>;
  constexpr int V = Vec::kSize;
  constexpr int P = M * (M + 1) / 2;
  acc_t acc[P];
#pragma unroll
  for (int p = 0; p < P; ++p) acc[p] = acc_t(0);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;

  for (int64_t g = first; g < groups; g += stride) {
    const int64_t c = head + g * V;
    Vec raw[M];
#pragma unroll
    for (int r = 0; r < M; ++r) {
      // Zeros for rows past m: a row left unset made ptxas keep part of raw on the stack.
      raw[r] = r < m ? *reinterpret_cast<const Vec*>(J + r * ld + c) : Vec{};
    }
    acc_t x[M][V];
#pragma unroll
    for (int r = 0; r < M; ++r) {
#pragma unroll
      for (int e = 0; e < V; ++e) x[r][e] = r < m ? static_cast<acc_t>(raw[r].v[e]) : acc_t(0);
    }
    int p = 0;
#pragma unroll
    for (int i = 0; i < M; ++i) {
#pragma unroll
      for (int j = i; j < M; ++j) {
#pragma unroll
        for (int e = 0; e < V; ++e) acc[p] += x[i][e] * x[j][e];
        ++p;
      }
    }
  }

  const int64_t vector_end = head + groups * V;
  const int64_t scalar_columns = n - groups * V;  // [0, head) and [vector_end, n)
  for (int64_t s = first; s < scalar_columns; s += stride) {
    const int64_t c = s < head ? s : vector_end + (s - head);
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

  // Block sum per pair (float64), then one partial per (pair, block).
  __shared__ double warp_sums[kWarps][P];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int p = 0; p < P; ++p) {
    double v = static_cast<double>(acc[p]);
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_down_sync(kFullMask, v, offset);
    if (lane == 0) warp_sums[warp][p] = v;
  }
  __syncthreads();
  for (int p = threadIdx.x; p < P; p += blockDim.x) {
    int i = 0, q = p;  // (i, j) of pair p in the M-row order
    while (q >= M - i) {
      q -= M - i;
      ++i;
    }
    const int j = i + q;
    if (j >= m) continue;
    double s = 0.0;
    for (int w = 0; w < kWarps; ++w) s += warp_sums[w][p];
    partials[index_of_pair(m, i, j) * gridDim.x + blockIdx.x] = s;
  }
}

// ------------------------------------------------------------------------ 1b. partials, m > 8
// Gram rows are cut into row blocks of R; the pairs of row blocks (bi <= bj) are the tile pairs,
// numbered row by row.  Block (x, y) owns tile pairs [x*kTileWarps, x*kTileWarps + kTileWarps), one
// per warp, and the column chunks y, y + gridDim.y, ... of K columns each.  Per chunk it stages
// the rows of the (at most kMaxSlots) row blocks its tile pairs use in shared memory, row-major
// [slot*R + r][K], and each lane of a warp accumulates the warp's R x R tile over the columns
// lane, lane + 32, ...: per column 2R shared loads (R on the diagonal) for R*R FMAs, conflict-free
// (a warp reads 32 consecutive entries of a row).  Blocks with the same y read the same columns
// at about the same time, so J comes from DRAM once and from L2 for the other tile groups.
// kAsync: J's rows are 16-byte aligned, so the next chunk is copied with cp.async while this one
// is used (two stages); otherwise one stage loaded element by element.
template <typename scalar_t, typename acc_t, int R, bool kAsync>
__global__ void __launch_bounds__(kTileWarps * 32, 2)
    gram_tile_kernel(const scalar_t* __restrict__ J, int64_t ld, int m, int64_t n, int64_t row_blocks,
                     int64_t tile_pairs, int K, int64_t chunks, int64_t stage_elems, double* __restrict__ partials) {
  extern __shared__ __align__(16) unsigned char tile_raw[];
  scalar_t* tiles = reinterpret_cast<scalar_t*>(tile_raw);
  __shared__ int64_t slot_block[kMaxSlots];
  __shared__ int warp_slot[kTileWarps][2];
  __shared__ int slot_count;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;

  if (threadIdx.x == 0) {
    int count = 0;
    for (int w = 0; w < warps; ++w) {
      const int64_t p = static_cast<int64_t>(blockIdx.x) * kTileWarps + w;
      warp_slot[w][0] = warp_slot[w][1] = -1;
      if (p >= tile_pairs) continue;
      int64_t bi, bj;
      pair_of_index(row_blocks, p, &bi, &bj);
      int si = -1, sj = -1;
      for (int s = 0; s < count; ++s) {
        if (slot_block[s] == bi) si = s;
        if (slot_block[s] == bj) sj = s;
      }
      if (si < 0) {
        si = count;
        slot_block[count++] = bi;
      }
      if (sj < 0) {
        if (bj == bi) {
          sj = si;
        } else {
          sj = count;
          slot_block[count++] = bj;
        }
      }
      warp_slot[w][0] = si;
      warp_slot[w][1] = sj;
    }
    slot_count = count;
  }
  __syncthreads();

  const int rows = slot_count * R;
  // Stage the rows of every slot for columns [chunk*K, chunk*K + K): zeros past n and past m.
  auto load_chunk = [&](int64_t chunk, scalar_t* dst) {
    const int64_t base = chunk * K;
    if constexpr (kAsync) {
      constexpr int V = Vec16<scalar_t>::kSize;
      const int per_row = K / V;
      for (int e = threadIdx.x; e < rows * per_row; e += blockDim.x) {
        const int row = e / per_row, q = e - row * per_row;
        const int64_t grow = slot_block[row / R] * R + row % R;
        const int64_t col = base + static_cast<int64_t>(q) * V;
        int bytes = 0;
        const scalar_t* src = J;
        if (grow < m && col < n) {
          bytes = static_cast<int>(std::min<int64_t>(V, n - col)) * static_cast<int>(sizeof(scalar_t));
          src = J + grow * ld + col;
        }
        copy_async_16(dst + row * K + q * V, src, bytes);
      }
      copy_async_commit();
    } else {
      for (int e = threadIdx.x; e < rows * K; e += blockDim.x) {
        const int row = e / K, c = e - row * K;
        const int64_t grow = slot_block[row / R] * R + row % R;
        const int64_t col = base + c;
        dst[row * K + c] = (grow < m && col < n) ? J[grow * ld + col] : static_cast<scalar_t>(0.0f);
      }
    }
  };

  const int si = warp_slot[warp][0], sj = warp_slot[warp][1];
  acc_t acc[R][R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int s = 0; s < R; ++s) acc[r][s] = acc_t(0);
  }

  int64_t chunk = blockIdx.y;
  int stage = 0;
  if constexpr (kAsync) {
    if (chunk < chunks) load_chunk(chunk, tiles);
  }
  for (; chunk < chunks; chunk += gridDim.y) {
    if constexpr (kAsync) {
      const int64_t next = chunk + gridDim.y;
      if (next < chunks) {
        load_chunk(next, tiles + (stage ^ 1) * stage_elems);
      } else {
        copy_async_commit();  // an empty group keeps "all but the newest group" meaning this chunk
      }
      copy_async_wait<1>();
    } else {
      load_chunk(chunk, tiles);
    }
    __syncthreads();
    if (si >= 0) {
      const scalar_t* a_rows = tiles + stage * stage_elems + si * R * K;
      const scalar_t* b_rows = tiles + stage * stage_elems + sj * R * K;
      if (si == sj) {  // a diagonal tile: the pairs r <= s only (warp-uniform branch)
#pragma unroll 2
        for (int c = lane; c < K; c += 32) {
          acc_t a[R];
#pragma unroll
          for (int r = 0; r < R; ++r) a[r] = static_cast<acc_t>(a_rows[r * K + c]);
#pragma unroll
          for (int r = 0; r < R; ++r) {
#pragma unroll
            for (int s = r; s < R; ++s) acc[r][s] += a[r] * a[s];
          }
        }
      } else {
#pragma unroll 2
        for (int c = lane; c < K; c += 32) {
          acc_t a[R], b[R];
#pragma unroll
          for (int r = 0; r < R; ++r) {
            a[r] = static_cast<acc_t>(a_rows[r * K + c]);
            b[r] = static_cast<acc_t>(b_rows[r * K + c]);
          }
#pragma unroll
          for (int r = 0; r < R; ++r) {
#pragma unroll
            for (int s = 0; s < R; ++s) acc[r][s] += a[r] * b[s];
          }
        }
      }
    }
    __syncthreads();  // the stage read above is the one the next iteration's copy overwrites
    stage ^= kAsync ? 1 : 0;
  }

  if (si < 0) return;
  const int64_t bi = slot_block[si], bj = slot_block[sj];
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int s = 0; s < R; ++s) {
      if (bi == bj && s < r) continue;  // below the diagonal of a diagonal tile: not accumulated
      double v = static_cast<double>(acc[r][s]);
      for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_down_sync(kFullMask, v, offset);
      const int64_t i = bi * R + r, j = bj * R + s;
      if (lane == 0 && i < m && j < m) partials[index_of_pair(m, i, j) * gridDim.y + blockIdx.y] = v;
    }
  }
}

// Launches pass 1 into `partials` ([pairs][blocks] float64, `blocks` from plan_partials).
struct PartialsPlan {
  int64_t blocks = 1;  // partials per pair
  // m <= 8
  int64_t head = 0, groups = 0;
  // m > 8
  int R = 8, K = 128;
  int64_t row_blocks = 0, tile_pairs = 0, chunks = 0, stage_elems = 0;
  dim3 grid, block;
  size_t shared = 0;
  bool async = false;
};

template <int M, typename scalar_t, typename acc_t>
void plan_small(PartialsPlan* plan, const scalar_t* data, int64_t m, int64_t ld, int64_t n) {
  constexpr int V = Vec16<scalar_t>::kSize;
  // 16-byte loads need every row start aligned, so the row stride must be a multiple of V (or
  // there is one row); the first `head` columns are read one by one up to a 16-byte boundary.
  if (m == 1 || ld % V == 0) {
    const int64_t misalignment = static_cast<int64_t>(reinterpret_cast<uintptr_t>(data) % 16);
    plan->head = misalignment == 0 ? 0 : std::min<int64_t>(n, (16 - misalignment) / sizeof(scalar_t));
    plan->groups = (n - plan->head) / V;
  }
  const int per_sm = blocks_per_sm(reinterpret_cast<const void*>(&gram_small_kernel<M, scalar_t, acc_t>), kThreads, 0);
  const int64_t items = plan->groups + (n - plan->groups * V);
  plan->blocks = std::max<int64_t>(1, std::min(ceil_div(items, kThreads), static_cast<int64_t>(per_sm) * sm_count()));
}

template <typename scalar_t, typename acc_t, int R, bool kAsync>
const void* tile_kernel() {
  return reinterpret_cast<const void*>(&gram_tile_kernel<scalar_t, acc_t, R, kAsync>);
}

template <typename scalar_t>
PartialsPlan plan_partials(const Tensor& J) {
  using acc_t = opmath_t<scalar_t>;
  const int64_t m = J.size(0), n = J.size(1), ld = J.stride(0);
  const scalar_t* data = J.const_data_ptr<scalar_t>();
  PartialsPlan plan;
  if (m <= kMaxSmallTasks) {
    if (m <= 2) {
      plan_small<2, scalar_t, acc_t>(&plan, data, m, ld, n);
    } else if (m == 3) {
      plan_small<3, scalar_t, acc_t>(&plan, data, m, ld, n);
    } else if (m == 4) {
      plan_small<4, scalar_t, acc_t>(&plan, data, m, ld, n);
    } else {
      plan_small<8, scalar_t, acc_t>(&plan, data, m, ld, n);
    }
    return plan;
  }
  constexpr int R = sizeof(acc_t) == 8 ? 4 : 8;
  plan.R = R;
  plan.row_blocks = ceil_div(m, R);
  plan.tile_pairs = plan.row_blocks * (plan.row_blocks + 1) / 2;
  const int64_t tile_groups = ceil_div(plan.tile_pairs, kTileWarps);
  const int warps = static_cast<int>(std::min<int64_t>(kTileWarps, plan.tile_pairs));
  const int64_t slots = std::min<int64_t>(std::min<int64_t>(kMaxSlots, 2 * warps), plan.row_blocks);
  plan.async = aligned16(data) && (ld * static_cast<int64_t>(sizeof(scalar_t))) % 16 == 0;
  const int stages = plan.async ? 2 : 1;
  plan.K = 128;
  while (plan.K > 32 && stages * slots * R * plan.K * static_cast<int64_t>(sizeof(scalar_t)) > kTileShared) {
    plan.K /= 2;
  }
  plan.stage_elems = slots * R * plan.K;
  plan.shared = static_cast<size_t>(stages * plan.stage_elems) * sizeof(scalar_t);
  plan.chunks = ceil_div(n, plan.K);
  plan.block = dim3(static_cast<unsigned>(32 * warps));
  const void* kernel = plan.async ? tile_kernel<scalar_t, acc_t, R, true>() : tile_kernel<scalar_t, acc_t, R, false>();
  const int64_t resident = static_cast<int64_t>(blocks_per_sm(kernel, 32 * warps, plan.shared)) * sm_count();
  DRMOO_CHECK(tile_groups < (int64_t{1} << 31), "drmoo.gram: too many tasks for the CUDA kernel (m = ", m, ")");
  plan.blocks = std::max<int64_t>(1, std::min<int64_t>({plan.chunks, std::max<int64_t>(1, resident / tile_groups),
                                                        int64_t{65535}}));
  plan.grid = dim3(static_cast<unsigned>(tile_groups), static_cast<unsigned>(plan.blocks));
  return plan;
}

template <typename scalar_t>
void launch_partials(const PartialsPlan& plan, const Tensor& J, double* partials, cudaStream_t stream) {
  using acc_t = opmath_t<scalar_t>;
  const int m = static_cast<int>(J.size(0));
  const int64_t n = J.size(1), ld = J.stride(0);
  const scalar_t* data = J.const_data_ptr<scalar_t>();
  if (m <= kMaxSmallTasks) {
    const auto blocks = static_cast<unsigned>(plan.blocks);
    if (m <= 2) {
      gram_small_kernel<2, scalar_t, acc_t><<<blocks, kThreads, 0, stream>>>(data, ld, m, n, plan.head, plan.groups,
                                                                             partials);
    } else if (m == 3) {
      gram_small_kernel<3, scalar_t, acc_t><<<blocks, kThreads, 0, stream>>>(data, ld, m, n, plan.head, plan.groups,
                                                                             partials);
    } else if (m == 4) {
      gram_small_kernel<4, scalar_t, acc_t><<<blocks, kThreads, 0, stream>>>(data, ld, m, n, plan.head, plan.groups,
                                                                             partials);
    } else {
      gram_small_kernel<8, scalar_t, acc_t><<<blocks, kThreads, 0, stream>>>(data, ld, m, n, plan.head, plan.groups,
                                                                             partials);
    }
  } else {
    constexpr int R = sizeof(acc_t) == 8 ? 4 : 8;
    auto kernel = plan.async ? &gram_tile_kernel<scalar_t, acc_t, R, true> : &gram_tile_kernel<scalar_t, acc_t, R, false>;
    kernel<<<plan.grid, plan.block, plan.shared, stream>>>(data, ld, m, n, plan.row_blocks, plan.tile_pairs, plan.K,
                                                           plan.chunks, plan.stage_elems, partials);
  }
  DRMOO_CUDA_LAUNCH_CHECK();
}

// ------------------------------------------------------------------------------------ 2. finalize
constexpr int kSharedGramTasks = 64;  // m up to this: the m x m step works in shared memory (34 KB)

// The arguments of the m x m step (absent for gram).
struct StepArgs {
  bool enabled;
  ValueRef w, z, mu;  // w is read, then written back in its own dtype when the Gram is finite
  double gamma, c1, c2, beta, rho;
  double* control;  // [gamma*alpha, finite, incoming w (m values)], read by the update pass
  double* work;     // 4m doubles for m > kSharedGramTasks: w work copy, z, G w, projection scratch
  float* d_norm;
  float* alpha;
};

// Sums the partials into the Gram (rounded to acc_t): warp w takes pairs w, w + warps, ...; its
// lanes add every 32nd block in order and a fixed butterfly adds the lanes, so the result does
// not depend on timing.  Then the m x m step, the operations of gram_step_small (drmoo_math.h) in
// the same order: the finiteness check and G w spread over the threads (each row of G w summed in
// column order by one thread), the O(m) rest and the simplex projection on thread 0.  For m up to
// kSharedGramTasks the Gram and the vectors live in shared memory, so thread 0's serial part does
// not wait on global-memory latency at every step.
template <typename acc_t>
__global__ void __launch_bounds__(kFinalizeThreads)
    gram_finalize_kernel(const double* __restrict__ partials, int64_t blocks, int64_t m, acc_t* __restrict__ gram,
                         StepArgs step) {
  __shared__ double gram_shared[kSharedGramTasks * kSharedGramTasks];
  __shared__ double vectors_shared[4 * kSharedGramTasks];
  const bool in_shared = step.enabled && m <= kSharedGramTasks;
  // Strides are the compile-time block size (always the launch's): with blockDim.x ptxas kept
  // the value in an 8-byte stack slot in the float64 sm_90 variant.
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = kFinalizeThreads / 32;
  const int64_t pairs = m * (m + 1) / 2;
  // Pair p = (i, j) goes to warp p % warps; rows are walked in order (integer arithmetic only).
  int64_t i = 0, row_end = m;  // pairs of row i: [row_end - (m - i), row_end)
  for (int64_t p = warp; p < pairs; p += warps) {
    while (p >= row_end) {
      ++i;
      row_end += m - i;
    }
    const int64_t j = i + (p - (row_end - (m - i)));
    const double* row = partials + p * blocks;
    double s = 0.0;
#pragma unroll 8  // independent loads in flight: a few round trips to L2 for ~1000 partials
    for (int64_t b = lane; b < blocks; b += 32) s += row[b];
    s = warp_sum(s);
    if (lane == 0) {
      const acc_t value = static_cast<acc_t>(s);
      gram[i * m + j] = value;
      gram[j * m + i] = value;
      if (in_shared) {
        gram_shared[i * m + j] = static_cast<double>(value);
        gram_shared[j * m + i] = static_cast<double>(value);
      }
    }
  }
  if (!step.enabled) return;
  // G as the step sees it: the Gram's stored (acc_t) values, as float64.
  auto gram_at = [=](int64_t e) { return in_shared ? gram_shared[e] : static_cast<double>(gram[e]); };
  double* vectors = in_shared ? vectors_shared : step.work;
  double* w_work = vectors;
  double* z = vectors + m;
  double* gram_w = vectors + 2 * m;
  double* scratch = vectors + 3 * m;
  for (int64_t i = threadIdx.x; i < m; i += kFinalizeThreads) {
    const double w_i = load_value(step.w, i);
    step.control[2 + i] = w_i;  // the incoming w, for the update pass
    w_work[i] = w_i;
    z[i] = load_value(step.z, i);
  }
  __syncthreads();  // the Gram (global and shared) and the vectors above are visible to every thread
  bool not_finite = false;
  for (int64_t e = threadIdx.x; e < m * m; e += kFinalizeThreads) not_finite |= !d_isfinite(gram_at(e));
  const bool finite = __syncthreads_or(not_finite) == 0;
  if (finite) {
    for (int64_t i = threadIdx.x; i < m; i += kFinalizeThreads) {
      double s = 0.0;
      for (int64_t j = 0; j < m; ++j) s += gram_at(i * m + j) * w_work[j];
      gram_w[i] = s;
    }
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  double d_norm = NAN, alpha = 0.0;
  if (finite) {
    double quad = 0.0;
    for (int64_t i = 0; i < m; ++i) quad += w_work[i] * gram_w[i];
    d_norm = d_sqrt(quad < 0.0 ? 0.0 : quad);  // a NaN stays NaN (as the reference's clamp keeps it)
    alpha = clip_factor(step.c1, step.c2, d_norm);
    const double mu = load_value(step.mu, 0);
    for (int64_t i = 0; i < m; ++i) {
      const double pref_grad = alpha * gram_w[i] + mu * (z[i] * z[i]) * w_work[i] + step.rho * w_work[i];
      w_work[i] = w_work[i] - step.beta * pref_grad;
    }
    project_simplex_inplace(m, w_work, scratch);
  }
  step.control[0] = step.gamma * alpha;
  step.control[1] = finite ? 1.0 : 0.0;
  *step.d_norm = static_cast<float>(d_norm);
  *step.alpha = static_cast<float>(alpha);
  if (finite) {
    for (int64_t i = 0; i < m; ++i) store_value(step.w, i, w_work[i]);
  }
}

// -------------------------------------------------------------------------------------- 3. update
// Up to kMaxTensorsPerLaunch parameters; parameter k holds J's columns [col0[k], col0[k] + numel[k])
// and blocks [chunk_end[k-1], chunk_end[k]) (kUpdateChunk elements per block).  Passed as a
// __grid_constant__ kernel argument (no copy to local memory when indexed at run time).
template <typename scalar_t>
struct ParamTable {
  scalar_t* ptr[kMaxTensorsPerLaunch];
  int64_t col0[kMaxTensorsPerLaunch];
  int64_t numel[kMaxTensorsPerLaunch];
  int64_t chunk_end[kMaxTensorsPerLaunch];
  int count;
};

struct UpdateArgs {
  ValueRef lr;           // one value
  ValueRef w;            // m values
  const double* finite;  // nullptr: always write; else write only when *finite != 0
};

// params -= lr * J^T w.  Blocks run from the last chunk to the first: pass 1 read J's last
// columns last, so some of them are still in L2 when this pass starts.
template <typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kThreads)
    update_kernel(const scalar_t* __restrict__ J, int64_t ld, int m, UpdateArgs args,
                  const __grid_constant__ ParamTable<scalar_t> table) {
  if (args.finite != nullptr && *args.finite == 0.0) return;  // uniform over the grid
  extern __shared__ __align__(16) unsigned char w_raw[];
  acc_t* w_shared = reinterpret_cast<acc_t*>(w_raw);
  for (int i = threadIdx.x; i < m; i += blockDim.x) w_shared[i] = static_cast<acc_t>(load_value(args.w, i));
  const acc_t lr = static_cast<acc_t>(load_value(args.lr, 0));
  __syncthreads();

  const int64_t chunk = static_cast<int64_t>(gridDim.x) - 1 - blockIdx.x;
  int lo = 0, hi = table.count - 1;  // the parameter holding this chunk: first k with chunk < chunk_end[k]
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (chunk < table.chunk_end[mid]) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  const int k = lo;
  const int64_t begin = (chunk - (k == 0 ? 0 : table.chunk_end[k - 1])) * kUpdateChunk;
  const int64_t count = std::min<int64_t>(kUpdateChunk, table.numel[k] - begin);
  const scalar_t* cols = J + table.col0[k] + begin;
  scalar_t* out = table.ptr[k] + begin;

  using Vec = Vec16<scalar_t>;
  constexpr int V = Vec::kSize;
  constexpr int U = kUpdatePerThread / V;  // vectors per thread
  static_assert(U * V == kUpdatePerThread, "the update chunk must be whole 16-byte vectors per thread");
  const bool vectorized = count == kUpdateChunk && aligned16(cols) && aligned16(out) &&
                          (ld * static_cast<int64_t>(sizeof(scalar_t))) % 16 == 0;
  if (vectorized) {  // uniform over the block
    acc_t d[U][V];
#pragma unroll
    for (int u = 0; u < U; ++u) {
#pragma unroll
      for (int e = 0; e < V; ++e) d[u][e] = acc_t(0);
    }
    for (int i = 0; i < m; ++i) {
      const acc_t w_i = w_shared[i];
      const Vec* row = reinterpret_cast<const Vec*>(cols + i * ld);
      Vec x[U];
#pragma unroll
      for (int u = 0; u < U; ++u) x[u] = row[threadIdx.x + u * kThreads];
#pragma unroll
      for (int u = 0; u < U; ++u) {
#pragma unroll
        for (int e = 0; e < V; ++e) d[u][e] += w_i * static_cast<acc_t>(x[u].v[e]);
      }
    }
    Vec* dst = reinterpret_cast<Vec*>(out);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      Vec p = dst[threadIdx.x + u * kThreads];
#pragma unroll
      for (int e = 0; e < V; ++e) p.v[e] = static_cast<scalar_t>(static_cast<acc_t>(p.v[e]) - lr * d[u][e]);
      dst[threadIdx.x + u * kThreads] = p;
    }
  } else {  // element by element, still coalesced: thread t takes t, t + kThreads, ...
    acc_t d[kUpdatePerThread];
#pragma unroll
    for (int u = 0; u < kUpdatePerThread; ++u) d[u] = acc_t(0);
    for (int i = 0; i < m; ++i) {
      const acc_t w_i = w_shared[i];
      const scalar_t* row = cols + i * ld;
#pragma unroll
      for (int u = 0; u < kUpdatePerThread; ++u) {
        const int e = threadIdx.x + u * kThreads;
        if (e < count) d[u] += w_i * static_cast<acc_t>(row[e]);
      }
    }
#pragma unroll
    for (int u = 0; u < kUpdatePerThread; ++u) {
      const int e = threadIdx.x + u * kThreads;
      if (e < count) out[e] = static_cast<scalar_t>(static_cast<acc_t>(out[e]) - lr * d[u]);
    }
  }
}

template <typename scalar_t>
void launch_update(const Tensor& J, const std::vector<Tensor>& params, const UpdateArgs& args, cudaStream_t stream) {
  using acc_t = opmath_t<scalar_t>;
  const int64_t m = J.size(0), ld = J.stride(0);
  const size_t shared = static_cast<size_t>(m) * sizeof(acc_t);
  DRMOO_CHECK(shared <= 48 * 1024, "drmoo: the CUDA update supports up to ", 48 * 1024 / sizeof(acc_t),
              " tasks, got m = ", m);
  const scalar_t* data = J.const_data_ptr<scalar_t>();
  std::vector<Tensor> staged;  // contiguous copies of non-contiguous parameters, written back
  ParamTable<scalar_t> table{};
  int64_t chunks = 0, offset = 0;
  auto flush = [&] {
    if (table.count == 0) return;
    DRMOO_CHECK(chunks < (int64_t{1} << 31), "drmoo: too many parameter elements for one CUDA launch");
    update_kernel<scalar_t, acc_t><<<static_cast<unsigned>(chunks), kThreads, shared, stream>>>(
        data, ld, static_cast<int>(m), args, table);
    DRMOO_CUDA_LAUNCH_CHECK();
    table = ParamTable<scalar_t>{};
    chunks = 0;
  };
  for (const Tensor& param : params) {
    const int64_t count = param.numel();
    if (count == 0) continue;
    Tensor target = param;
    if (!param.is_contiguous()) {
      target = contiguous_copy(param, param.scalar_type());
      staged.push_back(target);
    }
    const int k = table.count++;
    table.ptr[k] = target.mutable_data_ptr<scalar_t>();
    table.col0[k] = offset;
    table.numel[k] = count;
    chunks += ceil_div(count, kUpdateChunk);
    table.chunk_end[k] = chunks;
    offset += count;
    if (table.count == kMaxTensorsPerLaunch) flush();
  }
  flush();
  // Write the staged copies back (unchanged values when the guard skipped the update).
  size_t next = 0;
  for (const Tensor& param : params) {
    if (param.numel() > 0 && !param.is_contiguous()) {
      Tensor target = param;
      torch::stable::copy_(target, staged[next++]);
    }
  }
}

// -------------------------------------------------------------------------------------------- ops
Tensor gram_cuda(const Tensor& J_in) {
  check_cuda("gram", J_in);
  const int32_t device = J_in.get_device_index();
  const torch::stable::accelerator::DeviceGuard guard(device);
  const Tensor J = cuda_jacobian("gram", J_in);
  const int64_t m = J.size(0);
  Tensor out = new_cuda_tensor({m, m}, acc_dtype(J.scalar_type()), device);
  const cudaStream_t stream = current_stream(device);
  dispatch_floating(J.scalar_type(), "gram", [&](auto tag) {
    using scalar_t = typename decltype(tag)::type;
    using acc_t = opmath_t<scalar_t>;
    const PartialsPlan plan = plan_partials<scalar_t>(J);
    const Tensor partials = new_cuda_tensor({plan.blocks * m * (m + 1) / 2}, ScalarType::Double, device);
    launch_partials<scalar_t>(plan, J, partials.mutable_data_ptr<double>(), stream);
    StepArgs none{};
    none.enabled = false;
    gram_finalize_kernel<acc_t><<<1, kFinalizeThreads, 0, stream>>>(partials.mutable_data_ptr<double>(), plan.blocks,
                                                                     m, out.mutable_data_ptr<acc_t>(), none);
    DRMOO_CUDA_LAUNCH_CHECK();
  });
  return out;
}

// params are declared mutated (Tensor(a!)[]): the update kernel writes them in place.
void combine_cuda(const Tensor& J_in, const Tensor& w, const std::vector<Tensor>& params, const Tensor& lr) {
  check_cuda("combine", J_in);
  const int32_t device = J_in.get_device_index();
  const torch::stable::accelerator::DeviceGuard guard(device);
  // Everything is checked before the first parameter is written (and before J is copied).
  check_jacobian("combine", J_in);
  check_combine_inputs(J_in, w, params, lr);
  const Tensor J = cuda_jacobian("combine", J_in);
  std::optional<Tensor> lr_keep;
  UpdateArgs args{scalar_ref(lr, device, &lr_keep), value_ref(w), nullptr};
  const cudaStream_t stream = current_stream(device);
  dispatch_floating(J.scalar_type(), "combine", [&](auto tag) {
    using scalar_t = typename decltype(tag)::type;
    launch_update<scalar_t>(J, params, args, stream);
  });
}

// w and params are declared mutated (Tensor(a!), Tensor(b!)[]): the kernels write them in place.
std::tuple<Tensor, Tensor, Tensor> gram_step_cuda(const Tensor& J_in, const Tensor& w,
                                                  const std::vector<Tensor>& params, double gamma, double c1,
                                                  double c2, double beta, double rho, const Tensor& mu,
                                                  const Tensor& z) {
  check_cuda("gram_step", J_in);
  const int32_t device = J_in.get_device_index();
  const torch::stable::accelerator::DeviceGuard guard(device);
  check_jacobian("gram_step", J_in);
  check_gram_step_inputs(J_in, w, params, gamma, c1, c2, beta, rho, mu, z);
  const Tensor J = cuda_jacobian("gram_step", J_in);
  const int64_t m = J.size(0);
  Tensor gram = new_cuda_tensor({m, m}, acc_dtype(J.scalar_type()), device);
  Tensor d_norm = new_cuda_tensor({}, ScalarType::Float, device);
  Tensor alpha = new_cuda_tensor({}, ScalarType::Float, device);
  std::optional<Tensor> mu_keep;
  StepArgs step{};
  step.enabled = true;
  step.w = value_ref(w);
  step.z = value_ref(z);
  step.mu = scalar_ref(mu, device, &mu_keep);
  step.gamma = gamma;
  step.c1 = c1;
  step.c2 = c2;
  step.beta = beta;
  step.rho = rho;
  step.d_norm = d_norm.mutable_data_ptr<float>();
  step.alpha = alpha.mutable_data_ptr<float>();
  const cudaStream_t stream = current_stream(device);
  dispatch_floating(J.scalar_type(), "gram_step", [&](auto tag) {
    using scalar_t = typename decltype(tag)::type;
    using acc_t = opmath_t<scalar_t>;
    const PartialsPlan plan = plan_partials<scalar_t>(J);
    const int64_t partial_count = plan.blocks * m * (m + 1) / 2;
    // One float64 workspace: partials, control (2 + m), the m x m step's work (4m).
    const Tensor workspace = new_cuda_tensor({partial_count + 2 + 5 * m}, ScalarType::Double, device);
    double* partials = workspace.mutable_data_ptr<double>();
    step.control = partials + partial_count;
    step.work = step.control + 2 + m;
    launch_partials<scalar_t>(plan, J, partials, stream);
    gram_finalize_kernel<acc_t><<<1, kFinalizeThreads, 0, stream>>>(partials, plan.blocks, m,
                                                                     gram.mutable_data_ptr<acc_t>(), step);
    DRMOO_CUDA_LAUNCH_CHECK();
    // The update reads lr = gamma*alpha, the flag and the incoming w from control.
    const UpdateArgs args{ValueRef{step.control, kStoreDouble, 0}, ValueRef{step.control + 2, kStoreDouble, 1},
                          step.control + 1};
    launch_update<scalar_t>(J, params, args, stream);
  });
  return {gram, d_norm, alpha};
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(drmoo, CUDA, m) {
  m.impl("gram", TORCH_BOX(&gram_cuda));
  m.impl("combine", TORCH_BOX(&combine_cuda));
  m.impl("gram_step", TORCH_BOX(&gram_step_cuda));
}

}  // namespace drmoo
