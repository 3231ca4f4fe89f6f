"""slmedge's compressed-tensors exports (written with the compressed-tensors this environment has) read
by the releases the tools around slmedge pin, each in its own virtualenv (benchmarks/ct_readers.sh):

- compressed-tensors 0.17.0 with transformers 5.20 (vLLM 0.33's pins);
- compressed-tensors 0.19.0 with transformers 5.17 (llm-compressor 0.14.0.1's pins).

Each reader runs benchmarks/ct_reader.py once over every checkpoint below, in a subprocess of its
own Python: transformers' ``from_pretrained`` (decompressed at load, and kept compressed until the
first forward pass) and compressed-tensors' own ``CompressedTensorsDequantizer``. Every linear must
decode to the artifact's weights bit for bit, and the logits must equal torch's of the artifact within
fp32 rounding. A ragged last group, which slmedge refuses to write, is written by hand here to show
what the readers do with it.
"""

import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import missing_prerequisite, require_import, single_scheme_transformers

ROOT = Path(__file__).resolve().parent.parent
READER_SCRIPT = ROOT / "benchmarks" / "ct_reader.py"
MAKE = "bash benchmarks/ct_readers.sh"
# compressed-tensors release -> (the tool that pins it, the transformers minor it is read with)
READERS = {"0.17.0": ("vLLM 0.33.0", "5.20"), "0.19.0": ("llm-compressor 0.14.0.1", "5.17")}

# name -> (model type, method, recipe): the grids, methods and sparsity the export writes
CASES = {
    "gptq-w4g32-sym-actorder": ("llama", "gptq", {"bits": 4, "symmetric": True, "act_order": True}),
    "gptq-w4g32-asym-actorder": ("qwen2", "gptq", {"bits": 4, "symmetric": False, "act_order": True}),
    "gptq-w4g32-asym": ("qwen3", "gptq", {"bits": 4, "symmetric": False}),
    "awq-w4g32-asym": ("llama", "awq", {"bits": 4, "symmetric": False}),
    "awq-w4g32-sym": ("qwen2", "awq", {"bits": 4, "symmetric": True}),
    "rtn-w4g64-asym-one-group": ("llama", "rtn", {"bits": 4, "group_size": 64, "symmetric": False}),
    "rtn-w4g128-sym-two-grids": ("mistral", "rtn", {"bits": 4, "group_size": 128, "symmetric": True}),
    "rtn-w8g64-asym": ("phi3", "rtn", {"bits": 8, "group_size": 64, "symmetric": False}),
    "rtn-w8-channel-sym": ("qwen2", "rtn", {"bits": 8, "group_size": -1, "symmetric": True}),
    "rtn-w2g32-asym": ("gemma2", "rtn", {"bits": 2, "symmetric": False}),
    "rtn-w4g32-asym-gemma3": ("gemma3_text", "rtn", {"bits": 4, "symmetric": False}),
    "wanda-50%": ("qwen2", "wanda", {"bits": None, "sparsity": 0.5}),
    "sparsegpt-2:4": ("llama", "sparsegpt", {"bits": None, "sparsity": "2:4"}),
    "sparsegpt-50%+w4g32-asym": ("llama", "sparsegpt", {"bits": 4, "sparsity": 0.5, "symmetric": False}),
    "sparsegpt-2:4+w4g32-sym": ("qwen2", "sparsegpt", {"bits": 4, "sparsity": "2:4", "symmetric": True}),
}
RAGGED = "rtn-w4g48-asym-ragged"  # 64 and 128 input columns: groups of 48 leave 16 and 32
IDS = [1, 5, 17, 99, 3, 250, 42, 8, 300, 7, 64, 11]
# The readers run torch 2.13 (and transformers 5.17 or 5.20) against this environment's release: the
# same weights (checked bit for bit first), another build's fp32 kernels. Measured: up to 1.4e-3 apart on
# the 2-bit case's logits (|logit| ~2; torch 2.13.0+cpu against 2.14.1+cu130 on CPU), 1e-5 elsewhere; a
# wrongly decoded group moves them by 1e-1 and more.
LOGITS_TOL = {"rtol": 1e-3, "atol": 5e-3}


def readers_dir() -> Path:
    return Path(os.environ.get("CT_READERS_DIR") or ROOT / ".bench" / "ct-readers")


def reader_python(version: str) -> Path:
    """The Python of a reader's virtualenv (made by benchmarks/ct_readers.sh; its ``ready`` file is
    written last)."""
    venv = readers_dir() / f"ct-{version}"
    if not (venv / "ready").is_file():
        tool, _ = READERS[version]
        missing_prerequisite(f"no compressed-tensors {version} reader ({tool}'s pin) in {venv}: run {MAKE} "
                             "(scripts/test.sh makes it)")
    return venv / "bin" / "python"


@pytest.fixture(scope="module")
def exports(artifacts, tmp_path_factory):
    """name -> (artifact, export folder) of every case, and the hand-written ragged checkpoint."""
    require_import("compressed_tensors")
    from slmedge.export.compressed_tensors import export_compressed_tensors

    root = tmp_path_factory.mktemp("ct-exports")
    built = {}
    for name, (model_type, method, kw) in CASES.items():
        art = artifacts(model_type, method, **kw)
        # verified in this environment before it appears, where this transformers can read it (5.21+ reads
        # one grid per checkpoint: the two-grid case is then checked by the readers alone)
        verify = not (name.endswith("two-grids") and single_scheme_transformers())
        export_compressed_tensors(art, root / name, verify=verify)
        built[name] = (art, root / name)
    art = artifacts("llama", "rtn", bits=4, group_size=48, symmetric=False)
    built[RAGGED] = (art, ragged_checkpoint(art, root / RAGGED))
    return built


def ragged_checkpoint(art: Path, out: Path) -> Path:
    """The artifact's codes written as compressed-tensors would hold a ragged last group if it let one
    through: packed codes, (rows, ceil(cols / 48)) scales and zero points, group size 48 in the config."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
    from safetensors.torch import save_file

    from slmedge.compress.artifact import Artifact
    from slmedge.models.artifact_weights import load_model

    out.mkdir()
    shutil.copyfile(art / "config.json", out / "config.json")
    layers = Artifact.open(art).layers()
    tensors = {k: v.clone().contiguous() for k, v in load_model(art).state_dict().items()
               if k.rsplit(".", 1)[0] not in layers}
    for name, res in layers.items():
        offset = 1 << (res.spec.bits - 1)
        assert res.codes.shape[1] % 48  # ragged indeed
        tensors[f"{name}.weight_packed"] = pack_to_int32((res.codes.to(torch.int16) - offset).to(torch.int8), 4)
        tensors[f"{name}.weight_shape"] = torch.tensor(res.codes.shape)
        tensors[f"{name}.weight_scale"] = res.scales.to(torch.float16).contiguous()
        zero = (res.zeros.to(torch.int16) - offset).to(torch.int8)
        tensors[f"{name}.weight_zero_point"] = pack_to_int32(zero, 4, packed_dim=0).contiguous()
    tensors.pop("lm_head.weight", None)  # tied to the embedding
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    args = QuantizationArgs(num_bits=4, type="int", symmetric=False, strategy="group", group_size=48)
    qc = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args,
                                                                         format="pack-quantized")},
                            format="pack-quantized", quantization_status="compressed", ignore=["lm_head"])
    ModelCompressor(quantization_config=qc).update_config(str(out))
    return out


@pytest.fixture(scope="module")
def read(exports, tmp_path_factory):
    """version -> (results.json, its folder): the reader run once over every checkpoint."""
    done = {}

    def run(version: str):
        if version not in done:
            python = reader_python(version)
            out = tmp_path_factory.mktemp(f"read-{version}")
            jobs = out / "jobs.json"
            jobs.write_text(json.dumps({"ids": IDS, "checkpoints": {n: str(p) for n, (_, p) in exports.items()}}))
            proc = subprocess.run([str(python), str(READER_SCRIPT), str(jobs), str(out)], capture_output=True,
                                  text=True, timeout=900, env={**os.environ, "PYTHONPATH": ""}, cwd=out)
            assert proc.returncode == 0, proc.stderr[-3000:]
            done[version] = (json.loads((out / "results.json").read_text()), out)
        return done[version]

    return run


_OURS: dict = {}


def ours(art: Path):
    """slmedge's own model of the artifact (this environment's torch): its linear weights and logits."""
    if art not in _OURS:
        from slmedge.models.artifact_weights import load_model

        model = load_model(art).eval()
        weights = {f"{n}.weight": m.weight.detach().float().clone() for n, m in model.named_modules()
                   if isinstance(m, torch.nn.Linear)}
        with torch.no_grad():
            logits = model(torch.tensor([IDS])).logits[0].float().numpy()
        _OURS[art] = (weights, logits)
    return _OURS[art]


def load(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path))


@pytest.mark.parametrize("version", sorted(READERS))
def test_the_reader_is_the_release_its_tool_pins(version, read):
    results, _ = read(version)
    tool, tf_minor = READERS[version]
    assert results["versions"]["compressed-tensors"] == version, tool
    assert results["versions"]["transformers"].startswith(tf_minor + "."), (tool, results["versions"])


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("version", sorted(READERS))
def test_the_reader_decodes_the_artifacts_weights_and_logits(version, case, read, exports):
    results, out = read(version)
    art, _ = exports[case]
    got = results["checkpoints"][case]
    tool = READERS[version][0]
    assert got["transformers"]["status"] == "ok", f"{tool}'s reader: {got['transformers']}"
    weights, logits = ours(art)
    theirs = load(out / f"{case}.transformers.safetensors")
    assert sorted(theirs) == sorted(weights)
    for name, w in weights.items():  # every linear, compressed or not, bit for bit
        assert torch.equal(theirs[name], w), f"{tool}'s reader decodes {name} to other weights"
    np.testing.assert_allclose(np.load(out / f"{case}.logits.npy"), logits, **LOGITS_TOL)
    # the default load (compressed until the first forward pass) computes the same
    assert got["transformers_compressed"]["status"] == "ok", got["transformers_compressed"]
    np.testing.assert_allclose(np.load(out / f"{case}.compressed_logits.npy"), logits, **LOGITS_TOL)
    # compressed-tensors' own reading of the files, without transformers' model
    from slmedge.compress.artifact import Artifact

    layers = Artifact.open(art).layers()
    coded = [n for n, r in layers.items() if r.codes is not None]
    if not coded:  # pruned only: a plain checkpoint, nothing packed
        assert got["compressed_tensors"]["status"] == "none", got["compressed_tensors"]
        return
    assert got["compressed_tensors"]["status"] == "ok", f"{tool}'s compressed-tensors: {got['compressed_tensors']}"
    decoded = load(out / f"{case}.ct.safetensors")
    assert sorted(decoded) == sorted(f"{n}.weight" for n in coded)
    for name in coded:
        # Its model-free dequantizer multiplies in the stored scales' dtype (fp16) before the cast to fp32:
        # the artifact's weights rounded once to fp16, exactly (what an fp16 engine holds).
        scale_dtype = layers[name].scales.dtype
        assert scale_dtype == torch.float16
        assert torch.equal(decoded[f"{name}.weight"], weights[f"{name}.weight"].to(scale_dtype).float()), name
    check = got["compressed_tensors_validate"]
    if check["status"] != "ok":  # the dequantizer's name check does not know a linear's bias (Qwen2's q/k/v)
        assert check["error"].startswith("ValueError: Found") and "unconsumed keys" in check["error"], check
        unconsumed = check["error"].split("--", 1)[1]
        assert {k.strip(" '[]") for k in unconsumed.split(",")} <= {f"{n}.bias" for n in coded}, check


@pytest.mark.parametrize("version", sorted(READERS))
def test_no_reader_reads_a_ragged_last_group(version, read):
    """Why slmedge refuses a group size that does not divide a linear's width (tests/
    test_export_compressed_tensors.py shows the refusal): every reader stops on the file."""
    results, _ = read(version)
    got = results["checkpoints"][RAGGED]
    for reading in ("transformers", "compressed_tensors"):
        assert got[reading]["status"] == "error", (reading, got[reading])
        assert "tensor column shape must be divisble by the given group_size" in got[reading]["error"], got[reading]


def test_a_missing_reader_says_how_to_make_it(monkeypatch, tmp_path):
    monkeypatch.setenv("CT_READERS_DIR", str(tmp_path))
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match=r"no compressed-tensors 0\.17\.0 reader.*ct_readers\.sh"):
        reader_python("0.17.0")
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI=true"):
        reader_python("0.17.0")
