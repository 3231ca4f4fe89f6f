import pytest
import torch

from slmedge.compress.methods.awq import fold_scales
from slmedge.errors import UnsupportedArchitectureError
from slmedge.models.architectures import ARCHITECTURES, architecture_for
from tiny import TINY_TYPES, tiny_config, tiny_model


def test_every_architecture_in_the_table_has_a_tiny_model():
    missing = [key for key in ARCHITECTURES if key not in TINY_TYPES]
    assert not missing, f"architectures without a tiny test model: {missing}"
    for key in ARCHITECTURES:
        assert tiny_config(key).model_type == key


@pytest.mark.parametrize("model_type", sorted(ARCHITECTURES))
def test_table_names_exist_in_the_model(model_type):
    model = tiny_model(model_type)
    arch = architecture_for(model.config)
    layer = model.get_submodule(arch.layers)[0]
    for name in arch.linear_names:
        assert isinstance(layer.get_submodule(name), torch.nn.Linear)
    for m in arch.awq:
        layer.get_submodule(m.prev)
        layer.get_submodule(m.inspect)
    for path in (arch.embed_tokens, arch.final_norm, arch.lm_head):
        model.get_submodule(path)


def test_unsupported_architecture_lists_the_supported_ones():
    from transformers import GPT2Config

    with pytest.raises(UnsupportedArchitectureError) as err:
        architecture_for(GPT2Config())
    assert "gpt2" in str(err.value) and "llama" in str(err.value) and "gemma3_text" in str(err.value)


@pytest.mark.parametrize("model_type", sorted(ARCHITECTURES))
def test_awq_folding_leaves_the_unquantized_model_unchanged(model_type):
    model = tiny_model(model_type)
    arch = architecture_for(model.config)
    ids = torch.randint(3, 300, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(ids).logits
        gen = torch.Generator().manual_seed(1)
        folded = 0
        for layer in model.get_submodule(arch.layers):
            for m in arch.awq:
                prev = layer.get_submodule(m.prev)
                linears = [layer.get_submodule(n) for n in m.linears]
                if isinstance(prev, torch.nn.Linear) and prev.out_features != linears[0].in_features:
                    continue  # grouped-query attention: the engine skips this mapping too
                s = torch.rand(linears[0].in_features, generator=gen) * 3 + 0.25
                fold_scales(prev, linears, s, arch.norm_offset)
                folded += 1
        after = model(ids).logits
    assert folded >= 2 * len(model.get_submodule(arch.layers))
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("model_type", sorted(k for k, a in ARCHITECTURES.items() if a.gguf is not None))
def test_gguf_layout_names_exist_in_gguf_and_in_the_model(model_type):
    import gguf

    model = tiny_model(model_type)
    arch = architecture_for(model.config)
    layer = model.get_submodule(arch.layers)[0]
    for linear, heads in arch.gguf.permute:
        assert isinstance(layer.get_submodule(linear), torch.nn.Linear)
        assert getattr(model.config, heads) > 0
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.gguf.arch], model.config.num_hidden_layers)
    unnamed = [n for n in model.state_dict() if tmap.get_name(n, try_suffixes=(".weight", ".bias")) is None]
    assert not unnamed, f"weights without a GGUF tensor name in {arch.gguf.arch}: {unnamed}"
