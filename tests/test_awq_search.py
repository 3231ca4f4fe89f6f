"""AWQ's scale search taken in bf16: the losses track fp32's, the choice is fp32's, nothing leaks out.

The search only ranks grid points; the statistics, the scales and the quantization stay fp32. On
SmolLM2 (all 90 mappings, `git show 5f8f6c1:scripts/bench/awq_search_dtype.py`) bf16 picks fp32's grid point in
all but a few mappings, at most a fraction of a percent above fp32's best loss; here the same is
held on tiny real attention and MLP modules, and the bf16 path is shown to run in bf16.
"""

import pytest
import torch
from torch.overrides import TorchFunctionMode

from slmedge.compress.methods import awq as mawq
from slmedge.compress.quant import QuantSpec
from tests.tiny import tiny_config


def sdpa_llama(seed=0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation="sdpa")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.rand_like(p) * 0.5 + 0.75) if "norm" in name else p.normal_(0, 0.08)
    return model.eval()


def attention_calls(model, x):
    """One call of block 0's attention as the engine records it (rotary embeddings, causal mask): the
    arguments the model's own forward hands it, with ``x`` as the hidden states."""
    recorded = {}

    def record(_module, _args, kwargs):
        recorded.update(kwargs)
        raise StopIteration  # nothing after block 0's attention is needed

    handle = model.model.layers[0].self_attn.register_forward_pre_hook(record, with_kwargs=True)
    try:
        with torch.no_grad():
            model(inputs_embeds=x, use_cache=False)
    except StopIteration:
        pass
    finally:
        handle.remove()
    kwargs = {k: v for k, v in recorded.items() if k in ("position_embeddings", "attention_mask")}
    return [((), {"hidden_states": x, **kwargs})]


class Dtypes(TorchFunctionMode):
    """The dtypes of every F.linear and scaled_dot_product_attention's inputs."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.nn.functional.linear, torch.nn.functional.scaled_dot_product_attention):
            self.seen.append((func.__name__, args[0].dtype))
        return func(*args, **(kwargs or {}))


def salient(x, g, channels=(3, 17, 40), factor=8.0):
    x = x.clone()
    x[..., list(channels)] *= factor
    return x


@pytest.mark.parametrize("which", ["mlp", "self_attn"])
def test_bf16_losses_track_fp32_pick_its_grid_point_and_run_in_bf16(which):
    model = sdpa_llama()
    layer = model.model.layers[0]
    g = torch.Generator().manual_seed(1)
    x = salient(torch.randn(2, 64, 64, generator=g), g)
    module = getattr(layer, which)
    if which == "mlp":
        linears, calls = [module.gate_proj, module.up_proj], [((x.reshape(-1, 64),), {})]
    else:
        linears, calls = [module.q_proj, module.k_proj, module.v_proj], attention_calls(model, x)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    x_mean = x.reshape(-1, 64).abs().mean(dim=0)
    spec = QuantSpec(4, 32, False)
    seen = {}
    losses = {}
    for dtype in (torch.float32, torch.bfloat16):
        with Dtypes() as mode:
            losses[dtype], _ = mawq.grid_losses(module, calls, linears, x_mean, spec, 10, dtype)
        seen[dtype] = set(mode.seen)
    f32, b16 = losses[torch.float32], losses[torch.bfloat16]
    # The losses differ across the grid by far more than bf16 moves them.
    assert max(f32) > 1.5 * min(f32)
    for a, b in zip(f32, b16):
        assert abs(b - a) <= 0.02 * a
    assert min(range(10), key=b16.__getitem__) == min(range(10), key=f32.__getitem__)
    # What ran in each dtype: fp32 stays fp32; bf16 multiplies (and attends) in bf16.
    funcs = {"linear"} | ({"scaled_dot_product_attention"} if which == "self_attn" else set())
    assert seen[torch.float32] == {(f, torch.float32) for f in funcs}
    assert seen[torch.bfloat16] == {(f, torch.bfloat16) for f in funcs}
    # Nothing is left behind: the weights, the linears' forwards, transformers' attention table.
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())
    assert not any("forward" in vars(m) for m in module.modules())
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    assert "sdpa" not in ALL_ATTENTION_FUNCTIONS._local_mapping
    with Dtypes() as mode:
        module(*calls[0][0], **calls[0][1])
    assert {d for _, d in mode.seen} == {torch.float32}


def test_the_search_in_float32_is_the_search_it_was():
    """awq_search_dtype = "float32" keeps every weight and forward in fp32, in place: the scales are
    the argmin of losses computed exactly as before (the reference and 20 fp32 forwards)."""
    model = sdpa_llama(seed=2)
    mlp = model.model.layers[1].mlp
    g = torch.Generator().manual_seed(5)
    x = salient(torch.randn(128, 64, generator=g), g)
    linears = [mlp.gate_proj, mlp.up_proj]
    spec = QuantSpec(4, 32, False)
    x_mean = x.abs().mean(dim=0)
    losses, scales = mawq.grid_losses(mlp, [((x,), {})], linears, x_mean, spec, 8, torch.float32)
    originals = [lin.weight.data.clone() for lin in linears]
    ref = mlp(x)
    for loss, s in zip(losses, scales):
        with torch.no_grad():
            for lin, w in zip(linears, originals):
                lin.weight.data.copy_(mawq.fake_quantize(w * s.view(1, -1), spec) / s.view(1, -1))
            assert loss == float((mlp(x) - ref).pow(2).sum())
            for lin, w in zip(linears, originals):
                lin.weight.data.copy_(w)


def test_auto_is_bf16_only_where_the_cpu_multiplies_it_natively(monkeypatch):
    cpu = torch.device("cpu")
    assert mawq.search_dtype("float32", cpu) == torch.float32
    assert mawq.search_dtype("bfloat16", cpu) == torch.bfloat16
    monkeypatch.setattr(mawq, "_cpu_flags", lambda: frozenset({"avx2", "fma"}))
    assert mawq.search_dtype("auto", cpu) == torch.float32
    monkeypatch.setattr(mawq, "_cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16"}))
    native = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert mawq.search_dtype("auto", cpu) == (torch.bfloat16 if native else torch.float32)
    assert mawq.search_dtype("auto", torch.device("meta")) == torch.float32


def test_an_unknown_search_dtype_is_refused_before_any_work():
    from slmedge.compress.recipe import Recipe
    from slmedge.errors import ConfigError

    with pytest.raises(ConfigError, match="awq_search_dtype must be one of auto, bfloat16, float32, got 'float16'"):
        Recipe(method="awq", awq_search_dtype="float16").validate()


@pytest.mark.parametrize("which", ["mlp", "self_attn", "down_proj"])
def test_the_bf16_search_returns_the_fp32_searchs_scales_with_fewer_fp32_forwards(which, monkeypatch):
    """bf16 ranks the grid; fp32 decides among the points near bf16's best."""
    model = sdpa_llama(seed=3)
    layer = model.model.layers[0]
    g = torch.Generator().manual_seed(7)
    x = salient(torch.randn(2, 64, 64, generator=g), g)
    if which == "mlp":
        module, linears, calls, xin = layer.mlp, [layer.mlp.gate_proj, layer.mlp.up_proj], [((x.reshape(-1, 64),), {})], x
    elif which == "self_attn":
        module = layer.self_attn
        linears, calls, xin = [module.q_proj, module.k_proj, module.v_proj], attention_calls(model, x), x
    else:
        h = salient(torch.randn(128, 128, generator=g), g, channels=(5, 77))
        module, linears, calls, xin = layer.mlp.down_proj, [layer.mlp.down_proj], [((h,), {})], h
    x_mean = xin.reshape(-1, xin.shape[-1]).abs().mean(dim=0)
    spec = QuantSpec(4, 32, False)
    method = mawq.AWQ.__new__(mawq.AWQ)
    evaluated = []
    grid = mawq.grid_losses

    def counting(module, calls, linears, x_mean, spec, n_grid, dtype=torch.float32, points=None, reference=None, **kw):
        evaluated.append((dtype, len(points)))
        return grid(module, calls, linears, x_mean, spec, n_grid, dtype, points, reference, **kw)

    monkeypatch.setattr(mawq, "grid_losses", counting)
    fp32 = method._search(module, calls, linears, x_mean, spec, 20, torch.float32)
    assert evaluated == [(torch.float32, 20)]
    evaluated.clear()
    bf16 = method._search(module, calls, linears, x_mean, spec, 20, torch.bfloat16)
    assert torch.equal(bf16, fp32)
    # bf16 ranks all 20; fp32 takes bf16's best, then the few points near it.
    assert evaluated[:2] == [(torch.bfloat16, 20), (torch.float32, 1)]
    assert all(d == torch.float32 for d, _ in evaluated[2:]) and len(evaluated) <= 3
    assert sum(n for _, n in evaluated[1:]) < 20
