"""The seed study's model shapes (slmedge/data/shapes): each parses, has the parameter count its
model publishes, is indexed with its sha256, source and licence, ships in the package; and
scripts/make_random_model.py builds loadable bf16 models of them without an fp32 copy."""

import fnmatch
import hashlib
import importlib.util
import json
import tomllib
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
SHAPES = REPO / "slmedge" / "data" / "shapes"
INDEX = json.loads((SHAPES / "shapes.json").read_text())["shapes"]
SEED = {"Qwen2.5-0.5B-Instruct": 0.49e9, "Qwen2.5-1.5B-Instruct": 1.54e9, "Llama-3.2-1B-Instruct": 1.24e9,
        "DeepSeek-R1-Distill-Qwen-1.5B": 1.78e9, "SmolLM2-1.7B-Instruct": 1.71e9, "Phi-3.5-mini-instruct": 3.82e9}


@pytest.fixture(scope="module")
def script():
    """The script as a module, its tokenizer source (the embedded SmolLM2's cached conversion,
    checked once here) resolved once for the module's tests."""
    module = _script()
    folder = module.smollm2_tokenizer_dir()
    module.smollm2_tokenizer_dir = lambda: folder
    return module


def _script():
    spec = importlib.util.spec_from_file_location("make_random_model", REPO / "scripts" / "make_random_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _meta_count(config) -> int:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return sum(p.numel() for p in model.parameters())  # tied weights once


def test_the_six_shapes_are_shipped_indexed_and_packaged():
    on_disk = {p.parent.name for p in SHAPES.glob("*/config.json")}
    assert on_disk == set(INDEX) == set(SEED)
    readme = (SHAPES / "README.md").read_text()
    for name, rec in INDEX.items():
        assert rec["licence"] and rec["model"] and rec["changes"] and (rec["source"].get("repository") or
                                                                       rec["source"].get("page")), name
        if "repository" in rec["source"]:
            assert len(rec["source"]["commit"]) == 40, name
        for rel, f in rec["files"].items():
            data = (SHAPES / rel).read_bytes()
            assert hashlib.sha256(data).hexdigest() == f["sha256"] and len(data) == f["bytes"], rel
        assert name in readme and f"{rec['parameters']:,}" in readme and rec["licence"] in readme
    globs = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["slmedge.data"]
    for p in SHAPES.rglob("*"):
        if p.is_file() and "__pycache__" not in p.parts:
            rel = p.relative_to(SHAPES.parent).as_posix()
            assert any(fnmatch.fnmatch(rel, g) for g in globs), f"{rel} is not in the package data"


@pytest.mark.parametrize("name", sorted(SEED))
def test_each_shape_parses_and_has_its_published_parameter_count(name):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(SHAPES / name)
    raw = json.loads((SHAPES / name / "config.json").read_text())
    assert raw["torch_dtype"] == "bfloat16" and "auto_map" not in raw
    assert config.model_type == raw["model_type"] and config.architectures == raw["architectures"]
    count = _meta_count(config)
    assert count == INDEX[name]["parameters"]
    assert INDEX[name]["published_parameters"] == SEED[name]
    assert abs(count - SEED[name]) / SEED[name] < 0.01, (name, count)


def test_the_script_refuses_bad_settings_and_foreign_folders(tmp_path, capsys):
    mod = _script()  # refuses before it looks for the tokenizer
    assert mod.main(["Qwen9-0.1B", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "unknown shape 'Qwen9-0.1B'" in err and all(s in err for s in SEED)
    assert mod.main(["Qwen2.5-0.5B-Instruct", str(tmp_path / "x"), "--layers", "25"]) == 2
    assert "between 1 and 24" in capsys.readouterr().err
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("not the script's")
    assert mod.main(["Qwen2.5-0.5B-Instruct", str(foreign), "--layers", "1"]) == 1
    assert "--overwrite" in capsys.readouterr().err
    assert mod.main(["Qwen2.5-0.5B-Instruct", str(foreign), "--layers", "1", "--overwrite"]) == 1
    assert "not made by this script" in capsys.readouterr().err
    assert (foreign / "keep.txt").read_text() == "not the script's" and not (tmp_path / "x").exists()


def test_the_script_makes_loadable_bf16_models_of_two_shapes(script, tmp_path, capsys):
    """Qwen2.5-0.5B (tied, q/k/v biases, vocabulary larger than the tokenizer's) and Phi-3.5-mini
    (fused projections, untied, LongRoPE, vocabulary smaller: the tokenizer is cut), 2 layers each."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    mod = script
    for name, shard in (("Qwen2.5-0.5B-Instruct", "5GB"), ("Phi-3.5-mini-instruct", "400MB")):
        out = tmp_path / name
        assert mod.main([name, str(out), "--layers", "2", "--max-shard-size", shard]) == 0, capsys.readouterr().err
        record = json.loads((out / mod.MARKER).read_text())
        assert record["shape"] == name and record["layers"] == 2 and record["dtype"] == "bfloat16"
        files = sorted(out.glob("*.safetensors"))
        assert [f.name for f in files] == record["files"]
        for f in files:
            with safe_open(str(f), "pt") as st:
                assert {st.get_slice(k).get_dtype() for k in st.keys()} == {"BF16"}
        model = AutoModelForCausalLM.from_pretrained(out, dtype="auto")
        tokenizer = AutoTokenizer.from_pretrained(out)
        assert model.config.num_hidden_layers == 2 and {p.dtype for p in model.parameters()} == {torch.bfloat16}
        full = json.loads((SHAPES / name / "config.json").read_text())
        assert model.config.vocab_size == full["vocab_size"] and model.config.hidden_size == full["hidden_size"]
        assert sum(p.numel() for p in model.parameters()) == record["parameters"]
        ids = tokenizer("Random weights show memory and time, not quality.", return_tensors="pt").input_ids
        assert int(ids.max()) < model.config.vocab_size
        with torch.no_grad():
            logits = model(ids).logits
        assert logits.shape == (1, ids.shape[1], full["vocab_size"]) and torch.isfinite(logits).all()
    phi = json.loads((tmp_path / "Phi-3.5-mini-instruct" / mod.MARKER).read_text())
    assert phi["tokenizer"]["tokens"] == 32064 and len(phi["files"]) > 1
    qwen = json.loads((tmp_path / "Qwen2.5-0.5B-Instruct" / mod.MARKER).read_text())
    assert qwen["tokenizer"]["unused_rows"] == 151936 - 49152 and qwen["files"] == ["model.safetensors"]
    # Each tensor is drawn from the seed and its name: the same seed gives the same bytes.
    out = tmp_path / "Qwen2.5-0.5B-Instruct"
    name = "model.layers.1.self_attn.k_proj.weight"
    with safe_open(str(out / "model.safetensors"), "pt") as st:
        written = st.get_tensor(name)
    assert torch.equal(written, mod.make_tensor(name, tuple(written.shape), "normal", torch.bfloat16, 0, 0.02))
    assert not torch.equal(written, mod.make_tensor(name, tuple(written.shape), "normal", torch.bfloat16, 1, 0.02))
    # --overwrite replaces a folder the script made.
    assert mod.main(["Qwen2.5-0.5B-Instruct", str(out), "--layers", "1", "--seed", "1", "--overwrite"]) == 0
    assert json.loads((out / mod.MARKER).read_text())["layers"] == 1
