// The drmoo operator library: every schema is declared here, once.  Kernels register against these
// names per device (csrc/cpu/*.cpp for CPU, csrc/cuda/*.cu for CUDA); the fake (meta) kernels used
// by torch.compile live in drmoo_kernels/_ops.py.
//
// This file and csrc/cpu/ form drmoo_kernels._C, built against torch's LibTorch stable ABI
// (STABLE_TORCH_LIBRARY, torch::stable::Tensor, torch/headeronly) with TORCH_TARGET_VERSION set to the
// oldest supported torch (setup.py) and Python's limited API: one build loads under that torch and
// every later one.  The CUDA kernels are a separate extension on the same stable ABI,
// drmoo_kernels._C_cuda (csrc/cuda/), that registers its implementations against these schemas.
//
// Arguments annotated (a!) / (b!) are written in place; declaring them lets functionalization and
// torch.library.opcheck reason about the mutation.  Divergences are passed as (code, param), see
// drmoo_kernels.divergences.Divergence.code.
#include <Python.h>
#include <torch/csrc/stable/library.h>
#include <torch/headeronly/version.h>

#ifndef DRMOO_STABLE_TARGET
#error "setup.py defines DRMOO_STABLE_TARGET (the torch release of TORCH_TARGET_VERSION, e.g. \"2.11\")"
#endif

// Plain bytes in the shared object that drmoo_kernels/_ops.py reads from the file *before* loading it:
// the torch whose headers compiled it, and the oldest torch whose stable ABI it may use.  A build
// with the stable marker loads under any torch >= that version; a build without it (an older drmoo)
// only under the torch it was built with.
extern "C" __attribute__((used)) const char drmoo_built_with_torch[] =
    "drmoo-built-with-torch=" TORCH_VERSION ";drmoo-stable-abi-target=" DRMOO_STABLE_TARGET ";";

extern "C" {
// `import drmoo_kernels._C` only has to load this shared object so that the registrations below
// run; the module itself is empty.
PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr,
                                          nullptr, nullptr, nullptr, nullptr};
  return PyModule_Create(&module_def);
}
}

STABLE_TORCH_LIBRARY(drmoo, m) {
  m.def(
      "dual_forward(Tensor losses, Tensor eta, float lam, float scale, int code, float param, "
      "Tensor? sample_weight) -> (Tensor objective, Tensor grad_eta, Tensor weights)");
  m.def(
      "dual_step(Tensor losses, Tensor(a!) eta, Tensor w, float lam, float scale, int code, float param, "
      "float gamma, float f1, float f2, Tensor? sample_weight) -> (Tensor z, Tensor mu, Tensor weights)");
  m.def("gram(Tensor J) -> Tensor");
  m.def("combine(Tensor J, Tensor w, Tensor(a!)[] params, Tensor lr) -> ()");
  m.def(
      "gram_step(Tensor J, Tensor(a!) w, Tensor(b!)[] params, float gamma, float c1, float c2, float beta, "
      "float rho, Tensor mu, Tensor z) -> (Tensor gram, Tensor d_norm, Tensor alpha)");
  // Entry i: the sum of squares of tensors[i]'s entries (CPU only: on a GPU torch._foreach_norm is already
  // one fused launch).  An empty list has no tensor to dispatch on: the backends' wrappers answer it.
  m.def("sum_squares(Tensor[] tensors) -> Tensor");
}
