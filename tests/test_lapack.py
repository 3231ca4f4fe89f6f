"""compress.lapack: GPTQ's and SparseGPT's factor of H^-1 from torch's own LAPACK in place, the same bits
and strides as torch's calls, and the same errors."""

from __future__ import annotations

import platform

import pytest
import torch

from slmedge.compress import lapack
from slmedge.compress.methods import gptq

X86_LINUX = platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64")
MKL = "LAPACK_INFO=mkl" in torch.__config__.show()
needs_mkl = pytest.mark.skipif(not (X86_LINUX and MKL),
                               reason="the in-place path runs only with torch's MKL on Linux x86-64")


def _hessian(n, tokens, seed, dead=()):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, n, generator=g) * (torch.rand(n, generator=g) * 4 + 0.01)
    x[:, list(dead)] = 0
    return x.t() @ x / tokens


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@needs_mkl
@pytest.mark.parametrize("n,tokens", [(8, 64), (96, 400), (576, 2048), (1536, 2048), (700, 300)])
def test_the_factor_is_torchs_bit_for_bit(n, tokens, one_thread):
    """Widths past MKL's block sizes, and (700 columns, 300 tokens) a rank-deficient H that only the
    damping makes positive definite: hinv_factor's result, in place, equals torch's three calls."""
    H = _hessian(n, tokens, seed=n, dead=(3,))
    assert lapack.available(H)
    fast, dead = gptq.hinv_factor(H, 0.01)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lapack, "available", lambda H: False)
        ref, ref_dead = gptq.hinv_factor(H, 0.01)
    assert fast.stride() == ref.stride() and fast.shape == ref.shape
    assert torch.equal(fast, ref) and torch.equal(dead, ref_dead)
    assert torch.equal(fast, fast.triu())


@needs_mkl
def test_a_matrix_that_is_not_positive_definite_is_refused_as_torch_refuses_it(one_thread):
    H = _hessian(64, 256, seed=1)
    H[10, 10] = -1.0
    assert lapack.available(H)
    with pytest.raises(torch.linalg.LinAlgError):
        lapack.cholesky_columns(H)
    with pytest.raises(torch.linalg.LinAlgError):
        torch.linalg.cholesky(H)


@needs_mkl
def test_hinv_factor_damps_harder_on_the_in_place_path_as_on_torchs(one_thread, monkeypatch):
    """A Hessian whose damped form still fails the first Cholesky: both paths add the same extra
    damping and give the same bits."""
    H = _hessian(48, 256, seed=2)
    mean = H.diagonal().mean()
    H[7, :] = 0
    H[:, 7] = 0
    H[7, 7] = -0.05 * mean  # still negative after 1% damping, positive after the extra 10% (and 1e-6)
    calls = []
    real = lapack.cholesky_columns
    monkeypatch.setattr(lapack, "cholesky_columns", lambda A: calls.append(1) or real(A))
    fast, _ = gptq.hinv_factor(H, 0.01)
    assert len(calls) == 2  # refused, then damped harder
    monkeypatch.setattr(lapack, "available", lambda H: False)
    ref, _ = gptq.hinv_factor(H, 0.01)
    assert torch.equal(fast, ref)


def test_elsewhere_torchs_calls_run():
    """On two threads (or any tensor the path does not take) hinv_factor uses torch's calls."""
    H = _hessian(32, 128, seed=3)
    if torch.get_num_threads() > 1:
        assert not lapack.available(H)
    assert not lapack.available(H.double())
    assert not lapack.available(H.to(torch.bfloat16))
