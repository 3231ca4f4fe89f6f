"""The capture pass: the inputs of the first block and every block's call arguments, without
computing the blocks, exactly as a pass that computes them (issue 43).

The pass stands in for every decoder block; the model's own loop then reads what the stand-in
returns. Gemma 2/3 under transformers 4.x index their blocks' output (``layer_outputs[0]``), so a
stand-in that returns the bare hidden states strips one dimension per block: models of one or two
blocks never show it, which is why these models have six.
"""

import pytest
import torch

from slmedge.compress import engine
from slmedge.compress.blocks import BlockInputs
from slmedge.compress.hooks import module_calls
from slmedge.compress.recipe import Recipe
from slmedge.errors import SlmedgeError
from slmedge.models.architectures import ARCHITECTURES, architecture_for
from tiny import tiny_model

DEPTH = 6
CALIBRATED = {
    "gptq": dict(bits=4, group_size=32),
    "awq": dict(bits=4, group_size=32, awq_grid=4),
    "wanda": dict(bits=None, sparsity="0.5"),
    "sparsegpt": dict(bits=None, sparsity="2:4"),
}


def _calibration(nsamples=5, seqlen=24):
    return torch.randint(3, 300, (nsamples, seqlen), generator=torch.Generator().manual_seed(1))


@torch.no_grad()
def reference_capture(model, arch, batches, device) -> BlockInputs:
    """The same inputs, recorded by pre-hooks while the model computes every block for real."""
    layers = model.get_submodule(arch.layers)
    engine._move_outside_layers(model, arch.layers, device)
    hidden, kwargs = [], {}

    def record(name, args, kw):
        idx = int(name)
        h = args[0] if args else kw["hidden_states"]
        if idx == 0:
            hidden.append(h.detach().clone())
        kwargs.setdefault((idx, h.shape[0]), {k: v for k, v in kw.items() if k != "hidden_states"})

    with module_calls({str(i): layer for i, layer in enumerate(layers)}, record):
        for batch in batches:
            model(input_ids=batch.to(device), use_cache=False)
    return BlockInputs(hidden, kwargs)


def _compress(model_type, method, monkeypatch, capture=None):
    model = tiny_model(model_type, layers=DEPTH)
    arch = architecture_for(model.config)
    if capture is not None:
        monkeypatch.setattr(engine, "capture_inputs", capture)
    recipe = Recipe(method=method, nsamples=5, seqlen=24, batch_size=2, calibration="unused", **CALIBRATED[method])
    engine.compress_model(model, arch, recipe, _calibration(), device="cpu")
    monkeypatch.undo()
    return model


@pytest.mark.parametrize("model_type", sorted(ARCHITECTURES))
def test_the_capture_pass_records_what_computing_the_blocks_records(model_type):
    model = tiny_model(model_type, layers=DEPTH)
    arch = architecture_for(model.config)
    model.float()
    batches = list(torch.split(_calibration(), 2))  # two batch sizes: 2, 2, 1
    mine = engine.capture_inputs(model, arch, batches, torch.device("cpu"))
    ref = reference_capture(model, arch, batches, torch.device("cpu"))
    assert len(mine.hidden) == len(batches)
    for h, r, batch in zip(mine.hidden, ref.hidden, batches):
        assert h.shape == (*batch.shape, model.config.hidden_size)
        assert torch.equal(h, r)
    assert mine._kwargs.keys() == ref._kwargs.keys() == {(i, n) for i in range(DEPTH) for n in (2, 1)}
    for key, kw in ref._kwargs.items():
        assert mine._kwargs[key].keys() == kw.keys()
        for name, value in kw.items():
            assert _same(mine._kwargs[key][name], value), (key, name)


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b or (a is None and b is None) or type(a) is type(b)


@pytest.mark.parametrize("model_type", sorted(ARCHITECTURES))
@pytest.mark.parametrize("method", sorted(CALIBRATED))
def test_every_calibrated_method_gives_the_bits_of_a_capture_that_computes_the_blocks(model_type, method,
                                                                                       monkeypatch):
    mine = _compress(model_type, method, monkeypatch)
    ref = _compress(model_type, method, monkeypatch, capture=reference_capture)
    mine_state, ref_state = mine.state_dict(), ref.state_dict()
    assert mine_state.keys() == ref_state.keys()
    for name, tensor in ref_state.items():
        assert torch.equal(mine_state[name], tensor), name


def test_a_block_input_of_another_shape_is_an_error_not_a_wrong_result(monkeypatch):
    """A stand-in whose model loop hands the next block something else than (batch, seq, hidden)
    stops the capture with an error naming the block."""
    model = tiny_model("llama", layers=DEPTH)
    arch = architecture_for(model.config)
    layers = model.get_submodule(arch.layers)

    def drop_the_batch_dimension(_module, args, kw):  # as if the model's loop indexed the block's output
        if args:
            return (args[0][0], *args[1:]), kw
        return args, {**kw, "hidden_states": kw["hidden_states"][0]}

    handle = layers[2].register_forward_pre_hook(drop_the_batch_dimension, with_kwargs=True)
    try:
        with pytest.raises(SlmedgeError, match=r"block 2 .*shape"):
            engine.capture_inputs(model, arch, [_calibration()[:2]], torch.device("cpu"))
    finally:
        handle.remove()


@pytest.mark.parametrize("model_type", ["gemma3_text", "qwen2"])
def test_a_bf16_source_gets_the_bits_of_its_fp32_copy(model_type, monkeypatch):
    """The engine casts each block to fp32 at its turn: before that, during the capture, the blocks
    are still bf16 while the hidden states are fp32."""
    model = tiny_model(model_type, layers=DEPTH).to(torch.bfloat16)
    copy = tiny_model(model_type, layers=DEPTH).to(torch.bfloat16).float()
    arch = architecture_for(model.config)
    recipe = Recipe(method="gptq", nsamples=5, seqlen=24, batch_size=2, calibration="unused", **CALIBRATED["gptq"])
    engine.compress_model(model, arch, recipe, _calibration(), device="cpu")
    engine.compress_model(copy, arch, recipe, _calibration(), device="cpu")
    for name, tensor in copy.state_dict().items():
        assert torch.equal(model.state_dict()[name].float(), tensor), name
