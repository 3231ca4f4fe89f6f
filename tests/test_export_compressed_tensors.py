"""`slmedge export --format compressed-tensors`: tiny artifacts of every architecture and method,
read back by transformers and by compressed-tensors' own unpacking, against the artifact."""

import json
import sys

import pytest
import torch
from typer.testing import CliRunner

from conftest import missing_prerequisite, one_line_error, require_import, single_scheme_transformers

from slmedge.cli import app
from slmedge.compress.artifact import Artifact
from slmedge.models.architectures import ARCHITECTURES, exact_attention

runner = CliRunner()


@pytest.fixture(autouse=True)
def compressed_tensors_installed():
    """compressed-tensors of the release the exporter writes with (scripts/setup.sh installs it)."""
    require_import("compressed_tensors")
    from slmedge.errors import RuntimeNotInstalledError
    from slmedge.export.compressed_tensors import require_compressed_tensors

    try:
        require_compressed_tensors()
    except RuntimeNotInstalledError as exc:
        missing_prerequisite(str(exc))


def export(art, out, **kw):
    from slmedge.export.compressed_tensors import export_compressed_tensors

    return export_compressed_tensors(art, out, **kw)


def transformers_model(path):
    """The export as a transformers user loads it: decompressed on the CPU, fp32."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    quantized = "quantization_config" in json.loads((path / "config.json").read_text())  # else a plain checkpoint
    extra = {"quantization_config": CompressedTensorsConfig(dequantize=True)} if quantized else {}
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, **extra).eval()
    # Gemma 2 with the attention that applies its soft-capping (transformers 5.17 defaults to sdpa, which
    # leaves it out): the comparison is of the checkpoint's weights and arithmetic, not of that default.
    return exact_attention(model)


IDS = torch.tensor([[1, 5, 17, 99, 3, 250, 42, 8, 300, 7, 64, 11]])


def logits(model):
    with torch.no_grad():
        return model(IDS).logits.float()


def file_tensors(out):
    from safetensors.torch import load_file

    return load_file(str(out / "model.safetensors"))


def check_codes(out, art):
    """compressed-tensors' own unpacking of the file gives the artifact's codes, zero points and scales."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    tensors = file_tensors(out)
    layers = Artifact.open(art).layers()
    coded = {n: r for n, r in layers.items() if r.codes is not None}
    assert coded
    for name, res in coded.items():
        bits, offset = res.spec.bits, 1 << (res.spec.bits - 1)
        shape = tuple(int(x) for x in tensors[f"{name}.weight_shape"])
        assert shape == tuple(res.codes.shape)
        codes = unpack_from_int32(tensors[f"{name}.weight_packed"], bits, shape).to(torch.int16) + offset
        assert torch.equal(codes, res.codes.to(torch.int16)), name
        assert torch.equal(tensors[f"{name}.weight_scale"].float(), res.scales.float()), name
        if res.spec.symmetric:
            assert f"{name}.weight_zero_point" not in tensors
        else:
            zp = unpack_from_int32(tensors[f"{name}.weight_zero_point"], bits, tuple(res.zeros.shape), packed_dim=0)
            assert torch.equal(zp.to(torch.int16) + offset, res.zeros.to(torch.int16)), name
        assert f"{name}.weight" not in tensors  # packed, not dense
    return coded


def check_round_trip(out, art):
    """transformers' decoded weights are the artifact's, bit for bit, and so are the logits (fp32).
    transformers from 5.2x multiplies codes by scales in the stored scales' dtype (compressed-tensors'
    decompressor): then every quantized linear decodes to the artifact's weight rounded to that dtype,
    bit for bit, and the logits equal those of the artifact's model with the same rounding."""
    from slmedge.models.artifact_weights import load_model

    ours = load_model(art)
    theirs = transformers_model(out)
    mine = dict(ours.state_dict())
    tensors = file_tensors(out)
    modes = set()  # how the quantized linears decode: one way for all of them
    for name in Artifact.open(art).manifest["layers"]:
        got, want = theirs.get_submodule(name).weight.float(), mine[f"{name}.weight"]
        scale = tensors.get(f"{name}.weight_scale")
        if scale is None or torch.equal(got, want):
            assert torch.equal(got, want), name  # a dense (pruned-only) weight is stored as it is
            modes.add("fp32" if scale is not None else None)
            continue
        assert torch.equal(got, want.to(scale.dtype).float()), name
        modes.add(str(scale.dtype))
        ours.get_submodule(name).weight.data = want.to(scale.dtype).float()
    assert len(modes - {None}) <= 1, modes
    torch.testing.assert_close(logits(theirs), logits(ours), rtol=1e-5, atol=1e-5)
    return theirs


# --- every architecture ------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", sorted(ARCHITECTURES))
def test_every_architecture_round_trips(model_type, artifacts, tmp_path):
    art = artifacts(model_type, "rtn", bits=4, group_size=32, symmetric=False)
    report = export(art, tmp_path / "ct")
    out = tmp_path / "ct"
    assert report["type"] == "pack-quantized" and report["verification"]["max_abs_logit_diff"] <= 1e-3
    cfg = json.loads((out / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    assert qc["quantization_status"] == "compressed"
    (group,) = qc["config_groups"].values()
    assert group["targets"] == ["Linear"]
    assert group["weights"]["num_bits"] == 4 and group["weights"]["group_size"] == 32
    assert group["weights"]["symmetric"] is False and group["weights"]["strategy"] == "group"
    assert "lm_head" in qc["ignore"]
    assert (out / "tokenizer.json").is_file() and (out / "slmedge-export.json").is_file()
    coded = check_codes(out, art)
    assert report["codes_kept"] == len(coded)
    check_round_trip(out, art)


# --- methods and grids -------------------------------------------------------------------------


@pytest.mark.parametrize("model_type,method,kw", [
    ("llama", "gptq", {"bits": 4, "symmetric": True, "act_order": True}),
    ("qwen2", "gptq", {"bits": 4, "symmetric": False, "act_order": True}),
    ("qwen2", "gptq", {"bits": 4, "symmetric": False, "act_order": False}),
    ("llama", "awq", {"bits": 4, "symmetric": False}),
    ("qwen2", "awq", {"bits": 4, "symmetric": True}),
    ("llama", "rtn", {"bits": 8, "symmetric": False, "group_size": 64}),
    ("qwen2", "rtn", {"bits": 8, "symmetric": True, "group_size": -1}),
    ("llama", "rtn", {"bits": 2, "symmetric": False}),
])
def test_methods_keep_their_codes(model_type, method, kw, artifacts, tmp_path):
    art = artifacts(model_type, method, **kw)
    out = tmp_path / "ct"
    report = export(art, out)
    check_codes(out, art)
    check_round_trip(out, art)
    groups = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]
    weights = [g["weights"] for g in groups.values()]
    assert {w["symmetric"] for w in weights} == {kw["symmetric"]}
    assert {w["num_bits"] for w in weights} == {kw["bits"]}
    grouped = [w for w in weights if w["strategy"] == "group"]
    if kw.get("act_order") and grouped:  # static groups in the original column order: actorder weight
        assert {w.get("actorder") for w in grouped} == {"weight"}
    else:
        assert all(w.get("actorder") is None for w in weights)
    assert all(r["codes_kept"] for r in report["layers"].values())


def test_a_group_as_wide_as_some_rows_stays_one_config_group(artifacts, tmp_path):
    """Group 64 over 64- and 128-column linears is one config group (group 64, every Linear): the
    64-column rows hold one group each, decoded as a per-channel group would be."""
    art = artifacts("llama", "rtn", bits=4, group_size=64, symmetric=False)
    out = tmp_path / "ct"
    export(art, out)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    (group,) = qc["config_groups"].values()
    assert group["targets"] == ["Linear"]
    assert group["weights"]["strategy"] == "group" and group["weights"]["group_size"] == 64
    check_codes(out, art)
    check_round_trip(out, art)


def test_two_grids_are_two_config_groups_read_back_or_refused_clearly(artifacts, tmp_path):
    """Group 128 over 64-column linears is one group per row of 64 columns, over the 128-column ones one
    group of 128: two config groups, each naming its linears. transformers that reads each group with its
    own scheme reads it back bit for bit; one that does not is named in one clear refusal, nothing written."""
    from slmedge.export.compressed_tensors import CompressedTensorsVerificationError

    art = artifacts("llama", "rtn", bits=4, group_size=128, symmetric=False)
    out = tmp_path / "ct"
    if single_scheme_transformers():
        with pytest.raises(CompressedTensorsVerificationError, match=r"2 weight grids \(W4 group 128 asym; W4 group "
                           r"64 asym\).*decodes every dense layer with one grid's scheme.*--no-verify"):
            export(art, out)
        assert not out.exists()
        export(art, out, verify=False)  # what vLLM reads: written unverified when asked
    else:
        export(art, out)
        check_round_trip(out, art)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    by_size = {g["weights"]["group_size"]: g["targets"] for g in qc["config_groups"].values()}
    assert set(by_size) == {64, 128}
    assert by_size[128] and all("down_proj" in t for t in by_size[128])
    assert by_size[64] and not any("down_proj" in t for t in by_size[64])
    check_codes(out, art)


# --- pruning -----------------------------------------------------------------------------------


def test_pruned_artifact_round_trips_its_mask(artifacts, tmp_path):
    art = artifacts("qwen2", "wanda", bits=None, sparsity=0.5)
    out = tmp_path / "ct"
    report = export(art, out)
    # A plain dense checkpoint, as llm-compressor writes sparse-only models (transformers 5 refuses a
    # quantization_config without config groups); the sparsity is in slmedge's manifest.
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    assert report["type"] == "dense+sparse"
    sparsity = report["sparsity"]
    layers = Artifact.open(art).layers()
    assert sparsity["format"] == "dense" and sparsity["sparsity_structure"] == "unstructured"
    assert sorted(sparsity["targets"]) == sorted(layers) and abs(sparsity["global_sparsity"] - 0.5) < 0.02
    theirs = check_round_trip(out, art)
    for name, res in layers.items():
        w = theirs.get_submodule(name).weight
        assert torch.equal(w != 0, res.mask), name  # the kept weights of a random model are never 0
    assert all(r["mask_kept"] for r in report["layers"].values())
    r = runner.invoke(app, ["inspect", str(out)])  # still found as this format, by its manifest
    assert r.exit_code == 0 and "compressed-tensors" in r.output and "dense checkpoint" in r.output, r.output


def test_pruned_and_quantized_keeps_codes_and_zeros(artifacts, tmp_path):
    art = artifacts("llama", "sparsegpt", bits=4, sparsity=0.5, symmetric=False)
    out = tmp_path / "ct"
    report = export(art, out)
    coded = check_codes(out, art)
    theirs = check_round_trip(out, art)
    for name, res in coded.items():
        assert res.mask is not None
        assert bool((theirs.get_submodule(name).weight[~res.mask] == 0).all()), name
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    # as compressed-tensors 0.17+ and llm-compressor 0.14 write it: no sparsity config (the manifest has it)
    assert qc["format"] == "pack-quantized" and qc["sparsity_config"] == {}
    assert sorted(report["sparsity"]["targets"]) == sorted(coded) and report["sparsity"]["format"] == "dense"
    assert report["type"] == "pack-quantized+sparse" and any("zero point" in n for n in report["notes"])
    r = runner.invoke(app, ["inspect", str(out)])
    assert r.exit_code == 0 and "sparsity" in r.output and "unstructured" in r.output, r.output


# --- refusals ----------------------------------------------------------------------------------


def test_ragged_group_is_refused_with_the_nearest_grid(artifacts, tmp_path):
    from slmedge.export.compressed_tensors import CompressedTensorsExportError, nearest_group_size

    art = artifacts("llama", "rtn", bits=4, group_size=48, symmetric=False)
    out = tmp_path / "ct"
    with pytest.raises(CompressedTensorsExportError) as err:
        export(art, out)
    msg = str(err.value)
    assert "group size 48 does not divide" in msg and "--group-size 32" in msg and "Nothing was written" in msg
    assert not out.exists() and not list(tmp_path.iterdir())
    # SmolLM2-135M: 576 and 1536 input columns; group 128 leaves a ragged 64 -> 64 fits both
    assert nearest_group_size(128, [576, 1536]) == 64
    assert nearest_group_size(128, [2048, 8192]) == 128


def test_bits_readers_disagree_on_are_refused(artifacts, tmp_path):
    from slmedge.export.compressed_tensors import CompressedTensorsExportError

    art = artifacts("qwen2", "rtn", bits=3, symmetric=False)
    with pytest.raises(CompressedTensorsExportError, match="3-bit codes.*--bits 4"):
        export(art, tmp_path / "ct")
    assert not (tmp_path / "ct").exists()


def test_a_folder_without_codes_is_refused(tiny_models, tmp_path):
    from slmedge.export.compressed_tensors import CompressedTensorsExportError

    with pytest.raises(CompressedTensorsExportError, match="no codes or pruning masks"):
        export(tiny_models("llama"), tmp_path / "ct")


def test_verification_catches_wrong_weights(artifacts, tmp_path, monkeypatch):
    """Scales written wrong (twice the artifact's) decode to other weights: refused, nothing left."""
    import slmedge.export.compressed_tensors as ct
    from slmedge.export.compressed_tensors import CompressedTensorsVerificationError

    art = artifacts("llama", "rtn", bits=4, group_size=32, symmetric=False)
    real = ct.pack_linear

    def wrong(*args, **kwargs):
        out = real(*args, **kwargs)
        out["weight_scale"] = out["weight_scale"] * 2
        return out

    monkeypatch.setattr(ct, "pack_linear", wrong)
    with pytest.raises(CompressedTensorsVerificationError, match="other weights than the artifact's"):
        export(art, tmp_path / "ct")
    assert not (tmp_path / "ct").exists()


def test_missing_package_is_one_line_with_the_install_command(artifacts, tmp_path, monkeypatch):
    art = artifacts("llama", "rtn", bits=4, group_size=32, symmetric=False)
    monkeypatch.setitem(sys.modules, "compressed_tensors", None)  # import compressed_tensors -> ImportError
    r = runner.invoke(app, ["export", str(art), "--format", "compressed-tensors", "-o", str(tmp_path / "ct")])
    one_line_error(r, "compressed-tensors is not installed", "pip install 'slmedge[compressed-tensors]'")
    assert not (tmp_path / "ct").exists()


# --- the command line --------------------------------------------------------------------------


def test_cli_export_inspect_and_tamper(artifacts, tmp_path):
    art = artifacts("qwen2", "gptq", bits=4, symmetric=True, act_order=True)
    out = tmp_path / "ct"
    r = runner.invoke(app, ["export", str(art), "--format", "compressed-tensors", "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert "codes kept exactly" in r.output and "14 linears" in r.output and "verified against torch" in r.output
    r = runner.invoke(app, ["inspect", str(out)])
    assert r.exit_code == 0, r.output
    assert "compressed-tensors" in r.output and "pack-quantized" in r.output and "W4 group 32 sym" in r.output
    info = json.loads(runner.invoke(app, ["inspect", str(out), "--json"]).output)
    assert info["format"] == "compressed-tensors" and info["checksums"] == "match the manifest"
    assert info["manifest"]["codes_kept"] == 14
    # a plain from_pretrained (run compressed: compressed-tensors' CompressedLinear) agrees too
    from transformers import AutoModelForCausalLM

    from slmedge.models.artifact_weights import load_model

    plain = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    torch.testing.assert_close(logits(plain), logits(load_model(art)), rtol=1e-5, atol=1e-5)
    assert info["by_type"]["pack-quantized int4"]["tensors"] == 14
    # again without --overwrite: refused; with it: replaced
    r = runner.invoke(app, ["export", str(art), "--format", "compressed-tensors", "-o", str(out)])
    one_line_error(r, "--overwrite")
    r = runner.invoke(app, ["export", str(art), "--format", "compressed-tensors", "-o", str(out), "--overwrite",
                            "--no-verify"])
    assert r.exit_code == 0, r.output
    # a changed weight file no longer matches the manifest
    with open(out / "model.safetensors", "r+b") as f:
        f.seek(-4, 2)
        f.write(b"\x00\x01\x02\x03")
    one_line_error(runner.invoke(app, ["inspect", str(out)]), "checksum mismatch", "model.safetensors")


def test_the_type_is_the_artifacts(artifacts, tmp_path):
    art = artifacts("llama", "rtn", bits=4, group_size=32, symmetric=False)
    r = runner.invoke(app, ["export", str(art), "--format", "compressed-tensors", "--type", "int4", "-o",
                            str(tmp_path / "ct")])
    one_line_error(r, "unknown compressed-tensors type 'int4'; choose auto")
    assert "auto," not in r.output and not (tmp_path / "ct").exists()


def test_overwrite_never_replaces_a_folder_slmedge_did_not_write(artifacts, tmp_path):
    art = artifacts("llama", "rtn", bits=4, group_size=32, symmetric=False)
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    r = runner.invoke(app, ["export", str(art), "--format", "compressed-tensors", "-o", str(out), "--overwrite"])
    one_line_error(r, "did not write")
    assert (out / "notes.txt").read_text() == "keep me"


@pytest.mark.parametrize("method,kw", [("sparsegpt", {"bits": 4, "sparsity": 0.5}), ("wanda", {"bits": None,
                                                                                             "sparsity": 0.5})])
def test_a_version_1_artifact_exports_the_same_checkpoint(method, kw, tiny_models, calib_file, tmp_path):
    """Dense fp32 weights (version 1) or rebuilt ones (version 2): the same tensors are written."""
    from safetensors.torch import load_file

    from conftest import small_recipe
    from slmedge.compress.api import compress
    from slmedge.compress.artifact import write_artifact

    out = compress(str(tiny_models("qwen2")), small_recipe(calib_file, method=method, **kw), write=False, device="cpu")
    args = (out.loaded.model, out.loaded.tokenizer, out.result.layers, out.result.extras, out.manifest)
    v1 = write_artifact(tmp_path / "v1", *args, version=1)
    v2 = write_artifact(tmp_path / "v2", *args, source_dir=out.loaded.hf_dir)
    export(v1, tmp_path / "ct1")
    export(v2, tmp_path / "ct2")
    a, b = load_file(str(tmp_path / "ct1" / "model.safetensors")), load_file(str(tmp_path / "ct2" / "model.safetensors"))
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


# --- evaluated like any export -----------------------------------------------------------------


def test_evaluate_runs_the_checkpoint_in_torch_with_the_artifacts_numbers(artifacts, tmp_path):
    """An export folder in this format is a checkpoint torch loads (transformers decompresses it):
    `evaluate` opens it there, whole (never streamed from its packed tensors), and scores what the
    artifact scores."""
    from slmedge.evaluate.api import EvalSettings, evaluate

    art = artifacts("llama", "rtn", bits=4, group_size=32, symmetric=False)
    export(art, tmp_path / "ct")
    corpus = tmp_path / "c.txt"
    corpus.write_text("The quick brown fox jumps over the lazy dog while the cat sleeps. " * 20, encoding="utf-8")
    settings = dict(metrics=("perplexity",), langs=(), wikitext=False, corpora=(str(corpus),), seqlen=32,
                    ppl_windows=2, threads=1)
    ppl = {}
    for name, spec in (("ct", tmp_path / "ct"), ("artifact", art)):
        res = evaluate(str(spec), EvalSettings(**settings), json_path=tmp_path / f"{name}.json")
        ppl[name] = res["metrics"]["perplexity"]["c.txt"]["perplexity"]
        assert res["runtime"] == "torch", res.get("runtime")
    # transformers 5.21+ decodes the weights in the scales' dtype (fp16: each weight within 2^-11 relative of
    # the artifact's, check_round_trip); 5.17-5.20 in fp32, bit for bit
    from slmedge.models.artifact_weights import load_model

    name = next(iter(Artifact.open(art).manifest["layers"]))
    exact = torch.equal(transformers_model(tmp_path / "ct").get_submodule(name).weight.float(),
                        load_model(art).get_submodule(name).weight)
    assert ppl["ct"] == pytest.approx(ppl["artifact"], rel=1e-5 if exact else 2e-4)
    from slmedge.models.streamed import streamable

    assert not streamable(tmp_path / "ct")  # packed weights: transformers decodes them
