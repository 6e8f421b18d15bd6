"""Where the Triton tests run: on CUDA (marked gpu), or under Triton's interpreter on the CPU
(marked triton_interp: a tier of its own, `make test-triton`, left out of the fast tier).

The interpreter runs only when TRITON_INTERPRET=1 is set before triton is imported; on a
machine without CUDA, tests/conftest.py sets it when triton is installed, so
`pytest -m triton_interp tests` runs the kernels interpreted.
"""

from __future__ import annotations

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")])
INTERPRETER = pytest.param("cpu", marks=[
    pytest.mark.triton_interp,
    pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 before triton is imported")])


def _index_scalars_with_numpy_2_4() -> None:
    """Triton 3.6's interpreter turns a scalar tensor into an int with int(array) on a
    one-element 1-d array, which numpy >= 2.4 refuses; loops with runtime bounds then fail.
    Use .item() instead."""
    from triton.runtime import interpreter

    patch_tensor = interpreter._patch_lang_tensor

    def patch(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    interpreter._patch_lang_tensor = patch


if INTERPRET:
    _index_scalars_with_numpy_2_4()
