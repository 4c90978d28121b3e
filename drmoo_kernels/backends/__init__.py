"""Accelerated implementations of the ops in :mod:`drmoo_kernels.reference`, one module per backend.

Each module exposes the reference's op names with the same signatures and ``availability()``; see
:mod:`drmoo_kernels.dispatch`.
"""
