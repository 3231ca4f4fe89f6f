"""The maths of each method on single linear layers with synthetic inputs."""

import pytest
import torch

from slmedge.compress.methods.base import HessianStats, InputNormStats
from slmedge.compress.methods.gptq import gptq_quantize
from slmedge.compress.methods.pruning import prune_by_score
from slmedge.compress.methods.sparsegpt import sparsegpt_prune
from slmedge.compress.quant import QuantSpec, dequantize_codes, quantize_groups
from slmedge.compress.recipe import Sparsity


def layer_and_inputs(rows=48, cols=64, tokens=2048, seed=0):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(rows, cols, generator=g)
    # Correlated inputs with uneven channel scales, like real activations.
    mix = torch.randn(cols, cols, generator=g) / cols**0.5 + torch.eye(cols)
    X = (torch.randn(tokens, cols, generator=g) @ mix) * (torch.rand(cols, generator=g) * 4 + 0.1)
    H = HessianStats(cols, "cpu")
    for chunk in X.split(512):
        H.add_batch(chunk)
    return W, X, H


def output_error(W, Q, X):
    return float(((X @ (W - Q).t()) ** 2).sum())


@pytest.mark.parametrize("bits,group,sym,actorder", [(4, 16, False, True), (4, 16, True, False), (3, -1, False, True),
                                                       (4, 24, False, True), (2, 32, True, True), (8, -1, True, False)])
def test_gptq_error_is_at_most_rtn_error(bits, group, sym, actorder):
    W, X, H = layer_and_inputs()
    spec = QuantSpec(bits, group, sym)
    Q, codes, scales, zeros, perm = gptq_quantize(W, H.H, spec, blocksize=16, actorder=actorder)
    rtn = quantize_groups(W, spec)[0]
    assert output_error(W, Q, X) <= output_error(W, rtn, X)
    # The codes are the result: they dequantize exactly to Q, groups in original column order.
    assert torch.equal(dequantize_codes(codes, scales, zeros, spec), Q)
    assert (perm is not None) == actorder


def test_gptq_act_order_keeps_groups_contiguous():
    W, X, H = layer_and_inputs()
    spec = QuantSpec(4, 16, False)
    Q, codes, scales, zeros, perm = gptq_quantize(W, H.H, spec, actorder=True)
    assert scales.shape == (48, 4)
    assert not torch.equal(perm, torch.arange(64))


@pytest.mark.parametrize("sparsity,block", [("0.5", 16), ("0.75", 32), ("0.3", 24)])
def test_sparsegpt_reaches_the_ratio_in_every_column_block(sparsity, block):
    W, X, H = layer_and_inputs()
    sp = Sparsity.parse(sparsity)
    Wp, keep, *_ = sparsegpt_prune(W, H.H, sp, blocksize=block)
    for start in range(0, 64, block):
        part = keep[:, start : start + block]
        assert int((~part).sum()) == round(part.numel() * sp.ratio)
    assert torch.equal(Wp[~keep], torch.zeros(int((~keep).sum())))


@pytest.mark.parametrize("nm", ["2:4", "4:8", "1:4"])
def test_sparsegpt_nm_holds_in_every_block(nm):
    W, X, H = layer_and_inputs()
    sp = Sparsity.parse(nm)
    Wp, keep, *_ = sparsegpt_prune(W, H.H, sp, blocksize=16)
    dropped = (~keep).reshape(48, -1, sp.m).sum(dim=2)
    assert (dropped == sp.n).all()
    assert ((Wp == 0) | keep).all() and (Wp[~keep] == 0).all()


def test_sparsegpt_reconstructs_better_than_pruning_without_update():
    W, X, H = layer_and_inputs()
    sp = Sparsity.parse("0.5")
    Wp, keep, *_ = sparsegpt_prune(W, H.H, sp, blocksize=16)
    norms = InputNormStats(64, "cpu")
    norms.add_batch(X)
    wanda_keep = prune_by_score(W.abs() * norms.scaler_row.sqrt(), sp, group="row")
    assert output_error(W, Wp, X) < output_error(W, W * wanda_keep, X)


def test_sparsegpt_joint_quantization_keeps_zeros_and_codes():
    W, X, H = layer_and_inputs()
    spec = QuantSpec(4, 16, False)
    Wp, keep, codes, scales, zeros = sparsegpt_prune(W, H.H, Sparsity.parse("2:4"), spec, blocksize=16)
    assert torch.equal(dequantize_codes(codes, scales, zeros, spec), Wp)
    assert (Wp[~keep] == 0).all()


@pytest.mark.parametrize("sparsity", ["0.5", "0.6", "2:4", "4:8"])
def test_wanda_comparison_group_is_the_output_row(sparsity):
    W, X, H = layer_and_inputs()
    sp = Sparsity.parse(sparsity)
    norms = InputNormStats(64, "cpu")
    norms.add_batch(X)
    keep = prune_by_score(W.abs() * norms.scaler_row.sqrt(), sp, group="row")
    if sp.is_nm:
        assert ((~keep).reshape(48, -1, sp.m).sum(dim=2) == sp.n).all()
    else:
        assert ((~keep).sum(dim=1) == int(64 * sp.ratio)).all()


def test_wanda_uses_activation_norms():
    W = torch.ones(2, 4)
    keep = prune_by_score(W.abs() * torch.tensor([1.0, 5.0, 0.1, 3.0]).sqrt(), Sparsity.parse("0.5"), group="row")
    assert keep.tolist() == [[False, True, False, True]] * 2


def test_magnitude_comparison_group_is_the_layer():
    W = torch.tensor([[0.1, 0.2, 0.3, 0.4], [5.0, 6.0, 7.0, 8.0]])
    keep = prune_by_score(W.abs(), Sparsity.parse("0.5"), group="layer")
    assert keep.tolist() == [[False] * 4, [True] * 4]


@pytest.mark.parametrize("text", ["4:4", "5:4", "0:4", "-0.1", "1", "1.5", "half"])
def test_impossible_sparsity_is_refused(text):
    from slmedge.errors import ConfigError

    with pytest.raises(ConfigError):
        Sparsity.parse(text)
