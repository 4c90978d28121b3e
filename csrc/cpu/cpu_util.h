// Helpers shared by the CPU kernels, which are written against torch's LibTorch stable ABI
// (torch::stable::Tensor, torch/headeronly; built with TORCH_TARGET_VERSION = the oldest supported
// torch, see setup.py): the dtype switch and the math dtype (dispatch.h), scheduling of fixed-size tasks on torch's
// thread pool, and direct access to the small per-task vectors (eta, w, z) and 0-d scalars (mu, lr).
//
// Why not plain parallel_for(0, tasks, 1, ...) and tensor conversions: the ops are called once
// per optimizer step, often on small inputs, on machines whose cores may be shared.
//   - A parallel region costs ~5-20 us of thread wake-up and join on an idle machine, and up to a
//     scheduler time slice (milliseconds) when the other core is busy, because the join waits for
//     the slowest thread.  Small work therefore runs inline on the calling thread.
//   - parallel_for splits the range statically, so a descheduled thread holds half of the work
//     hostage.  run_tasks lets the threads claim tasks one at a time instead.
//   - Every torch op (to(kDouble), copy_, item) costs 1-5 us of dispatch and allocation, more through
//     the stable ABI's boxed calls; for the m-element vectors a loop over the data pointer costs
//     nanoseconds.
#pragma once

#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <initializer_list>
#include <limits>
#include <string>
#include <vector>

#ifdef __linux__
#include <sys/sysinfo.h>
#endif

#include "../allocate.h"
#include "../checks.h"
#include "../dispatch.h"

namespace drmoo {

using Tensor = torch::stable::Tensor;

// Calls body(TypeTag<scalar_t>{}) for the four floating dtypes (dispatch.h).
template <typename Body>
void dispatch_floating(ScalarType type, const char* op, const Body& body) {
  dispatch_floating_on("CPU", type, op, body);
}

// Runs body(t) once for every t in [0, tasks).  Uses more than one thread only when every thread
// gets at least `min_tasks_per_thread` tasks.  Threads claim tasks dynamically; since each task
// writes its own partial results and the caller combines them in task order, the results do not
// depend on which thread ran which task, nor on the thread count.
//
// Nesting: the regular-API version of this function also ran inline when called inside a parallel
// region (at::in_parallel_region(), which the stable ABI does not offer).  That was a shortcut, not
// a correctness condition: torch::stable::parallel_for is at::parallel_for, which itself runs the
// body inline, as one call over the whole range, when it is entered from inside a parallel region.
// The body below ignores its range and drains the shared task queue, so one inline call runs every
// task exactly once, in task order -- the same tasks, partial sums and results as any thread
// count.  (No kernel here calls run_tasks from inside a task; a nested call can only come from a
// caller that runs a drmoo op inside its own parallel_for.)
template <typename Body>
void run_tasks(int64_t tasks, int64_t min_tasks_per_thread, const Body& body) {
  const int64_t per_thread = std::max<int64_t>(1, min_tasks_per_thread);
  const int64_t threads =
      std::min<int64_t>(static_cast<int64_t>(torch::stable::get_num_threads()), tasks / per_thread);
  if (threads <= 1) {
    for (int64_t t = 0; t < tasks; ++t) body(t);
    return;
  }
  std::atomic<int64_t> next{0};
  // One range element per thread: the lambda runs once on each thread and drains the shared queue.
  torch::stable::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t t = next.fetch_add(1, std::memory_order_relaxed); t < tasks;
         t = next.fetch_add(1, std::memory_order_relaxed)) {
      body(t);
    }
  });
}

// Number of tasks of `task_size` units each that make up `min_units` (at least 1).
inline int64_t tasks_for(int64_t min_units, int64_t task_size) {
  return std::max<int64_t>(1, (min_units + task_size - 1) / std::max<int64_t>(1, task_size));
}

// out[i] = float64(t[i]) for a 1-D floating CPU tensor of any stride.
inline void read_f64(const Tensor& t, double* out) {
  const int64_t count = t.numel();
  const int64_t stride = t.dim() == 0 ? 0 : t.stride(0);
  dispatch_floating(t.scalar_type(), "read_f64", [&](auto tag) {
    using scalar_t = typename decltype(tag)::type;
    const scalar_t* src = t.const_data_ptr<scalar_t>();
    for (int64_t i = 0; i < count; ++i) out[i] = static_cast<double>(src[i * stride]);
  });
}

// t[i] = values[i] for a 1-D floating CPU tensor, converted as copy_ converts (static_cast: round to
// nearest; exact for work copies the kernels already rounded with round_to).
inline void write_f64(const Tensor& t, const double* values) {
  const int64_t count = t.numel();
  const int64_t stride = t.dim() == 0 ? 0 : t.stride(0);
  dispatch_floating(t.scalar_type(), "write_f64", [&](auto tag) {
    using scalar_t = typename decltype(tag)::type;
    scalar_t* dst = t.mutable_data_ptr<scalar_t>();
    for (int64_t i = 0; i < count; ++i) dst[i * stride] = static_cast<scalar_t>(values[i]);
  });
}

// The value of a one-element floating CPU tensor (mu, lr; check_one_value passed) as float64, which
// must be finite and >= 0.
inline double scalar_f64(const char* op, const char* name, const Tensor& t) {
  double value = 0.0;
  read_f64(t, &value);
  check_number(op, name, value, /*allow_zero=*/true);
  return value;
}

// sample_weight (importance weights, any stride) must be finite and >= 0: read on the host, which the
// CPU kernels do anyway, so a direct op call is refused like the backends' (the CUDA kernels do not
// read it: that would synchronise the device).
inline void check_sample_weight_values(const char* op, const Tensor& weights) {
  const int64_t rows = weights.size(0), cols = weights.size(1);
  const int64_t row_stride = weights.stride(0), col_stride = weights.stride(1);
  bool valid = true;
  dispatch_floating(weights.scalar_type(), op, [&](auto tag) {
    using scalar_t = typename decltype(tag)::type;
    const scalar_t* data = weights.const_data_ptr<scalar_t>();
    for (int64_t b = 0; b < rows; ++b) {
      for (int64_t i = 0; i < cols; ++i) {
        const double value = static_cast<double>(data[b * row_stride + i * col_stride]);
        valid &= value >= 0.0 && value <= std::numeric_limits<double>::max();  // NaN fails both
      }
    }
  });
  DRMOO_CHECK(valid, "drmoo.", op,
              ": sample_weight (importance weights) must be finite and >= 0; it has negative, NaN or Inf entries");
}

// This machine's RAM plus swap in bytes (no allocation can exceed it); +infinity where unknown.
inline double machine_memory_bytes() {
#ifdef __linux__
  struct sysinfo info {};
  if (sysinfo(&info) == 0) {
    return (static_cast<double>(info.totalram) + static_cast<double>(info.totalswap)) *
           static_cast<double>(info.mem_unit);
  }
#endif
  return std::numeric_limits<double>::infinity();
}

// A new contiguous CPU tensor of the given shape in one of the four floating dtypes (allocate.h says why
// through the C shim).
inline Tensor new_cpu_tensor(const std::vector<int64_t>& sizes, ScalarType dtype) {
  // Refuse a request larger than the machine's memory (RAM + swap) before asking torch: its allocator's
  // failure would come back as a status only after torch 2.11's shim has logged a C++ backtrace to
  // stderr, which buries the one-line message.
  return new_floating_tensor(sizes, dtype, aoti_torch_device_type_cpu(), 0, "CPU", "a CPU tensor", "",
                             machine_memory_bytes());
}

inline Tensor new_cpu_tensor(std::initializer_list<int64_t> shape, ScalarType dtype) {
  return new_cpu_tensor(std::vector<int64_t>(shape), dtype);
}

// A contiguous copy of `t` in `dtype`: allocated by new_cpu_tensor (a failure names its size), filled
// by copy_, which cannot fail on checked arguments.  Instead of torch::stable::contiguous / to, whose
// allocation failure would lose its cause (see above).
inline Tensor contiguous_copy(const Tensor& t, ScalarType dtype) {
  const auto sizes = t.sizes();
  Tensor out = new_cpu_tensor(std::vector<int64_t>(sizes.begin(), sizes.end()), dtype);
  torch::stable::copy_(out, t);
  return out;
}

// The CPU kernels read J row by row with unit stride: a J whose columns are not adjacent is copied.
inline Tensor with_unit_column_stride(const Tensor& J) {
  return J.stride(1) == 1 ? J : contiguous_copy(J, J.scalar_type());
}

inline void check_cpu(const char* op, const Tensor& t) {
  DRMOO_CHECK(t.is_cpu(), "drmoo.", op, ": the CPU kernel got tensors on ", device_str(t.device()));
}

}  // namespace drmoo
