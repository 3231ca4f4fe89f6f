"""True-sequential short-cuts (compress.shortcuts): the same bits as every pass from the block's input,
with fewer block forwards; a module whose output is not its last linear's is found out and run whole."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from tiny import TINY_TYPES, tiny_model  # noqa: E402

from slmedge.compress import engine, shortcuts  # noqa: E402
from slmedge.compress.recipe import Recipe  # noqa: E402
from slmedge.models.architectures import architecture_for  # noqa: E402


def _calibration(seed=1, n=6, seqlen=24):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 384, (n, seqlen), generator=g)


def _run(model_type, recipe, use, monkeypatch=None, attn="sdpa"):
    model = tiny_model(model_type)
    try:
        model.set_attn_implementation(attn)  # what a loaded model gets by default (tiny_model: eager)
    except ValueError:  # transformers 5.21+ offers Gemma 2 (soft-capped attention) eager only: its default then
        if not getattr(model.config, "attn_logit_softcapping", None):
            raise
    arch = architecture_for(model.config)
    calls = {"blocks": 0}
    real = type(model.get_submodule(arch.layers)[0]).forward

    def counting(self, *a, **k):
        calls["blocks"] += 1
        return real(self, *a, **k)

    if monkeypatch is not None:
        monkeypatch.setattr(type(model.get_submodule(arch.layers)[0]), "forward", counting)
    res = engine.compress_model(model, arch, recipe, _calibration(), "cpu", shortcuts=use)
    return model, res, calls["blocks"]


def _assert_same_bits(model_a, res_a, model_b, res_b, what):
    """Both compressions' weights, codes, scales, zero points and masks equal bit for bit."""
    for (name, a), (_, b) in zip(model_a.state_dict().items(), model_b.state_dict().items()):
        assert torch.equal(a, b), f"{what}: {name} differs"
    for name, res in res_a.layers.items():
        other = res_b.layers[name]
        for attr in ("codes", "scales", "zeros", "mask"):
            x, y = getattr(res, attr), getattr(other, attr)
            assert (x is None) == (y is None) and (x is None or torch.equal(x, y)), (what, name, attr)


@pytest.mark.parametrize("model_type", TINY_TYPES)
@pytest.mark.parametrize("method", ["gptq", "sparsegpt"])
def test_shortcuts_give_the_same_bits(model_type, method, monkeypatch):
    kw = dict(bits=4, group_size=16) if method == "gptq" else dict(bits=None, sparsity="0.5")
    recipe = Recipe(method=method, nsamples=6, seqlen=24, batch_size=2, **kw)
    plain, plain_res, plain_blocks = _run(model_type, recipe, False, monkeypatch)
    fast, fast_res, fast_blocks = _run(model_type, recipe, True, monkeypatch)
    _assert_same_bits(plain, plain_res, fast, fast_res, f"{model_type} {method} with the short-cuts")
    # Fewer whole-block forwards: plainly 4 group passes + the propagation pass per batch and block
    # (3 batches x 2 blocks; the last block propagates only for the head, skipped here).
    assert fast_blocks < plain_blocks, (fast_blocks, plain_blocks)


def test_the_plan_for_llama_groups():
    groups = [["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], ["self_attn.o_proj"],
              ["mlp.gate_proj", "mlp.up_proj"], ["mlp.down_proj"]]
    assert {(e.path, e.first_group, e.last_group) for e in shortcuts._entries(groups)} == {
        ("self_attn", 0, 1), ("mlp", 2, 3)}
    assert {(f.path, f.linear, f.group) for f in shortcuts._finished(groups)} == {
        ("self_attn", "self_attn.o_proj", 1), ("mlp", "mlp.down_proj", 3)}
    # One pass for everything (Wanda): nothing is recorded after its linear is final.
    assert shortcuts._finished([sum(groups, [])]) == []
    assert shortcuts._entries([sum(groups, [])]) == []
    # A skipped o_proj: attention ends in no compressed linear of its own group.
    assert {f.path for f in shortcuts._finished([groups[0], groups[2], groups[3]])} == {"mlp"}


def test_a_module_that_is_not_its_last_linear_runs_whole(monkeypatch):
    """An MLP that scales its down_proj output: the short-cut would be wrong; the check on the first
    batch finds it, the module runs whole, and the result equals the plain passes' bit for bit."""
    from transformers.models.llama import modeling_llama

    real = modeling_llama.LlamaMLP.forward
    monkeypatch.setattr(modeling_llama.LlamaMLP, "forward", lambda self, x: real(self, x) * 1.5)
    recipe = Recipe(method="gptq", bits=4, group_size=16, nsamples=6, seqlen=24, batch_size=2)
    checks = []
    orig = shortcuts.Checks
    monkeypatch.setattr(engine, "Checks", lambda: checks.append(orig()) or checks[-1])
    plain, _, _ = _run("llama", recipe, False)
    fast, _, _ = _run("llama", recipe, True)
    for (name, a), (_, b) in zip(plain.state_dict().items(), fast.state_dict().items()):
        assert torch.equal(a, b), name
    assert checks and checks[-1].ok == {"self_attn": True, "mlp": False}


def test_no_shortcuts_where_the_records_would_not_fit(monkeypatch):
    monkeypatch.setattr(engine, "memory_available", lambda: 1024)  # 1 KiB available
    made = []
    monkeypatch.setattr(engine, "BlockShortcuts", lambda *a: made.append(a) or None)
    recipe = Recipe(method="gptq", bits=4, group_size=16, nsamples=6, seqlen=24, batch_size=2)
    _run("llama", recipe, True)
    assert made == []


def test_eager_attention_returns_its_weights_so_it_runs_whole(monkeypatch):
    """Eager attention returns (output, weights): not o_proj's output alone, so attention is never
    short-cut (the MLP still is), and the bits are those of the plain passes."""
    checks = []
    orig = shortcuts.Checks
    monkeypatch.setattr(engine, "Checks", lambda: checks.append(orig()) or checks[-1])
    recipe = Recipe(method="gptq", bits=4, group_size=16, nsamples=6, seqlen=24, batch_size=2)
    plain, _, _ = _run("qwen2", recipe, False, attn="eager")
    fast, _, _ = _run("qwen2", recipe, True, attn="eager")
    for (name, a), (_, b) in zip(plain.state_dict().items(), fast.state_dict().items()):
        assert torch.equal(a, b), name
    assert checks[-1].ok == {"self_attn": False, "mlp": True}


@pytest.mark.parametrize("model_type", TINY_TYPES)
@pytest.mark.parametrize("method", ["gptq", "sparsegpt"])
def test_a_pass_stops_at_the_first_of_the_linears_fed_one_tensor(model_type, method, monkeypatch):
    """After the first batch, q/k/v's pass stops at q_proj's input and gate/up's at gate_proj's: the
    same bits as running each batch to the group's last linear, with fewer linear forwards."""
    kw = dict(bits=4, group_size=16) if method == "gptq" else dict(bits=None, sparsity="0.5")
    recipe = Recipe(method=method, nsamples=6, seqlen=24, batch_size=2, **kw)
    real = engine.collect_stats

    def run(stop):
        monkeypatch.setattr(engine, "collect_stats",
                            lambda *a, **k: real(*a, **k, shared_stop=stop))
        model = tiny_model(model_type)
        arch = architecture_for(model.config)
        calls = {}

        def count(name):
            def hook(_m, _args, _out):  # after the forward: counts the linears that ran
                calls[name] = calls.get(name, 0) + 1
            return hook

        for name, mod in model.named_modules():
            if isinstance(mod, torch.nn.Linear) and name.startswith(arch.layers + "."):
                mod.register_forward_hook(count(name))
        res = engine.compress_model(model, arch, recipe, _calibration(), "cpu", shortcuts=True)
        return model, res, calls

    full, full_res, full_calls = run(False)
    fast, fast_res, fast_calls = run(True)
    _assert_same_bits(full, full_res, fast, fast_res, f"{model_type} {method} when the pass stops early")
    # 3 batches: each block's q_proj, k_proj (before v_proj's input) and gate_proj (before up_proj's)
    # are skipped in 2 of the 3 batches of their own pass; nothing else changes. Fused projections
    # (phi3's qkv_proj, gate_up_proj) share no input, so there nothing is skipped.
    assert set(fast_calls) == set(full_calls)
    for n, count in full_calls.items():
        skipped = 2 if n.endswith(("self_attn.q_proj", "self_attn.k_proj", "mlp.gate_proj")) else 0
        assert fast_calls[n] == count - skipped, (n, fast_calls[n], count)
    if model_type != "phi3":
        assert sum(fast_calls.values()) < sum(full_calls.values())


def test_the_propagation_pass_reuses_attentions_output(monkeypatch):
    """Attention's short-cut output from the gate/up pass is reused by the propagation pass. Block 0's
    o_proj in the gate/up pass: the first batch runs the real attention and the check's o_proj (2),
    the other two the short-cut (2); in the propagation only that first batch runs it: 5, not 7."""
    model = tiny_model("llama")
    model.set_attn_implementation("sdpa")
    arch = architecture_for(model.config)
    calls = {"n": 0}
    o_proj = model.get_submodule(f"{arch.layers}.0.self_attn.o_proj")
    # real calls only: the capture pass learns the block's output form from one call on the meta device
    o_proj.register_forward_hook(lambda _m, args, _out: calls.__setitem__("n", calls["n"] + (not args[0].is_meta)))
    recipe = Recipe(method="gptq", bits=4, group_size=16, nsamples=6, seqlen=24, batch_size=2)
    engine.compress_model(model, arch, recipe, _calibration(), "cpu", shortcuts=True)
    assert calls["n"] == 5, calls


@pytest.mark.parametrize("model_type", TINY_TYPES)
def test_gptq_quantizes_the_linears_fed_one_tensor_in_one_loop(model_type, monkeypatch):
    """GPTQ's column loop runs once for the linears that share a Hessian (q/k/v, gate/up; phi3's fused
    projections have none to share) and the model comes out bit for bit as with one loop per linear."""
    from slmedge.compress.methods import base, gptq

    recipe = Recipe(method="gptq", bits=4, group_size=16, nsamples=6, seqlen=24, batch_size=2)
    loops = []
    real = gptq.gptq_quantize
    monkeypatch.setattr(gptq, "gptq_quantize", lambda W, *a, **k: loops.append(W.shape[0]) or real(W, *a, **k))
    one, one_res, _ = _run(model_type, recipe, True)
    stacked_loops = list(loops)
    loops.clear()
    monkeypatch.setattr(gptq.GPTQ, "compress_shared", base.Method.compress_shared)  # one loop per linear
    alone, alone_res, _ = _run(model_type, recipe, True)
    _assert_same_bits(alone, alone_res, one, one_res, f"{model_type} gptq, shared linears in one loop")
    blocks = len(one.get_submodule(architecture_for(one.config).layers))
    fused = model_type == "phi3"  # qkv_proj and gate_up_proj: one linear per input already
    assert sum(stacked_loops) == sum(loops)  # the same rows, in fewer loops
    assert len(stacked_loops) == len(loops) - (0 if fused else 3 * blocks)  # q/k/v: 2 fewer, gate/up: 1
