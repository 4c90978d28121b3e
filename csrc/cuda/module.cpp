// drmoo_kernels._C_cuda: the CUDA kernels (csrc/cuda/*.cu), built like drmoo_kernels._C on torch's
// LibTorch stable ABI (STABLE_TORCH_LIBRARY_IMPL, torch::stable::Tensor, TORCH_TARGET_VERSION = the
// oldest supported torch; setup.py) and Python's limited API.  A separate extension only because it
// needs nvcc and the CUDA runtime: its kernels register (STABLE_TORCH_LIBRARY_IMPL(drmoo, CUDA, ...))
// against the schemas that drmoo_kernels._C declares, so drmoo_kernels/_ops.py loads _C first.
#include <Python.h>
#include <torch/headeronly/version.h>

#ifndef DRMOO_STABLE_TARGET
#error "setup.py defines DRMOO_STABLE_TARGET (the torch release of TORCH_TARGET_VERSION, e.g. \"2.11\")"
#endif

// The same plain bytes as csrc/ops.cpp writes, read by drmoo_kernels/_ops.py from the file *before*
// loading it: the torch whose headers compiled it, and the oldest torch whose stable ABI it may use.
// With the stable marker the build loads under any torch >= that version; an older drmoo's
// regular-ABI _C_cuda (no stable marker) only under the torch it was built with.
extern "C" __attribute__((used)) const char drmoo_built_with_torch[] =
    "drmoo-built-with-torch=" TORCH_VERSION ";drmoo-stable-abi-target=" DRMOO_STABLE_TARGET ";";

extern "C" {
// `import drmoo_kernels._C_cuda` only has to load this shared object so that the kernels'
// registrations run; the module itself is empty.
PyMODINIT_FUNC PyInit__C_cuda(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C_cuda", nullptr, -1, nullptr,
                                          nullptr, nullptr, nullptr, nullptr};
  return PyModule_Create(&module_def);
}
}
