// Helpers shared by the CPU kernels: scheduling of fixed-size tasks on the ATen thread pool, and
// direct access to the small per-task vectors (eta, w, z) and 0-d scalars (mu, lr).
//
// Why not plain at::parallel_for(0, tasks, 1, ...) and tensor conversions: the ops are called once
// per optimizer step, often on small inputs, on machines whose cores may be shared.
//   - A parallel region costs ~5-20 us of thread wake-up and join on an idle machine, and up to a
//     scheduler time slice (milliseconds) when the other core is busy, because the join waits for
//     the slowest thread.  Small work therefore runs inline on the calling thread.
//   - at::parallel_for splits the range statically, so a descheduled thread holds half of the work
//     hostage.  run_tasks lets the threads claim tasks one at a time instead.
//   - Every ATen op (.to(kDouble), .copy_, .item) costs 1-5 us of dispatch and allocation; for the
//     m-element vectors a loop over the data pointer costs nanoseconds.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "../checks.h"

namespace drmoo {

// Runs body(t) once for every t in [0, tasks).  Uses more than one thread only when every thread
// gets at least `min_tasks_per_thread` tasks.  Threads claim tasks dynamically; since each task
// writes its own partial results and the caller combines them in task order, the results do not
// depend on which thread ran which task, nor on the thread count.
template <typename Body>
void run_tasks(int64_t tasks, int64_t min_tasks_per_thread, const Body& body) {
  const int64_t per_thread = std::max<int64_t>(1, min_tasks_per_thread);
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), tasks / per_thread);
  if (threads <= 1 || at::in_parallel_region()) {
    for (int64_t t = 0; t < tasks; ++t) body(t);
    return;
  }
  std::atomic<int64_t> next{0};
  // One range element per thread: the lambda runs once on each thread and drains the shared queue.
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
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
inline void read_f64(const at::Tensor& t, double* out) {
  const int64_t count = t.numel();
  const int64_t stride = t.dim() == 0 ? 0 : t.stride(0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, t.scalar_type(), "drmoo_read_f64", [&] {
    const scalar_t* src = t.const_data_ptr<scalar_t>();
    for (int64_t i = 0; i < count; ++i) out[i] = static_cast<double>(src[i * stride]);
  });
}

// t[i] = values[i] for a 1-D floating CPU tensor, converted as copy_ converts (static_cast: round to
// nearest; exact for work copies the kernels already rounded with round_to).
inline void write_f64(at::Tensor& t, const double* values) {
  const int64_t count = t.numel();
  const int64_t stride = t.dim() == 0 ? 0 : t.stride(0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, t.scalar_type(), "drmoo_write_f64", [&] {
    scalar_t* dst = t.mutable_data_ptr<scalar_t>();
    for (int64_t i = 0; i < count; ++i) dst[i * stride] = static_cast<scalar_t>(values[i]);
  });
}

// The value of a one-element tensor (mu, lr) as float64.
inline double scalar_f64(const char* op, const char* name, const at::Tensor& t) {
  DRMOO_CHECK_VALUE(t.numel() == 1, "drmoo.", op, ": ", name, " must hold one value, got shape ", shape_str(t));
  const at::ScalarType type = t.scalar_type();
  if (t.is_cpu() && (type == at::kDouble || type == at::kFloat)) {
    return type == at::kDouble ? *t.const_data_ptr<double>() : static_cast<double>(*t.const_data_ptr<float>());
  }
  return t.item<double>();  // other dtypes or devices: the general (slower) path
}

}  // namespace drmoo
