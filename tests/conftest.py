"""Shared test setup.

On a machine without CUDA the kernels run in Triton's interpreter on CPU tensors; the
switch must be set before triton is first imported, hence here.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
