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


def compile_sm90(kernel, types: dict, consts: dict, num_warps: int, num_stages: int = 2, floats=(),
                 aligned=None):
    """triton.compile for sm_90 through Triton's own ptxas, no GPU needed: pointer types from
    `types`, the scalars in `floats` fp32, other scalars i32; the `aligned` arguments (default:
    pointers and strides) marked 16-divisible as the launcher specializes them. Skips where this
    platform has no ptxas."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {n: "constexpr" if n in consts else types.get(n, "fp32" if n in floats else "i32")
                 for n in kernel.arg_names}
    if aligned is None:
        aligned = [n for n in kernel.arg_names if n.endswith("_ptr") or n.startswith("stride_")]
    attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned if n not in consts}
    try:
        return triton.compile(ASTSource(kernel, signature, consts, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})
    except RuntimeError as e:  # no ptxas for this platform
        if "ptxas" in str(e).lower():
            pytest.skip(f"no ptxas: {e}")
        raise
