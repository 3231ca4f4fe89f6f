"""Evaluation on tiny models: the three runtimes agree, task scoring is lm-eval's, stores keep results."""

import json
import math
import sqlite3
import sys
from pathlib import Path


import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from typer.testing import CliRunner

from conftest import one_line_error, require_import
from slmedge.cli import app
from slmedge.errors import DataError, RuntimeNotInstalledError
from slmedge.evaluate.api import EvalSettings, Evaluation
from slmedge.evaluate.fidelity import TokenizerMismatchError, fidelity
from slmedge.evaluate.perplexity import rolling_windows, runtime_perplexity
from slmedge.evaluate.store import ResultsStore, ResultsStoreError
from slmedge.evaluate.subject import open_subject
from slmedge.evaluate.tasks import encode_pair, load_task, run_task
from slmedge.evaluate.tokens import HFEncoder
from slmedge.export.gguf import export_gguf
from slmedge.export.onnx import export_onnx
from slmedge.runtimes import TorchRuntime

runner = CliRunner()
LM_EVAL_MISSING = "lm_eval is not installed (pip install -e '.[bench]'; scripts/setup.sh installs it)"
TEXT = ("Zürich's café served naïve crème brûlée; 東京 and भारत appear too. " * 30
        + "The quick brown fox jumps over the lazy dog. " * 40)


def test_three_runtimes_give_the_same_perplexity_on_an_f32_export(exports, tmp_path):
    text_file = tmp_path / "t.txt"
    text_file.write_text(TEXT, encoding="utf-8")
    out = {}
    for rt, spec in exports.items():
        sub = open_subject(spec)
        assert sub.runtime.name == rt
        res, _ = runtime_perplexity(sub.runtime, sub.encoder, TEXT, seqlen=64, max_windows=5)
        out[rt] = res
        sub.close()
    ref = out["torch"]
    for rt, res in out.items():
        assert res.tokens == ref.tokens and res.bytes == ref.bytes, rt  # same ids, same bytes
        assert abs(res.perplexity / ref.perplexity - 1) < 1e-4, (rt, res.perplexity, ref.perplexity)


def test_bits_per_byte_counts_utf8_bytes(tiny_models):
    tok = AutoTokenizer.from_pretrained(tiny_models("llama"))
    enc = HFEncoder(tok)
    ids, ends = enc.encode_with_bytes(TEXT)
    # the whole text's bytes, cumulatively, at the last token
    assert ends[-1] == len(TEXT.encode("utf-8")) > len(TEXT)
    rt = TorchRuntime(AutoModelForCausalLM.from_pretrained(tiny_models("llama")))
    res, _ = runtime_perplexity(rt, enc, TEXT, seqlen=len(ids))  # one window: every token but the first
    assert res.bytes == len(TEXT.encode("utf-8")) - ends[0]
    assert math.isclose(res.bits_per_byte, res.nll * res.tokens / math.log(2) / res.bytes, rel_tol=1e-9)


def test_strided_windows_score_every_token_once():
    wins = rolling_windows(1000, 256, 128)
    scored = [t for _, stop, first in wins for t in range(first, stop)]
    assert scored == list(range(1, wins[-1][1]))  # each predicted once, in order
    assert all(stop - start == 256 for start, stop, _ in wins)
    with pytest.raises(DataError, match="shorter than one window"):
        rolling_windows(100, 256)


def test_a_bos_tokenizers_windows_start_with_bos_and_score_every_text_token(tiny_models):
    # As llama-perplexity and lm-eval score a model whose tokenizer adds BOS: each window is BOS and
    # seqlen - 1 tokens of text, every text token scored once (the first from BOS alone).
    sys.path.insert(0, str(Path(__file__).parent))
    from tiny import bos_led_nll, bos_tokenizer

    for stride in (None, 63, 64, 40):  # a stride is at most the text a window holds
        wins = rolling_windows(1000, 64, stride, lead=1)
        scored = [t for _, stop, first in wins for t in range(first, stop)]
        assert scored == list(range(0, wins[-1][1])) and all(stop - start == 63 for start, stop, _ in wins)
    assert rolling_windows(1000, 64, 64, lead=1) == rolling_windows(1000, 64, None, lead=1)
    enc = HFEncoder(bos_tokenizer())
    assert enc.adds_bos and not HFEncoder(AutoTokenizer.from_pretrained(tiny_models("llama"))).adds_bos
    model = AutoModelForCausalLM.from_pretrained(tiny_models("llama"))
    res, kept = runtime_perplexity(TorchRuntime(model), enc, TEXT, seqlen=64, max_windows=3)
    ids, ends = enc.encode_with_bytes(TEXT)
    total = bos_led_nll(model, enc.bos_id, ids, 63, 3)
    assert res.tokens == 3 * 63 and res.windows == 3 and all(w[0] == enc.bos_id and k == 1 for w, k in kept)
    assert math.isclose(res.nll, total / (3 * 63), rel_tol=1e-5)
    assert res.bytes == int(ends[3 * 63 - 1])  # from the text's first byte: its first token is scored too

    seen = []

    class Recording(TorchRuntime):
        def sequence_outputs(self, seqs, hidden=False):
            seen.extend(list(s) for s in seqs)
            return super().sequence_outputs(seqs, hidden)

    other = AutoModelForCausalLM.from_pretrained(tiny_models("llama"))
    with torch.no_grad():
        other.lm_head.weight.mul_(1.1)
    stats = fidelity((Recording(other), enc), (Recording(model), enc), TEXT, seqlen=64, max_windows=2,
                     reference_id="bos-led-windows")
    assert stats["tokens"] == 2 * 63 and stats["windows"] == 2 and stats["kl_mean"] > 0
    windows = [s for s in seen if len(s) > 2]  # (the two-token probes ask whether hidden states are given)
    assert [w for w in windows] == [[enc.bos_id] + ids[i * 63 : (i + 1) * 63] for i in (0, 1)] * 2


def _write_tasks(tmp_path):
    mc = tmp_path / "mc.jsonl"
    mc.write_text(json.dumps({"query": "The sky is", "choices": ["blue", "green grass", "a"], "gold": 0}) + "\n",
                  encoding="utf-8")
    schema = tmp_path / "schema.jsonl"
    schema.write_text(json.dumps({"context_options": ["The cat sat on the mat because", "The dog sat on the mat because"],
                                  "continuation": "it was tired.", "gold": 1}) + "\n", encoding="utf-8")
    return mc, schema


def test_task_scoring_matches_a_hand_computed_example(tiny_models, tmp_path):
    mc, schema = _write_tasks(tmp_path)
    folder = tiny_models("llama")
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()

    def ll(context, continuation):  # by hand: one unbatched forward of context + continuation
        ctx = tok(context, add_special_tokens=False)["input_ids"]
        whole = tok(context + continuation, add_special_tokens=False)["input_ids"]
        cont = whole[len(ctx):]
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([ctx + cont])).logits[0].double(), -1)
        return sum(float(logp[len(ctx) - 1 + i, t]) for i, t in enumerate(cont))

    rt = TorchRuntime(model)
    enc = HFEncoder(tok)
    summary, scores = run_task(rt, enc, str(mc))
    expected = [ll("The sky is", " " + c) for c in ["blue", "green grass", "a"]]
    assert np.allclose(scores[0].loglikelihoods, expected, atol=1e-4)
    assert scores[0].pred == int(np.argmax(expected))
    assert scores[0].pred_norm == int(np.argmax([e / n for e, n in zip(expected, [4, 11, 1])]))
    assert summary["acc"] == float(scores[0].pred == 0) and summary["n"] == 1
    summary, scores = run_task(rt, enc, str(schema))
    expected = [ll(c, " it was tired.") for c in ["The cat sat on the mat because", "The dog sat on the mat because"]]
    assert np.allclose(scores[0].loglikelihoods, expected, atol=1e-4)
    assert "acc_norm" not in summary
    # The same items in llama.cpp give the same log-likelihoods (prefix reuse included).
    gguf = tmp_path / "m.gguf"
    export_gguf(folder, gguf, "f32")
    sub = open_subject(str(gguf))
    _, cpp = run_task(sub.runtime, sub.encoder, str(mc))
    sub.close()
    _, ref = run_task(rt, enc, str(mc))
    assert np.allclose(cpp[0].loglikelihoods, ref[0].loglikelihoods, atol=2e-3)


def test_encode_pair_moves_trailing_spaces_like_lm_eval(tiny_models):
    enc = HFEncoder(AutoTokenizer.from_pretrained(tiny_models("llama")))
    ctx, cont = encode_pair(enc, "Question: why? ", "Answer")
    assert ctx == enc.encode("Question: why?")
    assert ctx + cont == enc.encode("Question: why? Answer")
    ctx, cont = encode_pair(enc, "", "hello")
    assert ctx == [enc.eos_id] and cont == enc.encode("hello")


def test_real_task_files_in_both_schemas_load():
    assert len(load_task("winogrande", limit=5)) == 5
    arc = load_task("arc_easy", limit=3)
    assert arc[0].norm_lengths is not None and len(arc[0].continuations) == len(arc[0].contexts)
    assert len(load_task("xcopa_th", limit=2)[0].continuations) == 2


def test_kl_of_a_model_against_itself_is_zero(tiny_models):
    folder = tiny_models("qwen2")
    sub = open_subject(folder)
    ref = open_subject(folder)
    stats = fidelity((sub.runtime, sub.encoder), (ref.runtime, ref.encoder), TEXT, seqlen=64, max_windows=2,
                     reference_id="self-test")
    assert stats["kl_mean"] < 1e-6 and stats["kl_p99"] < 1e-6 and stats["top1_agreement"] == 1.0
    assert stats["rms_delta_p"] < 1e-6 and stats["hidden_snr_db"] > 100
    again = fidelity((sub.runtime, sub.encoder), (ref.runtime, ref.encoder), TEXT, seqlen=64, max_windows=2,
                     reference_id="self-test")
    assert again["reference_cached"] and again["kl_mean"] < 1e-6


def test_reference_with_a_different_tokenizer_is_refused(tiny_models, tmp_path):
    from tiny import save_tiny
    from transformers import PreTrainedTokenizerFast

    other = save_tiny("llama", tmp_path / "other", seed=3)
    tok = PreTrainedTokenizerFast.from_pretrained(other)
    vocab = tok.get_vocab()
    # A tokenizer with two ids swapped: same strings, different ids.
    data = json.loads((other / "tokenizer.json").read_text())
    v = data["model"]["vocab"]
    a, b = "e", "t"  # byte-level alphabet entries every English text uses
    assert a in vocab and b in vocab
    v[a], v[b] = v[b], v[a]
    (other / "tokenizer.json").write_text(json.dumps(data))
    sub, ref = open_subject(tiny_models("llama")), open_subject(str(other))
    with pytest.raises(TokenizerMismatchError, match="different"):
        fidelity((sub.runtime, sub.encoder), (ref.runtime, ref.encoder), TEXT, seqlen=64,
                 max_windows=1)


def test_results_go_to_store_and_json_and_survive_an_interrupt(tiny_models, tmp_path, monkeypatch):
    db = tmp_path / "r.sqlite"
    text = tmp_path / "c.txt"
    text.write_text(TEXT, encoding="utf-8")
    settings = EvalSettings(metrics=("perplexity", "tasks"), langs=(), wikitext=False, corpora=(str(text),),
                            seqlen=64, ppl_windows=2, tasks=(str(_write_tasks(tmp_path)[0]),))
    store = ResultsStore(db)
    ev = Evaluation(tiny_models("llama"), settings, store, tmp_path / "out.json")

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr("slmedge.evaluate.tasks.run_task", boom)
    with pytest.raises(KeyboardInterrupt):
        ev.run()
    rows = store.rows(ev.run_id)
    assert {r["metric"] for r in rows} == {"perplexity", "bits_per_byte"}  # what finished is kept
    assert rows[0]["runtime"] == "torch" and rows[0]["target"] == "cpu" and rows[0]["artifact_sha256"]
    saved = json.loads((tmp_path / "out.json").read_text())
    assert "c.txt" in saved["metrics"]["perplexity"] and "versions" in saved
    assert (saved["status"], saved["error"]) == ("failed", "interrupted")  # not a result: what finished before
    store.close()
    with sqlite3.connect(db) as con:
        names = [r[0] for r in con.execute("SELECT name FROM migrations")]
        assert names == ["0001_runs_and_results", "0002_study_jobs", "0003_study_jobs_in_grid", "0004_run_status",
                         "0005_study_job_facts"]
        status, error = con.execute("SELECT status, error FROM runs WHERE id = ?", (ev.run_id,)).fetchone()
        assert (status, error) == ("failed", "interrupted")  # kept, and not taken for a finished run
        con.execute("INSERT INTO migrations VALUES ('9999_from_the_future', 'x')")
    with pytest.raises(ResultsStoreError, match="newer slmedge"):
        ResultsStore(db)


def test_cli_evaluate_writes_json(exports, tmp_path):
    out = tmp_path / "r.json"
    r = runner.invoke(app, ["evaluate", exports["onnxruntime"], "--metrics", "perplexity,memory,latency", "--langs",
                            "en", "--no-wikitext", "--seqlen", "64", "--ppl-windows", "2", "--pp", "16", "--tg", "4",
                            "--repeats", "1", "--json", str(out), "--results-db", str(tmp_path / "db.sqlite")])
    assert r.exit_code == 0, r.output
    res = json.loads(out.read_text())
    assert res["runtime"] == "onnxruntime" and res["metrics"]["perplexity"]["en"]["tokens"] == 126
    assert res["metrics"]["memory"]["peak_rss_bytes"] > 0 and res["metrics"]["memory"]["kv_cache_bytes"] > 0
    assert res["metrics"]["latency"]["decode_tps"]["median"] > 0


# --- bad input ------------------------------------------------------------------------------------




@pytest.mark.parametrize("args,words", [
    (["--langs", "xx"], ["unknown language 'xx'"]),
    (["--tasks", "arc_hard"], ["unknown task 'arc_hard'"]),
    (["--metrics", "speed"], ["unknown metric 'speed'"]),
    (["--runtime", "tflite"], ["unknown runtime 'tflite'"]),
    (["--target", "mars"], ["unknown target 'mars'"]),
])
def test_bad_settings_are_one_clear_error(args, words, exports, tmp_path):
    r = runner.invoke(app, ["evaluate", exports["torch"], *args, "--results-db", str(tmp_path / "db.sqlite")])
    one_line_error(r, *words)


def test_corpus_shorter_than_a_window(exports, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("just a few words", encoding="utf-8")
    r = runner.invoke(app, ["evaluate", exports["torch"], "--metrics", "perplexity", "--langs", "", "--no-wikitext",
                            "--corpus", str(short), "--results-db", str(tmp_path / "db.sqlite")])
    one_line_error(r, "shorter than one window")


def test_corrupt_gguf_and_onnx_without_kv_cache(tmp_path):
    from onnx import TensorProto, helper, save_model

    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\x00" * 64)
    r = runner.invoke(app, ["evaluate", str(bad), "--metrics", "perplexity", "--results-db", str(tmp_path / "db")])
    one_line_error(r, "not a valid GGUF")
    folder = tmp_path / "nokv"
    folder.mkdir()
    x = helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, None])
    y = helper.make_tensor_value_info("logits", TensorProto.INT64, [1, None])
    graph = helper.make_graph([helper.make_node("Identity", ["input_ids"], ["logits"])], "g", [x], [y])
    save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(folder / "model.onnx"))
    r = runner.invoke(app, ["evaluate", str(folder), "--metrics", "perplexity", "--results-db", str(tmp_path / "db")])
    one_line_error(r, "no KV cache")


def test_runtime_not_installed_gives_the_install_hint(exports, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import fails as if not installed
    r = runner.invoke(app, ["evaluate", exports["onnxruntime"], "--metrics", "perplexity",
                            "--results-db", str(tmp_path / "db")])
    one_line_error(r, "onnxruntime is not installed", "pip install onnxruntime")
    with pytest.raises(RuntimeNotInstalledError):
        open_subject(exports["onnxruntime"])


def test_lm_eval_scores_our_task_files_like_slmedge_through_both_model_classes(tiny_models, tmp_path):
    lm_eval = require_import("lm_eval", LM_EVAL_MISSING)
    from lm_eval.tasks import TaskManager

    import slmedge.lm_eval_model  # noqa: F401 - registers --model slmedge
    from slmedge.evaluate.tasks import write_lm_eval_tasks

    items = [{"query": f"Item {i}: the colour of the sky is", "choices": ["blue", "green", "a red brick wall"],
              "gold": i % 3} for i in range(6)]
    mc = tmp_path / "mc.jsonl"
    mc.write_text("\n".join(json.dumps(x) for x in items) + "\n", encoding="utf-8")
    schema = tmp_path / "wino.jsonl"
    schema.write_text("\n".join(json.dumps({"context_options": [f"Anna {i} helped Bea because", f"Bea {i} helped Anna because"],
                                            "continuation": "she was kind.", "gold": i % 2}) for i in range(4)) + "\n",
                      encoding="utf-8")
    names = write_lm_eval_tasks(tmp_path / "yaml", [str(mc), str(schema)])
    folder = tiny_models("llama")
    ours = {}
    sub = open_subject(folder)
    for f in (mc, schema):
        ours[f"slmedge_{f.stem}"], _ = run_task(sub.runtime, sub.encoder, str(f))
    tm = TaskManager(include_path=str(tmp_path / "yaml"))
    for model, args in (("hf", f"pretrained={folder},dtype=float32,device=cpu"), ("slmedge", f"model={folder}")):
        out = lm_eval.simple_evaluate(model=model, model_args=args, tasks=names, batch_size=1, task_manager=tm)
        for name in names:
            r = out["results"][name]
            assert r["acc,none"] == pytest.approx(ours[name]["acc"]), (model, name)
            if "acc_norm" in ours[name]:
                assert r["acc_norm,none"] == pytest.approx(ours[name]["acc_norm"]), (model, name)


def test_task_groups_expand():
    s = EvalSettings(tasks=("english", "xcopa")).validate()
    assert len(s.task_list()) == 8 + 11 and s.task_list()[0] == "arc_easy" and s.task_list()[-1] == "xcopa_zh"
    assert EvalSettings(langs=("en", "th")).task_list()[-1] == "xcopa_th"


def test_lm_eval_command_passes_through_with_slmedge_registered():
    require_import("lm_eval", LM_EVAL_MISSING)
    r = runner.invoke(app, ["lm-eval", "--help"])
    assert r.exit_code == 0 and "--model" in r.output and "--tasks" in r.output


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "phi3", "gemma2", "gemma3_text"])
def test_shared_prefix_scoring_equals_one_sequence_at_a_time(model_type, tiny_models, monkeypatch):
    from slmedge.runtimes import Runtime

    sub = open_subject(tiny_models(model_type))
    ctx, conts = list(range(5, 25)), [[30, 31, 32], [40], [50, 51, 52, 53, 54]]  # longer than Gemma's window 16
    slow = Runtime.continuation_scores(sub.runtime, ctx, conts)  # the generic path: one forward each

    def whole_model(*a, **k):  # the padded fallback; the shared-prefix path runs the decoder and the head
        raise AssertionError("the shared-prefix path fell back to whole-sequence logits")

    monkeypatch.setattr(sub.runtime.model, "forward", whole_model)
    fast = sub.runtime.continuation_scores(ctx, conts)
    for (a, ga), (b, gb) in zip(fast, slow):
        assert np.abs(a - b).max() < 1e-4 and ga == gb


def test_llama_cpp_scores_the_context_without_its_outputs_and_the_same_bits(exports):
    from slmedge.runtimes import Runtime

    sub = open_subject(exports["llama.cpp"])
    llm = sub.runtime.llm
    ctx, conts = list(range(5, 45)), [[30, 31, 32], [40], [50, 51, 52, 53, 54]]
    real = llm._batch.set_batch
    asked = []

    def recording(batch, n_past, logits_all):
        asked.append((len(batch), logits_all))
        return real(batch=batch, n_past=n_past, logits_all=logits_all)

    llm._batch.set_batch = recording
    fast = sub.runtime.continuation_scores(ctx, conts)
    # The context (all but its last token) asks llama.cpp for no outputs; each continuation for all.
    assert asked == [(len(ctx) - 1, False)] + [(len(c), True) for c in conts]
    assert llm._logits_all  # restored for what follows

    def all_outputs(batch, n_past, logits_all):  # the context's outputs computed, as before this change
        return real(batch=batch, n_past=n_past, logits_all=True)

    llm._batch.set_batch = all_outputs
    before = sub.runtime.continuation_scores(ctx, conts)
    llm._batch.set_batch = real
    generic = Runtime.continuation_scores(sub.runtime, ctx, conts)  # one whole sequence each
    for (a, ga), (b, gb), (c, gc) in zip(fast, before, generic):
        assert np.array_equal(a, b) and ga == gb  # same KV cache: the same bits
        assert np.abs(a - c).max() < 1e-4 and ga == gc
    sub.close()


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "phi3", "gemma3_text"])
def test_packed_scoring_across_contexts_equals_one_group_at_a_time(model_type, tiny_models, tmp_path):
    from slmedge.runtimes import Runtime

    groups = [(list(range(5, 25)), [[30, 31, 32], [40], [50, 51, 52, 53, 54]]),
              ([7], [[8, 9]]),  # a one-token context
              (list(range(60, 66)), [[70, 71], [72]]),
              (list(range(100, 140)), [[3] * 7]),
              (list(range(80, 84)), [[85], [86, 87]]),  # short: packed together even within Gemma's window 16
              (list(range(90, 93)), [[94, 95, 96]])]
    sub = open_subject(tiny_models(model_type))
    packs = []
    real = sub.runtime._packed_scores
    sub.runtime._packed_scores = lambda gs: packs.append(len(gs)) or real(gs)
    subjects = [sub]
    if model_type in ("llama", "qwen3"):
        export_onnx(tiny_models(model_type), tmp_path / "onnx", "fp32", verify=False)
        subjects.append(open_subject(str(tmp_path / "onnx")))
    for s in subjects:
        s.runtime.pack_tokens = 64  # several packed batches
        packed = s.runtime.score_groups(groups)
        for (ctx, conts), got in zip(groups, packed):
            want = Runtime.continuation_scores(s.runtime, ctx, conts)
            assert len(got) == len(conts)
            for (a, ga), (b, gb), c in zip(got, want, conts):
                assert a.shape == (len(c),) and np.abs(a - b).max() < 1e-4 and ga == gb
        s.close()
    assert max(packs) >= 2  # contexts were packed together (for Gemma: only those that fit its window)


def test_a_cache_that_cannot_share_prefixes_falls_back_once_and_says_so(tiny_models, monkeypatch):
    import warnings

    from transformers import DynamicCache

    from slmedge.runtimes import Runtime

    def no_selection(self, indices):
        raise NotImplementedError("no batch selection in this cache")

    monkeypatch.setattr(DynamicCache, "batch_select_indices", no_selection)
    sub = open_subject(tiny_models("llama"))
    groups = [(list(range(5, 25)), [[30, 31, 32], [40]]), (list(range(60, 66)), [[70, 71], [72]])]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = sub.runtime.score_groups(groups) + [sub.runtime.continuation_scores(*groups[0])]
    said = [w for w in caught if "shared-prefix scoring failed" in str(w.message)]
    assert len(said) == 1 and "NotImplementedError" in str(said[0].message) and not sub.runtime.packing
    for (ctx, conts), scores in zip(groups + groups[:1], got):
        for (a, ga), (b, gb) in zip(scores, Runtime.continuation_scores(sub.runtime, ctx, conts)):
            assert np.abs(a - b).max() < 1e-4 and ga == gb


def test_token_scores_in_torch_and_in_numpy_agree():
    from slmedge.runtimes import _token_scores

    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((7, 5000)) * 10).astype(np.float32)
    targets = rng.integers(0, 5000, 7)
    x = logits.astype(np.float64)
    want = x[np.arange(7), targets] - np.log(np.exp(x).sum(-1))
    in_torch, greedy = _token_scores(logits, targets, in_torch=True)  # the torch runtime's
    in_numpy, greedy2 = _token_scores(logits, targets)  # the other runtimes' (targets may lack torch)
    assert in_torch.dtype == in_numpy.dtype == np.float64
    assert np.abs(in_torch - want).max() < 1e-9
    # numpy's exponentials are taken in float32 (summed in float64): each within ~1e-7 relative
    assert np.abs(in_numpy - want).max() < 1e-7
    assert greedy is greedy2 is False
    assert _token_scores(logits, logits.argmax(-1))[1] is True


def test_task_flips_count_the_answers_of_the_metric_asked_for():
    from slmedge.evaluate.fidelity import task_flips
    from slmedge.evaluate.tasks import ItemScore

    # Four items: acc's answer (pred) changes on item 0 only, acc_norm's (pred_norm) on items 1 and 2.
    ref = [ItemScore([0.0, -1.0], 0, 0, 0), ItemScore([0.0, -1.0], 0, 0, 0), ItemScore([0.0, -1.0], 0, 1, 0),
           ItemScore([0.0, -1.0], 1, 1, 1)]
    cand = [ItemScore([-1.0, 0.0], 1, 0, 0), ItemScore([0.0, -1.0], 0, 1, 0), ItemScore([0.0, -1.0], 0, 0, 0),
            ItemScore([0.0, -1.0], 1, 1, 1)]
    assert task_flips(cand, ref) == 0.25
    assert task_flips(cand, ref, norm=True) == 0.5


def test_a_user_task_file_is_labelled_by_its_stem_with_flips_per_metric(tiny_models, tmp_path):
    deep = tmp_path / "a-rather-long-folder-name" / "and-another-one"
    deep.mkdir(parents=True)
    f = deep / "belebele_mini.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in [
        {"query": "The sky is", "choices": ["blue", "green grass", "a"], "gold": 0},
        {"query": "Two and two make", "choices": ["four", "seven", "many fish"], "gold": 0}]), encoding="utf-8")
    model = str(tiny_models("llama"))
    r = runner.invoke(app, ["evaluate", model, "--metrics", "tasks,fidelity", "--tasks", str(f), "--reference", model,
                            "--json", str(tmp_path / "r.json"), "--results-db", str(tmp_path / "db.sqlite"),
                            "--no-wikitext", "--langs", "en", "--seqlen", "32"], env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    tasks = json.loads((tmp_path / "r.json").read_text())["metrics"]["tasks"]
    assert list(tasks) == ["belebele_mini"]
    assert tasks["belebele_mini"]["flips_vs_reference"] == 0 and tasks["belebele_mini"]["flips_norm_vs_reference"] == 0
    assert "belebele_mini" in r.output and "a-rather-long" not in r.output and "0 of 2 (0.0%) / 0 of 2" in r.output
    g = tmp_path / "other" / "belebele_mini.jsonl"
    g.parent.mkdir()
    g.write_text(f.read_text())
    r = runner.invoke(app, ["evaluate", model, "--metrics", "tasks", "--tasks", f"{f},{g}",
                            "--results-db", str(tmp_path / "db.sqlite")])
    one_line_error(r, "both be shown as 'belebele_mini'")
