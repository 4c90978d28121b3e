"""The version of the drmoo distribution (both packages, drmoo and drmoo_kernels): written here only.

pyproject.toml reads it statically (``[tool.setuptools.dynamic]``) and ``drmoo --version`` imports
this file alone, so neither needs torch.
"""

__version__ = "0.2.0"
