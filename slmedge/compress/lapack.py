"""GPTQ's and SparseGPT's factor of H^-1 straight from torch's own LAPACK, without torch's layout copies.

``torch.linalg.cholesky`` / ``torch.cholesky_inverse`` / ``torch.linalg.cholesky(upper=True)`` call
LAPACK's ``spotrf``/``spotri``/``spotrf`` on column-major copies and then zero or mirror the other
triangle on those column-major tensors. On the 1536-wide Hessian of SmolLM2's down_proj, on one
thread, the three routines take ~40 ms and torch's copies and triangle masks another ~50-60 ms
(measured: 98 ms against 60 ms here), about 2 s over the model's 30 blocks.

Here the same three routines of the same library (torch's MKL, whose symbols libtorch_cpu exports)
run on one buffer in place, reading the triangles torch's calls read, so the factor comes out the
same bits (``available`` checks that once per process against torch's calls on a test matrix;
where they differ, torch's path is kept). Only where torch's LAPACK is MKL, on little-endian Linux
x86-64, and on one thread, where GPTQ computes its factors (``gptq.hessian_plan``).
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import sys

import torch

# Integer arguments are passed as 64-bit values: an LP64 LAPACK reads their low half (little-endian),
# an ILP64 one all of it, so either reads the right numbers.
_I64 = ctypes.c_int64


class _Lapack:
    def __init__(self, lib):
        self.potrf, self.potri = lib.spotrf_, lib.spotri_

    def call(self, fn, uplo: bytes, a: torch.Tensor) -> int:
        """``fn(uplo, n, a, n, info)`` on the contiguous square fp32 ``a``, in place; LAPACK's info."""
        n = _I64(a.shape[0])
        info = _I64(0)
        fn(ctypes.byref(ctypes.c_char(uplo)), ctypes.byref(n), ctypes.c_void_p(a.data_ptr()), ctypes.byref(n),
           ctypes.byref(info), ctypes.c_size_t(1))  # the last: Fortran's hidden length of ``uplo``
        low = info.value & 0xFFFFFFFF
        return low - (1 << 32) if low >= 1 << 31 else low


@functools.cache
def _library() -> _Lapack | None:
    if sys.byteorder != "little" or platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None
    if "LAPACK_INFO=mkl" not in torch.__config__.show():
        return None
    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
        return _Lapack(lib)
    except (OSError, AttributeError):
        return None


def available(H: torch.Tensor) -> bool:
    """Whether this path takes ``H``: fp32 on the CPU, with torch's MKL (checked once against
    torch's calls, ``agrees_with_torch``), on one thread (where GPTQ computes its factors)."""
    return (H.device.type == "cpu" and H.dtype == torch.float32 and H.dim() == 2 and torch.get_num_threads() == 1
            and _library() is not None and agrees_with_torch())


def cholesky_columns(H: torch.Tensor) -> torch.Tensor:
    """``torch.linalg.cholesky(H)``'s spotrf call, in place on a copy of H's column-major buffer
    (which, read row by row, is H's transpose): returns that buffer, whose column-major lower
    triangle holds L. ``torch.linalg.LinAlgError`` where H is not positive definite, as torch."""
    lapack = _library()
    a = H.t().contiguous()
    info = lapack.call(lapack.potrf, b"L", a)
    if info > 0:
        raise torch.linalg.LinAlgError(f"the leading minor of order {info} is not positive-definite")
    if info < 0:
        raise RuntimeError(f"LAPACK spotrf rejected argument {-info}")
    return a


def upper_factor_of_inverse(a: torch.Tensor) -> torch.Tensor:
    """From ``cholesky_columns``' buffer, ``torch.linalg.cholesky(torch.cholesky_inverse(L), upper=True)``:
    the upper Cholesky factor of H^-1, with torch's bits and strides."""
    lapack = _library()
    if lapack.call(lapack.potri, b"L", a) != 0:  # column-major lower triangle: H^-1's
        raise RuntimeError("LAPACK spotri failed on a matrix that spotrf factored")
    # H^-1's lower triangle is now row-major a's upper; spotrf('U') reads the column-major upper of
    # its argument, which is the row-major lower of a's transpose: the values torch mirrors there.
    b = a.t().contiguous()
    info = lapack.call(lapack.potrf, b"U", b)  # column-major upper triangle: the factor
    if info > 0:
        raise torch.linalg.LinAlgError(f"the leading minor of order {info} is not positive-definite")
    if info < 0:
        raise RuntimeError(f"LAPACK spotrf rejected argument {-info}")
    return b.tril_().t()  # column-major, as torch returns it


def _torch_path(H: torch.Tensor) -> torch.Tensor:
    return torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)


@functools.cache
def agrees_with_torch() -> bool:
    """Whether this path gives torch's bits, on a 300-wide test matrix (past MKL's block sizes), on
    the thread count in force: checked once per process."""
    try:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(600, 300, generator=g) * (torch.rand(300, generator=g) + 0.1)
        H = x.t() @ x / 600
        H = (H + H.t()) / 2
        H.diagonal().add_(0.01 * H.diagonal().mean())
        fast = upper_factor_of_inverse(cholesky_columns(H))
        ref = _torch_path(H)
        return fast.stride() == ref.stride() and torch.equal(fast, ref)
    except Exception:  # noqa: BLE001 - any surprise in the foreign call: keep torch's path
        return False
