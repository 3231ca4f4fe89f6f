"""ONNX export: the token embedding as GatherBlockQuantized and the head as 4- or 8-bit MatMulNBits
(--embedding-type, --head-type), scales searched for the least error, on tiny random models."""

import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import helper, numpy_helper

from slmedge.backends.ort import OrtDecoder
from slmedge.compress.quant import QuantSpec, quantize_groups
from slmedge.errors import ConfigError
from slmedge.export.onnx import TOLERANCES, export_onnx, searched_codes

sys.path.insert(0, str(Path(__file__).parent))

IDS = [1, 17, 42, 99, 5, 250, 3, 77, 123, 64, 8, 300, 12, 45]
AWQ = dict(bits=4, group_size=32, symmetric=False)


def ops(folder: Path) -> dict:
    model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    counts: dict[str, int] = {}
    for n in model.graph.node:
        counts[n.op_type] = counts.get(n.op_type, 0) + 1
    return counts


def model_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.name.startswith("model.onnx"))


def decode_gather(model, table_rows: int) -> np.ndarray:
    """An independent decoder of the GatherBlockQuantized table: (rows, cols) from its data, scales and zero
    points (following a Reshape back to its initializer where the table shares a tied head's codes)."""
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    producers = {o: n for n in model.graph.node for o in n.output}

    def value(name):
        if name in inits:
            return inits[name]
        node = producers[name]
        assert node.op_type == "Reshape", node.op_type
        return inits[node.input[0]].reshape(table_rows, -1)

    node = next(n for n in model.graph.node if n.op_type == "GatherBlockQuantized")
    a = {x.name: helper.get_attribute_value(x) for x in node.attribute}
    bits, bs = a["bits"], a["block_size"]
    data = value(node.input[0]).reshape(table_rows, -1)
    q = np.stack([data & 0x0F, data >> 4], axis=-1).reshape(table_rows, -1) if bits == 4 else data
    q = q.astype(np.float32)
    cols = q.shape[1]
    nb = -(-cols // bs)
    scales = value(node.input[2]).reshape(table_rows, nb).astype(np.float32)
    if len(node.input) > 3 and node.input[3]:
        zp = value(node.input[3]).reshape(table_rows, -1)
        zp = (np.stack([zp & 0x0F, zp >> 4], axis=-1).reshape(table_rows, -1)[:, :nb] if bits == 4 else zp)
    else:
        zp = np.full((table_rows, nb), 2 ** (bits - 1))
    per_col = np.arange(cols) // bs
    return (q - zp[:, per_col].astype(np.float32)) * scales[:, per_col]


def torch_embedding(art_dir) -> np.ndarray:
    from slmedge.export.verify import torch_model

    model = torch_model(Path(art_dir), torch.float32)
    return model.get_input_embeddings().weight.detach().numpy()


@pytest.mark.parametrize("kind,bits", [("int4", 4), ("int8", 8)])
def test_quantized_embedding_and_head_are_used_smaller_and_within_tolerance(kind, bits, artifacts, tmp_path):
    art = artifacts("llama", "awq", **AWQ)  # untied head
    plain = export_onnx(art, tmp_path / "plain", accuracy_level=0)
    small = export_onnx(art, tmp_path / "small", accuracy_level=0, embedding_type=kind, head_type=kind)
    counts = ops(tmp_path / "small")
    model = onnx.load(str(tmp_path / "small" / "model.onnx"))
    assert counts.get("GatherBlockQuantized") == 1
    assert not [n for n in model.graph.node if n.op_type == "Gather" and n.input[1] == "input_ids"]
    # the codes' linears plus the head: all MatMulNBits; no fp32 MatMul with a weight left
    assert counts["MatMulNBits"] == ops(tmp_path / "plain")["MatMulNBits"]
    assert small["head_type"] == kind and small["embedding_type"] == kind and small["codes_kept"] == plain["codes_kept"]
    if kind == "int4":
        assert model_bytes(tmp_path / "small") < model_bytes(tmp_path / "plain")
    # the export's own parity check against torch ran and passed; and onnxruntime runs the file here
    tolerance = TOLERANCES["kept-4bit-tables" if kind == "int4" else "kept"]
    assert small["verification"]["tolerance"] == tolerance if "tolerance" in small["verification"] else True
    assert small["verification"]["mean_kl"] < tolerance["mean_kl"]
    got = OrtDecoder(tmp_path / "small").logits(IDS)
    ref = OrtDecoder(tmp_path / "plain").logits(IDS)
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= tolerance["top1"]
    assert np.abs(got - ref).max() > 0  # the tables did change
    # the table holds the embedding on a `bits` grid: close to it, and not the fp32 values themselves
    emb = torch_embedding(art)
    table = decode_gather(model, emb.shape[0])
    err = np.abs(table - emb).max()
    step = (emb.max() - emb.min()) / (2**bits - 1)
    assert 0 < err <= step, (err, step)


def test_a_tied_head_and_its_embedding_share_one_copy_of_the_codes(artifacts, tmp_path):
    art = artifacts("gemma3_text", "gptq", bits=4, group_size=32, symmetric=False)  # tied embeddings
    own = export_onnx(art, tmp_path / "fp16", accuracy_level=0)
    report = export_onnx(art, tmp_path / "shared", accuracy_level=0, embedding_type="int4", head_type="int4")
    model = onnx.load(str(tmp_path / "shared" / "model.onnx"))
    node = next(n for n in model.graph.node if n.op_type == "GatherBlockQuantized")
    producers = {o: n for n in model.graph.node for o in n.output}
    head = next(n for n in model.graph.node if n.op_type == "MatMulNBits" and "lm_head" in n.name)
    assert producers[node.input[0]].op_type == "Reshape" and producers[node.input[0]].input[0] == head.input[1]
    assert any("tied head" in n for n in report["notes"])
    emb = torch_embedding(art)
    big = [i.name for i in model.graph.initializer if int(np.prod(i.dims)) >= emb.size // 2]
    assert big == [head.input[1]]  # the head's codes only: no second copy, the fp32 table gone
    assert model_bytes(tmp_path / "shared") < model_bytes(tmp_path / "fp16") and own["verification"]
    table = decode_gather(model, emb.shape[0])
    assert 0 < np.abs(table - emb).max() <= (emb.max() - emb.min()) / 15


def test_searched_scales_round_with_less_error_than_min_max():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 128, generator=g)
    w[torch.rand(64, 128, generator=g) < 0.01] *= 8  # outliers: min/max wastes levels on them
    for bits, sym in ((4, False), (8, True)):
        q, s, z, spec = searched_codes(w.numpy(), bits, 32, symmetric=sym)
        per_col = np.arange(128) // 32
        ours = (q.astype(np.float32) - z[:, per_col]) * s[:, per_col]
        plain = quantize_groups(w.clone(), QuantSpec(bits, 32, sym))[0].numpy()
        e_ours, e_plain = ((ours - w.numpy()) ** 2).sum(), ((plain - w.numpy()) ** 2).sum()
        # never worse (min/max is a candidate); at 4 bits the outliers make a shrunk range strictly better
        assert e_ours < e_plain if bits == 4 else e_ours <= e_plain, (bits, e_ours, e_plain)


@pytest.mark.parametrize("kw,words", [
    (dict(embedding_type="int3"), "--embedding-type"),
    (dict(head_type="int2"), "--head-type"),
    (dict(head_type="int4", keep_fp32_head=True), "--keep-fp32-head"),
])
def test_bad_types_are_refused_before_anything_is_written(kw, words, artifacts, tmp_path):
    art = artifacts("llama", "awq", **AWQ)
    with pytest.raises(ConfigError, match=words):
        export_onnx(art, tmp_path / "out", **kw)
    assert not (tmp_path / "out").exists()
