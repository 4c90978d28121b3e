// The drmoo operator library: every schema is declared here, once.  Kernels register against these
// names per device (csrc/cpu/*.cpp for CPU, csrc/cuda/*.cu for CUDA); the fake (meta) kernels used
// by torch.compile live in drmoo_kernels/_ops.py.
//
// Arguments annotated (a!) / (b!) are written in place; declaring them lets functionalization and
// torch.library.opcheck reason about the mutation.  Divergences are passed as (code, param), see
// drmoo_kernels.divergences.Divergence.code.
#include <Python.h>
#include <torch/library.h>
#include <torch/version.h>

// The torch version these kernels were compiled against, as plain bytes in the shared object:
// drmoo_kernels/_ops.py reads it from the file *before* loading it, so that a build made for
// another torch (whose C++ ABI differs) is refused with both versions named instead of failing
// with an undefined symbol, or worse, loading.
extern "C" __attribute__((used)) const char drmoo_built_with_torch[] = "drmoo-built-with-torch=" TORCH_VERSION ";";

extern "C" {
// `import drmoo_kernels._C` only has to load this shared object so that the registrations below
// run; the module itself is empty.
PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr,
                                          nullptr, nullptr, nullptr, nullptr};
  return PyModule_Create(&module_def);
}
}

TORCH_LIBRARY(drmoo, m) {
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
}
