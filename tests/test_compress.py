"""Compression end to end on tiny models: the CLI, the artifact contract, determinism."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from slmedge.cli import app
from slmedge.compress.api import compress
from slmedge.compress.artifact import MANIFEST, QUANT_FILE, WEIGHTS_FILE, Artifact
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
    if kw.get("grid") or kw.get("bpw"):  # a grid fixes the group size: one given besides is refused
        del base["group_size"]
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
    art.load_model()


@pytest.mark.parametrize("method,kw", [("gptq", {}), ("awq", {}), ("sparsegpt", {"sparsity": "2:4", "bits": 4}),
                                       ("wanda", {"sparsity": "0.5", "bits": None})])
def test_artifact_reloads_with_the_same_logits_and_materializes_for_transformers_alone(method, kw, tiny_models,
                                                                                        calib_file, tmp_path):
    from slmedge.models.artifact_weights import materialize

    # Written, the model is consumed block by block; in memory it stays whole (fp32): the same weights.
    outcome = compress(str(tiny_models("qwen2")), small_recipe(calib_file, method=method, **kw), tmp_path / "a", device="cpu")
    assert outcome.loaded.model is None
    whole = compress(str(tiny_models("qwen2")), small_recipe(calib_file, method=method, **kw), write=False, device="cpu")
    ids = torch.randint(3, 300, (1, 24), generator=torch.Generator().manual_seed(0))
    materialize(tmp_path / "a", tmp_path / "hf")
    with torch.no_grad():
        in_memory = whole.model()(ids).logits
        reloaded = Artifact.open(tmp_path / "a").load_model()(ids).logits
        plain = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")(ids).logits
    assert torch.equal(in_memory, reloaded)
    assert torch.equal(in_memory, plain)


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
        digests.append({f: sha256_file(tmp_path / run / f) for f in (WEIGHTS_FILE, QUANT_FILE)})
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
    # The search dtype "auto" chose on this machine is recorded.
    from slmedge.compress.methods.awq import search_dtype

    assert m["recipe"]["awq_search_dtype"] == "auto"
    assert m["resolved"] == {"awq_search_dtype": str(search_dtype("auto", "cpu")).removeprefix("torch.")}
    assert "compress_s" in m["timings"]
    for name in (WEIGHTS_FILE, QUANT_FILE, "config.json", "tokenizer.json"):
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


# --- range checks: refused before any work, one line naming the setting, exit 2 ------------------

@pytest.mark.parametrize("args,words", [
    # Every linear of the tiny llama is 64 or 128 columns wide: a group wider than all of them.
    (["--method", "rtn", "-g", "1024"], ["group size 1024", "model.layers.0.mlp.down_proj", "128 columns",
                                         "--group-size 128 or less", "-1"]),
    (["--method", "gptq", "-g", "129"], ["group size 129", "--group-size 128 or less"]),
    # With the MLP skipped the widest layer left is 64 columns wide.
    (["--method", "rtn", "-g", "128", "--skip", "*.mlp.*"], ["group size 128", "64 columns", "--group-size 64 or less"]),
    (["--method", "wanda", "--sparsity", "0.5", "--bits", "4", "-g", "256"], ["group size 256"]),
    (["--method", "rtn", "-g", "-2"], ["--group-size must be an integer from 1 to 65,536 or -1 (per channel)"]),
    (["--method", "magnitude", "--sparsity", "0.5", "-g", "0"], ["--group-size must be an integer from 1", "got 0"]),
    (["--method", "gptq", "--nsamples", "0"], ["nsamples must be an integer of at least 1, got 0"]),
    (["--method", "gptq", "--nsamples", "-3"], ["nsamples must be an integer of at least 1, got -3"]),
    (["--method", "gptq", "--seqlen", "0"], ["seqlen must be an integer of at least 8, got 0"]),
    # The tiny models have 512 positions.
    (["--method", "gptq", "--seqlen", "513"], ["seqlen 513 is longer than the model's 512 positions", "--seqlen 512"]),
    (["--method", "awq", "--seqlen", "4096"], ["seqlen 4096", "512 positions"]),
    (["--method", "gptq", "--batch-size", "0"], ["--batch-size must be an integer of at least 1, got 0"]),
    (["--method", "gptq", "--block-size", "0"], ["--block-size must be an integer of at least 1, got 0"]),
    (["--method", "gptq", "--damp", "-0.01"], ["damp must be in [0, 1)", "-0.01"]),
    (["--method", "gptq", "--damp", "1"], ["damp must be in [0, 1)"]),
    (["--method", "gptq", "--damp", "nan"], ["damp must be in [0, 1)"]),
    (["--method", "awq", "--awq-grid", "0"], ["--awq-grid must be an integer of at least 1, got 0"]),
    (["--method", "awq", "--awq-max-tokens", "8"], ["--awq-max-tokens must be an integer of at least 16, got 8"]),
    (["--method", "awq", "--awq-search-dtype", "fp16"], ["awq_search_dtype must be one of auto, bfloat16, float32, got 'fp16'"]),
    (["--method", "rtn", "--bits", "1"], ["bits must be an integer from 2 to 8, got 1"]),
    (["--method", "sparsegpt", "--sparsity", "0.5", "--bits", "16"], ["bits must be an integer from 2 to 8, got 16"]),
    (["--method", "magnitude", "--sparsity", "1.0"], ["sparsity must be at least 0 and below 1, got 1"]),
    (["--method", "wanda", "--sparsity", "-0.5"], ["sparsity must be at least 0 and below 1, got -0.5"]),
    (["--method", "gptq", "--seed", "-1"], ["--seed must be an integer of at least 0, got -1"]),
    (["--method", "gptq", "--calibration", " "], ["calibration must be"]),
    (["--method", "rtn", "--skip", "*"], ["leave no linear layer to compress"]),
])
def test_out_of_range_settings_are_refused_before_any_work(args, words, tiny_models, tmp_path, monkeypatch):
    import slmedge.compress.api as api

    def no_calibration(*a, **k):
        raise AssertionError("calibration was loaded before the settings were checked")

    monkeypatch.setattr(api, "load_calibration", no_calibration)
    out = tmp_path / "out"
    res = runner.invoke(app, ["compress", str(tiny_models("llama")), *args, "-o", str(out), "--device", "cpu"])
    assert res.exit_code == 2, res.output
    text = res.output.strip()
    assert text.startswith("error:") and len(text.splitlines()) == 1 and "Traceback" not in text, text
    for w in words:
        assert w in text, text
    assert not out.exists()


def test_a_group_wider_than_some_layers_is_one_group_per_row_there(tiny_models, calib_file, tmp_path):
    """-g 128 on the tiny llama: the 64-wide linears get one group per row (the group cut at the
    layer's edge, as a ragged last group is), the 128-wide down_proj one group of 128; -g 96 gives
    down_proj a full group and a ragged one of 32."""
    for g, down_groups in ((128, 1), (96, 2)):
        outcome = compress(str(tiny_models("llama")), small_recipe(calib_file, method="rtn", group_size=g), write=False,
                           device="cpu")
        for name, res in outcome.result.layers.items():
            want = down_groups if name.endswith("down_proj") else 1
            assert res.scales.shape[1] == want, (g, name, res.scales.shape)
            assert torch.equal(dequantize_codes(res.codes, res.scales, res.zeros, res.spec), res.weight)


def test_largest_group_and_positions_that_fit_are_accepted(tiny_models, calib_file, tmp_path):
    outcome = compress(str(tiny_models("llama")), small_recipe(calib_file, method="gptq", group_size=128, seqlen=512,
                                                                nsamples=1, batch_size=1), write=False, device="cpu")
    assert outcome.result.layers


@pytest.mark.parametrize("field,value,words", [
    ("awq_grid", True, "awq_grid must be an integer"),
    ("nsamples", 2.5, "nsamples must be an integer"),
    ("group_size", True, "group size must be"),
    ("group_size", 32.0, "group size must be"),
    ("nsamples", 1 << 17, "nsamples must be at most 65,536"),
    ("awq_grid", 10**9, "awq_grid must be at most 1,000"),
    ("damp", float("nan"), "damp must be in"),
    ("seed", 2**64, "seed must be a non-negative integer"),
    ("seed", "3", "seed must be"),
])
def test_recipe_values_of_the_wrong_kind_are_refused(field, value, words):
    from slmedge.errors import ConfigError

    with pytest.raises(ConfigError, match=words):
        Recipe(method="gptq", **{field: value}).validate()


def test_the_library_call_with_a_missing_model_creates_no_folders(tmp_path):
    from slmedge.compress.api import compress
    from slmedge.errors import ModelNotFoundError

    with pytest.raises(ModelNotFoundError):
        compress(str(tmp_path / "nomodel"), None, tmp_path / "a" / "b" / "c")
    assert not (tmp_path / "a").exists()


def test_an_output_under_a_file_is_refused_before_loading(tiny_models, tmp_path):
    from slmedge.compress.api import compress
    from slmedge.errors import SlmedgeError

    (tmp_path / "f").write_text("x")
    with pytest.raises(SlmedgeError, match="not a writable folder"):
        compress(str(tiny_models("llama")), None, tmp_path / "f" / "out")
