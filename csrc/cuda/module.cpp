// drmoo_kernels._C_cuda: the CUDA kernels (csrc/cuda/*.cu), a regular-ABI extension beside the
// stable-ABI drmoo_kernels._C.  Its kernels register (TORCH_LIBRARY_IMPL(drmoo, CUDA, ...)) against the
// schemas that drmoo_kernels._C declares, so drmoo_kernels/_ops.py loads _C first.
#include <Python.h>
#include <torch/version.h>

// The torch version these kernels were compiled against, as plain bytes in the shared object:
// drmoo_kernels/_ops.py reads it from the file *before* loading it, so that a build made for
// another torch (whose C++ ABI differs) is refused with both versions named instead of failing
// with an undefined symbol, or worse, loading.  No stable-ABI marker: this build is for one torch.
extern "C" __attribute__((used)) const char drmoo_built_with_torch[] = "drmoo-built-with-torch=" TORCH_VERSION ";";

extern "C" {
PyMODINIT_FUNC PyInit__C_cuda(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C_cuda", nullptr, -1, nullptr,
                                          nullptr, nullptr, nullptr, nullptr};
  return PyModule_Create(&module_def);
}
}
