"""The compact artifact (format version 2): the size of what it holds, the same weights bit for bit as
version 1, the same exports, version 1 still read, a changed byte refused."""

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from conftest import require_import, small_recipe
from slmedge.compress.api import compress
from slmedge.compress.artifact import MANIFEST, QUANT_FILE, WEIGHTS_FILE, Artifact, write_artifact
from slmedge.errors import ArtifactError, SlmedgeError
from slmedge.models.artifact_format import V1_WEIGHTS_FILE, weights_metadata
from slmedge.models.artifact_weights import KEPT_SUFFIX, iter_tensors

sys.path.insert(0, str(Path(__file__).parent))
from tiny import TINY_TYPES, save_tiny, tiny_model, tiny_tokenizer  # noqa: E402

METHODS = [
    ("rtn", dict(bits=4)),
    ("gptq", dict(bits=4, act_order=True)),
    ("gptq", dict(bits=3, act_order=False, symmetric=True)),
    ("awq", dict(bits=4)),
    ("wanda", dict(bits=None, sparsity=0.5)),
    ("sparsegpt", dict(bits=None, sparsity=0.5)),
    ("sparsegpt", dict(bits=4, sparsity=0.5)),
    ("magnitude", dict(bits=None, sparsity="2:4")),
]


def _id(case):
    method, kw = case
    return method + "".join(f"-{k}{v}" for k, v in kw.items())


def both_versions(src, calib_file, root: Path, method, **kw):
    """One compress run written both ways: (v1 dir, v2 dir, the outcome). The two directories have
    paths of the same length and the same name, so exports' manifests differ only in them."""
    out = compress(str(src), small_recipe(calib_file, method=method, **kw), write=False, device="cpu")
    args = (out.loaded.model, out.loaded.tokenizer, out.result.layers, out.result.extras, out.manifest)
    v1 = write_artifact(root / "v1" / "art", *args, version=1)
    v2 = write_artifact(root / "v2" / "art", *args, source_dir=out.loaded.hf_dir)
    return v1, v2, out


def v1_tensors(v1: Path) -> dict:
    with safe_open(str(v1 / V1_WEIGHTS_FILE), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def assert_same_bits(a: dict, b: dict):
    assert list(a) == list(b)  # the same names, in the same order
    for name in a:
        assert a[name].dtype == b[name].dtype == torch.float32, name
        assert torch.equal(a[name].view(torch.int32), b[name].view(torch.int32)), name  # signed zeros too


def file_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


# --- the same weights, bit for bit -------------------------------------------------------------------


@pytest.mark.parametrize("model_type", ["llama", "mistral"])
@pytest.mark.parametrize("case", METHODS, ids=[_id(c) for c in METHODS])
def test_v2_rebuilds_the_v1_weights_bit_for_bit(model_type, case, tiny_models, calib_file, tmp_path):
    method, kw = case
    v1, v2, out = both_versions(tiny_models(model_type), calib_file, tmp_path, method, **kw)
    ref = v1_tensors(v1)
    assert_same_bits(ref, dict(iter_tensors(v2)))
    meta = weights_metadata(v2)
    # Every compressed linear is rebuilt, not stored (the writer's fallback to fp32 never fired).
    assert set(meta["rebuilt"].values()) == set(out.result.layers)
    with safe_open(str(v2 / WEIGHTS_FILE), framework="pt") as f:
        stored = set(f.keys())
    assert not stored & set(meta["rebuilt"])
    # Every reader: Artifact.load_model, models.source.load (kind "artifact") and the torch model
    # that export verification compares with.
    from slmedge.export.verify import torch_model
    from slmedge.models.source import load

    for model in (Artifact.open(v2).load_model(), load(str(v2)).model, torch_model(v2)):
        sd = model.state_dict()
        for name, t in ref.items():
            assert torch.equal(sd[name].view(torch.int32), t.view(torch.int32)), name
    ids = torch.tensor([[1, 17, 42, 99, 5, 250]])
    with torch.no_grad():
        assert torch.equal(Artifact.open(v1).load_model()(ids).logits, Artifact.open(v2).load_model()(ids).logits)


def _wider_llama(root: Path) -> Path:
    """The tiny llama four times as wide (1.3 M parameters): on the 64-wide one the safetensors
    headers and the manifest alone are 9% of the bytes; here they are what they are on real models,
    a small part."""
    from tiny import tiny_config

    torch.manual_seed(0)
    config = tiny_config("llama")
    config.hidden_size, config.intermediate_size = 256, 512
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(root / "wide", safe_serialization=True)
    tiny_tokenizer().save_pretrained(root / "wide")
    return root / "wide"


def test_v2_artifact_is_the_size_of_its_parts(calib_file, tmp_path):
    v1, v2, out = both_versions(_wider_llama(tmp_path), calib_file, tmp_path, "gptq", bits=4)
    layers = out.result.layers
    expected = 0
    for name, res in layers.items():
        rows, cols = res.codes.shape
        groups = res.scales.shape[1]
        expected += rows * -(-cols // 2) + rows * groups * (2 + 1)  # 4-bit codes, fp16 scales, uint8 zeros
        expected += cols * 4 if res.perm is not None else 0
    state = out.loaded.model.state_dict()
    coded = {f"{n}.weight" for n in layers}
    ptrs = {state[n].data_ptr() for n in coded}
    untouched = {}
    for name, t in state.items():  # tied duplicates once; the tiny models are fp32
        if name not in coded and t.data_ptr() not in ptrs and t.data_ptr() not in untouched:
            untouched[t.data_ptr()] = t.numel() * 4
    expected += sum(untouched.values())
    other = sum(f.stat().st_size for f in v2.iterdir() if f.name not in (WEIGHTS_FILE, QUANT_FILE, MANIFEST))
    expected += other  # tokenizer and config files
    actual = file_bytes(v2)  # headers and the manifest included
    assert abs(actual - expected) <= 0.05 * expected, (actual, expected)
    assert file_bytes(v2) < 0.45 * file_bytes(v1)
    # inspect says where the bytes go, and its kinds add up to the directory
    from slmedge.export.inspect import inspect_path

    info = inspect_path(v2)
    assert info["format_version"] == 2
    storage = info["storage"]
    assert sum(storage.values()) == file_bytes(v2)
    assert storage["codes"] == sum(r.codes.shape[0] * -(-r.codes.shape[1] // 2) for r in layers.values())
    assert storage["scales"] == sum(r.scales.numel() * 2 for r in layers.values())
    assert storage["tensors stored as they are (f32)"] == sum(untouched.values())
    assert "dense weights, version 1 (f32)" in inspect_path(v1)["storage"]


def _bf16_source(root: Path, model_type: str = "mistral") -> Path:
    model = tiny_model(model_type).to(torch.bfloat16)
    model.save_pretrained(root / "bf16", safe_serialization=True)
    tiny_tokenizer().save_pretrained(root / "bf16")
    return root / "bf16"


@pytest.mark.parametrize("method,kw,kept_dtype,ratio", [("wanda", dict(bits=None, sparsity=0.5), "BF16", 0.4),
                                                        ("sparsegpt", dict(bits=None, sparsity=0.5), "F32", 0.6),
                                                        ("awq", dict(bits=4), None, 0.4)])
def test_a_bf16_source_keeps_its_dtype_where_that_is_exact(method, kw, kept_dtype, ratio, calib_file, tmp_path):
    src = _bf16_source(tmp_path)
    v1, v2, out = both_versions(src, calib_file, tmp_path, method, **kw)
    assert_same_bits(v1_tensors(v1), dict(iter_tensors(v2)))
    with safe_open(str(v2 / WEIGHTS_FILE), framework="pt") as f:
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    assert dtypes["model.embed_tokens.weight"] == "BF16" and dtypes["lm_head.weight"] == "BF16"
    kept = {k: d for k, d in dtypes.items() if k.endswith(KEPT_SUFFIX)}
    if kept_dtype is None:
        assert not kept
        # AWQ divides the norms by its scales in fp32: those stay fp32 (exact), the rest bf16
        norms = {k: d for k, d in dtypes.items() if "layernorm" in k}
        assert "F32" in norms.values()
    else:
        # Wanda only zeroes weights: the kept values are the source's bf16 ones. SparseGPT updates them
        # in fp32: stored fp32, so that loading gives the bits version 1 had.
        assert kept and set(kept.values()) == {kept_dtype}
    assert file_bytes(v2) < ratio * file_bytes(v1)  # version 1: everything fp32


# --- written block by block: the same files as from the whole model -------------------------------


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.name != MANIFEST}


@pytest.mark.parametrize("model_type", TINY_TYPES)
@pytest.mark.parametrize("case", [METHODS[1], METHODS[3], METHODS[5]], ids=_id)
def test_written_block_by_block_equals_written_whole(model_type, case, tiny_models, calib_file, tmp_path):
    """``compress`` writes the artifact as it goes (each block freed once its compact tensors are
    taken); the files are byte for byte those written from the model compressed whole in memory."""
    method, kw = case
    recipe = small_recipe(calib_file, method=method, **kw)
    whole = compress(str(tiny_models(model_type)), recipe, write=False, device="cpu")
    (tmp_path / "w").mkdir()
    write_artifact(tmp_path / "w" / "art", whole.loaded.model, whole.loaded.tokenizer, whole.result.layers,
                   whole.result.extras, whole.manifest, source_dir=whole.loaded.hf_dir)
    streamed = compress(str(tiny_models(model_type)), recipe, tmp_path / "s" / "art", device="cpu")
    assert streamed.loaded.model is None and set(streamed.result.layers) == set(whole.result.layers)
    assert _files(tmp_path / "s" / "art") == _files(tmp_path / "w" / "art")
    assert streamed.summary == whole.summary | {"timings": streamed.summary["timings"]}


@pytest.mark.parametrize("case", [METHODS[0], METHODS[1], METHODS[3], METHODS[4], METHODS[5]], ids=_id)
def test_a_bf16_source_written_block_by_block_equals_written_whole(case, calib_file, tmp_path):
    """Loaded in bf16 and cast to fp32 one block at a time: the artifact of the model loaded whole in fp32."""
    method, kw = case
    src = _bf16_source(tmp_path)
    recipe = small_recipe(calib_file, method=method, **kw)
    whole = compress(str(src), recipe, write=False, device="cpu")
    (tmp_path / "w").mkdir()
    write_artifact(tmp_path / "w" / "art", whole.loaded.model, whole.loaded.tokenizer, whole.result.layers,
                   whole.result.extras, whole.manifest, source_dir=whole.loaded.hf_dir)
    streamed = compress(str(src), recipe, tmp_path / "s" / "art", device="cpu")
    assert _files(tmp_path / "s" / "art") == _files(tmp_path / "w" / "art")


# --- version 1 still read; a changed byte refused ------------------------------------------------------


def test_a_v1_artifact_still_opens_everywhere(tiny_models, calib_file, tmp_path):
    from slmedge.export.source import iter_weights, open_export_source
    from slmedge.models.source import load

    v1, v2, out = both_versions(tiny_models("llama"), calib_file, tmp_path, "rtn", bits=4)
    manifest = json.loads((v1 / MANIFEST).read_text())
    assert manifest["format_version"] == 1 and V1_WEIGHTS_FILE in manifest["files"]
    assert WEIGHTS_FILE not in manifest["files"]
    art = Artifact.open(v1)
    assert art.version == 1 and set(art.layers()) == set(out.result.layers)
    AutoModelForCausalLM.from_pretrained(v1)  # version 1 is a plain HF folder
    loaded = load(str(v1))
    assert loaded.identity["weights_sha256"] == manifest["files"][V1_WEIGHTS_FILE]["sha256"]
    ref = v1_tensors(v1)
    for name, t in loaded.model.state_dict().items():
        if name in ref:
            assert torch.equal(t, ref[name])
    src = open_export_source(v1)
    assert set(src.layers) == set(out.result.layers)
    names = [n for n, _ in iter_weights(v1)]
    assert names == list(ref) == [n for n, _ in iter_weights(v2)]
    assert load(str(v2)).identity["weights_sha256"] != loaded.identity["weights_sha256"]


def test_a_v2_artifact_is_no_hf_folder_until_materialized(tiny_models, calib_file, tmp_path):
    from typer.testing import CliRunner

    from slmedge.cli import app

    v1, v2, _ = both_versions(tiny_models("llama"), calib_file, tmp_path, "gptq", bits=4)
    with pytest.raises(OSError):
        AutoModelForCausalLM.from_pretrained(v2)
    result = CliRunner().invoke(app, ["artifact", "materialize", str(v2), "-o", str(tmp_path / "hf")])
    assert result.exit_code == 0, result.output
    # the very file version 1 held
    assert (tmp_path / "hf" / V1_WEIGHTS_FILE).read_bytes() == (v1 / V1_WEIGHTS_FILE).read_bytes()
    AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    again = CliRunner().invoke(app, ["artifact", "materialize", str(v2), "-o", str(tmp_path / "hf")])
    assert again.exit_code == 1 and "not empty" in again.output


@pytest.mark.parametrize("target", [WEIGHTS_FILE, QUANT_FILE])
def test_a_flipped_byte_in_a_v2_artifact_is_refused(target, tiny_models, calib_file, tmp_path):
    from slmedge.export.gguf import export_gguf
    from slmedge.models.source import load

    _, v2, _ = both_versions(tiny_models("llama"), calib_file, tmp_path, "wanda", bits=None, sparsity=0.5)
    f = v2 / target
    data = bytearray(f.read_bytes())
    data[-3] ^= 0x01  # inside the last tensor's data: the file still parses
    f.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="checksum mismatch"):
        Artifact.open(v2)
    with pytest.raises(ArtifactError, match="checksum mismatch"):
        load(str(v2))
    with pytest.raises(SlmedgeError, match="checksum mismatch"):
        export_gguf(v2, tmp_path / "m.gguf", "f32", verify=False)


def test_an_edited_weights_metadata_is_refused_even_with_matching_checksums(tiny_models, calib_file, tmp_path):
    """The weights file's metadata names the linears it rebuilds; they must be the manifest's."""
    from safetensors.torch import save_file

    from slmedge.fsutil import sealed, sha256_file

    _, v2, _ = both_versions(tiny_models("llama"), calib_file, tmp_path, "rtn", bits=4)
    with safe_open(str(v2 / WEIGHTS_FILE), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        meta = json.loads(f.metadata()["slmedge"])
    first = next(iter(meta["rebuilt"]))
    meta["rebuilt"][first] = "model.layers.9.mlp.up_proj"
    save_file(tensors, str(v2 / WEIGHTS_FILE), metadata={"slmedge": json.dumps(meta, sort_keys=True)})
    manifest = json.loads((v2 / MANIFEST).read_text())
    manifest["files"][WEIGHTS_FILE]["sha256"] = sha256_file(v2 / WEIGHTS_FILE)
    (v2 / MANIFEST).write_text(json.dumps(sealed(manifest)))
    with pytest.raises(ArtifactError, match="does not list"):
        Artifact.open(v2)


# --- exports: byte for byte the same from either version ------------------------------------------------

_SOURCE_KEYS = ("source", "source_manifest_sha256", "manifest_sha256", "seconds", "file_sha256")


def _gguf_manifest(path: Path) -> dict:
    from slmedge.export.inspect import read_gguf_manifest

    return read_gguf_manifest(path)


@pytest.mark.parametrize("method,kw,qtype", [("gptq", dict(bits=4, act_order=True), "auto"),
                                             ("wanda", dict(bits=None, sparsity=0.5), "f32"),
                                             ("sparsegpt", dict(bits=4, sparsity=0.5), "auto")])
def test_gguf_exports_of_v1_and_v2_are_byte_identical(method, kw, qtype, tiny_models, calib_file, tmp_path):
    require_import("llama_cpp")
    from slmedge.export.gguf import export_gguf

    v1, v2, _ = both_versions(tiny_models("llama"), calib_file, tmp_path, method, **kw)
    r1 = export_gguf(v1, tmp_path / "v1" / "m.gguf", qtype)
    r2 = export_gguf(v2, tmp_path / "v2" / "m.gguf", qtype)
    m1, m2 = _gguf_manifest(tmp_path / "v1" / "m.gguf"), _gguf_manifest(tmp_path / "v2" / "m.gguf")
    # file_sha256: every byte of the file but the manifest string
    assert m1["file_sha256"] == m2["file_sha256"]
    assert {k: v for k, v in m1.items() if k not in _SOURCE_KEYS} == {k: v for k, v in m2.items() if k not in _SOURCE_KEYS}
    assert r1["bytes"] == r2["bytes"] and r1["verification"] == r2["verification"]
    assert r1["tensors"] == r2["tensors"]


@pytest.mark.parametrize("method,kw,otype", [("gptq", dict(bits=4, act_order=True), "auto"),
                                             ("wanda", dict(bits=None, sparsity=0.5), "fp32")])
def test_onnx_exports_of_v1_and_v2_are_byte_identical(method, kw, otype, tiny_models, calib_file, tmp_path):
    from slmedge.export.onnx import EXPORT_MANIFEST, export_onnx

    v1, v2, _ = both_versions(tiny_models("llama"), calib_file, tmp_path, method, **kw)
    r1 = export_onnx(v1, tmp_path / "v1" / "onnx", otype)
    r2 = export_onnx(v2, tmp_path / "v2" / "onnx", otype)
    d1, d2 = tmp_path / "v1" / "onnx", tmp_path / "v2" / "onnx"
    names = sorted(p.name for p in d1.iterdir())
    assert names == sorted(p.name for p in d2.iterdir())
    for name in names:
        if name != EXPORT_MANIFEST:
            assert (d1 / name).read_bytes() == (d2 / name).read_bytes(), name
    strip = lambda m: {k: v for k, v in m.items() if k not in _SOURCE_KEYS + ("path",)}  # noqa: E731
    assert strip(r1) == strip(r2)
    assert r1["verification"] == r2["verification"]
