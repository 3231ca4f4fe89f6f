"""Compression end to end on tiny models: the CLI, the artifact contract, determinism."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from slmedge.cli import app
from slmedge.compress.api import compress
from slmedge.compress.artifact import MANIFEST, QUANT_FILE, Artifact
from slmedge.compress.quant import dequantize_codes
from slmedge.compress.recipe import Recipe
from slmedge.errors import ArtifactError
from slmedge.fsutil import sha256_file
from slmedge.models.architectures import ARCHITECTURES

runner = CliRunner()

METHOD_ARGS = {
    "rtn": ["--bits", "4", "--group-size", "32"],
    "gptq": ["--bits", "4", "--group-size", "32"],
    "awq": ["--bits", "4", "--group-size", "32", "--awq-grid", "4"],
    "magnitude": ["--sparsity", "0.5"],
    "wanda": ["--sparsity", "2:4"],
    "sparsegpt": ["--sparsity", "0.5", "--bits", "8", "--group-size", "-1"],
}
SMALL = ["--nsamples", "6", "--seqlen", "32", "--batch-size", "4"]


def small_recipe(calib_file, **kw) -> Recipe:
    base = dict(group_size=32, calibration=str(calib_file), nsamples=6, seqlen=32, batch_size=4, awq_grid=4)
    base.update(kw)
    return Recipe(**base)


@pytest.mark.parametrize("model_type", sorted(ARCHITECTURES))
@pytest.mark.parametrize("method", sorted(METHOD_ARGS))
def test_every_method_runs_through_the_cli_on_every_architecture(model_type, method, tiny_models, calib_file, tmp_path):
    out = tmp_path / "out"
    result = runner.invoke(app, ["compress", str(tiny_models(model_type)), "--method", method, *METHOD_ARGS[method],
                                 *SMALL, "--calibration", str(calib_file), "-o", str(out), "--device", "cpu"])
    assert result.exit_code == 0, result.output
    art = Artifact.open(out)
    assert art.manifest["recipe"]["method"] == method
    assert art.manifest["architecture"] == model_type
    assert len(art.manifest["layers"]) == 2 * len(ARCHITECTURES[model_type].linear_names)
    AutoModelForCausalLM.from_pretrained(out)


@pytest.mark.parametrize("method,kw", [("gptq", {}), ("awq", {}), ("sparsegpt", {"sparsity": "2:4", "bits": 4}),
                                       ("wanda", {"sparsity": "0.5", "bits": None})])
def test_artifact_reloads_with_transformers_alone_and_same_logits(method, kw, tiny_models, calib_file, tmp_path):
    outcome = compress(str(tiny_models("qwen2")), small_recipe(calib_file, method=method, **kw), tmp_path / "a", device="cpu")
    ids = torch.randint(3, 300, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        in_memory = outcome.loaded.model(ids).logits
        reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "a")(ids).logits
    assert torch.equal(in_memory, reloaded)


@pytest.mark.parametrize("method,kw", [("gptq", {"act_order": True}), ("awq", {}), ("rtn", {"symmetric": True}),
                                       ("sparsegpt", {"sparsity": "0.5", "bits": 3})])
def test_codes_dequantize_exactly_to_the_saved_weights(method, kw, tiny_models, calib_file, tmp_path):
    compress(str(tiny_models("llama")), small_recipe(calib_file, method=method, **kw), tmp_path / "a", device="cpu")
    art = Artifact.open(tmp_path / "a")
    model = art.load_model()
    layers = art.layers()
    assert layers
    for name, res in layers.items():
        weight = model.get_submodule(name).weight.data
        assert torch.equal(dequantize_codes(res.codes, res.scales, res.zeros, res.spec), weight), name
        if res.mask is not None:
            assert (weight[~res.mask] == 0).all()


def test_pruning_reaches_the_ratio_in_each_comparison_group(tiny_models, calib_file, tmp_path):
    compress(str(tiny_models("mistral")), small_recipe(calib_file, method="wanda", sparsity="0.5", bits=None),
             tmp_path / "w", device="cpu")
    for name, res in Artifact.open(tmp_path / "w").layers().items():
        assert ((~res.mask).sum(dim=1) == res.mask.shape[1] // 2).all(), name
    compress(str(tiny_models("mistral")), small_recipe(calib_file, method="sparsegpt", sparsity="4:8", bits=None),
             tmp_path / "s", device="cpu")
    for name, res in Artifact.open(tmp_path / "s").layers().items():
        assert ((~res.mask).reshape(res.mask.shape[0], -1, 8).sum(dim=2) == 4).all(), name


def test_same_seed_gives_byte_identical_artifacts(tiny_models, calib_file, tmp_path):
    digests = []
    for run, seed in (("a", 3), ("b", 3), ("c", 4)):
        compress(str(tiny_models("llama")), small_recipe(calib_file, method="gptq", seed=seed), tmp_path / run, device="cpu")
        digests.append({f: sha256_file(tmp_path / run / f) for f in ("model.safetensors", QUANT_FILE)})
        calib = json.loads((tmp_path / run / MANIFEST).read_text())["calibration"]["tokens_sha256"]
        digests[-1]["calib"] = calib
    assert digests[0] == digests[1]
    assert digests[0]["calib"] != digests[2]["calib"]


def test_manifest_records_recipe_identity_versions_sizes_and_checksums(tiny_models, calib_file, tmp_path):
    compress(str(tiny_models("gemma3_text")), small_recipe(calib_file, method="awq"), tmp_path / "a", device="cpu")
    m = json.loads((tmp_path / "a" / MANIFEST).read_text())
    assert m["recipe"]["method"] == "awq" and m["recipe"]["group_size"] == 32
    assert m["base_model"]["kind"] == "hf_dir" and len(m["base_model"]["weights_sha256"]) == 64
    assert m["calibration"]["nsamples"] == 6 and len(m["calibration"]["files"]) == 1
    assert {"torch", "transformers", "slmedge"} <= set(m["versions"])
    assert "compress_s" in m["timings"]
    for name in ("model.safetensors", QUANT_FILE, "config.json", "tokenizer.json"):
        assert m["files"][name]["sha256"] == sha256_file(tmp_path / "a" / name)
        assert m["files"][name]["bytes"] > 0


def test_loading_checks_the_checksums(tiny_models, calib_file, tmp_path):
    compress(str(tiny_models("llama")), small_recipe(calib_file, method="rtn"), tmp_path / "a", device="cpu")
    with open(tmp_path / "a" / QUANT_FILE, "r+b") as f:
        f.seek(-3, 2)
        f.write(b"xyz")
    with pytest.raises(ArtifactError, match="checksum mismatch for quantization.safetensors"):
        Artifact.open(tmp_path / "a")
    result = runner.invoke(app, ["compress", str(tmp_path / "a"), "--method", "rtn", "-o", str(tmp_path / "b")])
    assert result.exit_code != 0 and "checksum mismatch" in result.output
    (tmp_path / "a" / QUANT_FILE).unlink()
    with pytest.raises(ArtifactError, match="missing"):
        Artifact.open(tmp_path / "a")


def test_an_artifact_is_a_model_source(tiny_models, calib_file, tmp_path):
    compress(str(tiny_models("llama")), small_recipe(calib_file, method="wanda", sparsity="0.25", bits=None), tmp_path / "a",
             device="cpu")
    outcome = compress(str(tmp_path / "a"), small_recipe(calib_file, method="gptq"), tmp_path / "b", device="cpu")
    assert outcome.manifest["base_model"]["kind"] == "artifact"
    assert outcome.manifest["base_model"]["recipe"]["method"] == "wanda"


def test_lm_head_can_be_included(tiny_models, calib_file, tmp_path):
    result = runner.invoke(app, ["compress", str(tiny_models("mistral")), "--method", "gptq", "-g", "32", *SMALL,
                                 "--calibration", str(calib_file), "--include-head", "-o", str(tmp_path / "h")])
    assert result.exit_code == 0, result.output
    assert "lm_head" in Artifact.open(tmp_path / "h").manifest["layers"]


def test_skip_patterns_leave_layers_alone(tiny_models, calib_file, tmp_path):
    result = runner.invoke(app, ["compress", str(tiny_models("llama")), "--method", "rtn", "-g", "32",
                                 "--skip", "*.mlp.*", "-o", str(tmp_path / "s")])
    assert result.exit_code == 0, result.output
    names = Artifact.open(tmp_path / "s").manifest["layers"]
    assert names and not any(".mlp." in n for n in names)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
@pytest.mark.parametrize("method,kw", [("gptq", {}), ("awq", {}), ("sparsegpt", {"sparsity": "2:4", "bits": None})])
def test_cuda_device_gives_the_cpu_result(method, kw, tiny_models, calib_file, tmp_path):
    cpu = compress(str(tiny_models("llama")), small_recipe(calib_file, method=method, **kw), write=False, device="cpu")
    gpu = compress(str(tiny_models("llama")), small_recipe(calib_file, method=method, **kw), write=False, device="cuda")
    for name, res in cpu.result.layers.items():
        other = gpu.result.layers[name]
        assert other.weight.device.type == "cpu"
        # Different kernels round differently; the codes may differ by one step in a few places.
        assert (res.weight - other.weight).abs().mean() < 1e-2 * res.weight.abs().mean()
