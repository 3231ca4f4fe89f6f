"""onnxruntime-genai: the export folder genai opens and generates with, and the runtime that
scores and times it (here, under qemu on arm64, and over ssh)."""

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import missing_prerequisite, one_line_error, require_import
from typer.testing import CliRunner

from slmedge.cli import app
from slmedge.errors import RuntimeNotInstalledError
from slmedge.evaluate.api import EvalSettings, evaluate
from slmedge.evaluate.subject import open_subject
from slmedge.export import ort_genai
from slmedge.export.formats import format_for_path, get_format
from slmedge.export.onnx import export_onnx
from slmedge.export.ort_genai import GenaiVerificationError, export_genai
from slmedge.fsutil import sha256_file
from test_targets import _ssh_profile, sshd  # noqa: F401  (sshd: the fixture, a real sshd on 127.0.0.1)

runner = CliRunner()
PROBE = [1, 17, 42, 99, 5, 250, 3, 77, 123, 64]
TEXT = "The quick brown fox jumps over the lazy dog while the cat sleeps in the sun. " * 12


@pytest.fixture(scope="module")
def og():
    return require_import("onnxruntime_genai", "onnxruntime-genai is not installed (pip install 'slmedge[genai]')")


@pytest.fixture(scope="module")
def genai_dirs(og, tiny_models, artifacts, tmp_path_factory):
    """The tiny llama as an fp32 genai folder and a GPTQ W4 g32 artifact as an int4 one (MatMulNBits
    in fp32 arithmetic, so torch's greedy tokens on the dequantized weights are the reference)."""
    root = tmp_path_factory.mktemp("genai")
    fp32 = root / "fp32"
    res = runner.invoke(app, ["export", str(tiny_models("llama")), "--format", "onnxruntime-genai", "--type", "fp32",
                              "-o", str(fp32)])
    assert res.exit_code == 0, res.output
    art = artifacts("llama", "gptq", bits=4, group_size=32, symmetric=True)
    int4 = root / "int4"
    export_genai(art, int4, "int4", exact=True, accuracy_level=0)
    return {"fp32": (fp32, tiny_models("llama")), "int4": (int4, art)}


def _genai_greedy(og, folder: Path, ids: list[int], n: int) -> list[int]:
    """Greedy tokens from onnxruntime-genai's own API (nothing of slmedge's runtime)."""
    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(ids) + n, min_length=len(ids) + n, do_sample=False)
    gen = og.Generator(model, params)
    gen.append_tokens(ids)
    while not gen.is_done():
        gen.generate_next_token()
    return [int(t) for t in gen.get_sequence(0)][len(ids):]


def _torch_greedy(source: Path, ids: list[int], n: int) -> list[int]:
    from slmedge.export.verify import torch_model

    model = torch_model(Path(source), torch.float32).eval()
    seq = list(ids)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids):]


@pytest.mark.parametrize("kind", ["fp32", "int4"])
def test_the_folder_generates_torchs_greedy_tokens(kind, og, genai_dirs):
    folder, source = genai_dirs[kind]
    n = 12
    assert _genai_greedy(og, folder, PROBE, n) == _torch_greedy(source, PROBE, n)
    # What genai reads: the optimum graph's names, the KV cache not shared with a max-length buffer.
    cfg = json.loads((folder / "genai_config.json").read_text())
    dec = cfg["model"]["decoder"]
    assert dec["inputs"]["past_key_names"] == "past_key_values.%d.key"
    assert dec["outputs"]["present_value_names"] == "present.%d.value"
    assert dec["num_hidden_layers"] == 2 and dec["head_size"] == 16 and cfg["model"]["type"] == "llama"
    assert cfg["search"]["past_present_share_buffer"] is False
    for f in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        assert (folder / f).is_file()
    # the manifest covers every file, and the export's own check ran in genai's loop
    manifest = get_format("onnxruntime-genai").checked_manifest(folder)
    assert set(manifest["files"]) == {p.name for p in folder.iterdir()} - {"slmedge-export.json"}
    greedy = manifest["verification"]["greedy"]
    assert greedy["genai_tokens"] == greedy["onnxruntime_tokens"] == greedy["torch_tokens"]
    assert format_for_path(folder) == "onnxruntime-genai" and format_for_path(folder / "model.onnx") == "onnx"
    if kind == "int4":
        assert manifest["exact"] and manifest["ops"].get("MatMulNBits") == 15  # 14 coded linears + the 8-bit head


def test_the_decoder_is_the_onnx_exports_file(og, genai_dirs, artifacts, tmp_path):
    folder, art = genai_dirs["int4"]
    export_onnx(art, tmp_path / "onnx", "int4", exact=True, accuracy_level=0)
    assert sha256_file(folder / "model.onnx") == sha256_file(tmp_path / "onnx" / "model.onnx")


def _settings(tmp_path, **kw):
    corpus = tmp_path / "c.txt"
    corpus.write_text(TEXT, encoding="utf-8")
    task = tmp_path / "mini.jsonl"
    rows = [{"query": "The sky is", "choices": ["blue", "green grass", "a"], "gold": 0},
            {"query": "Two and two make", "choices": ["four", "seven", "many fish"], "gold": 0}]
    task.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    base = dict(metrics=("perplexity", "tasks", "latency"), langs=(), wikitext=False, corpora=(str(corpus),),
                seqlen=32, ppl_windows=2, tasks=(str(task),), pp=16, tg=4, repeats=1, context=64, threads=1)
    base.update(kw)
    return EvalSettings(**base)


def _same_scores(a: dict, b: dict, rel: float) -> None:
    pa, pb = a["metrics"]["perplexity"]["c.txt"], b["metrics"]["perplexity"]["c.txt"]
    assert pa["tokens"] == pb["tokens"] and pa["perplexity"] == pytest.approx(pb["perplexity"], rel=rel)
    assert [t["acc"] for t in a["metrics"]["tasks"].values()] == [t["acc"] for t in b["metrics"]["tasks"].values()]


@pytest.mark.parametrize("kind", ["fp32", "int4"])
def test_genai_scores_like_onnxruntime_on_the_same_file(kind, og, genai_dirs, tmp_path):
    folder, _ = genai_dirs[kind]
    genai = evaluate(str(folder), _settings(tmp_path, runtime="onnxruntime-genai"))
    ort = evaluate(str(folder / "model.onnx"), _settings(tmp_path, runtime="onnxruntime"))
    assert genai["runtime"] == "onnxruntime-genai" and ort["runtime"] == "onnxruntime"
    assert genai["identity"]["kind"] == "onnxruntime-genai" and genai["identity"]["label"] == folder.name
    _same_scores(genai, ort, 1e-6)
    assert genai["metrics"]["latency"]["decode_tps"]["median"] > 0
    # the folder alone opens in genai (its format's runtime), scored from genai's own logits
    sub = open_subject(str(folder), threads=1)
    try:
        assert sub.runtime.name == "onnxruntime-genai"
        assert sub.runtime.info()["logits_from"].startswith("onnxruntime-genai")
        ids = sub.encoder.encode(TEXT)[:20]
        ref = open_subject(str(folder / "model.onnx"), threads=1)
        try:
            np.testing.assert_allclose(sub.runtime.logits(ids), ref.runtime.logits(ids), atol=1e-5)
        finally:
            ref.close()
        t = sub.runtime.timed_generate(ids[:8], 5)
        assert t.prompt_tokens == 8 and t.generated == 5 and t.decode_tps > 0 and t.ttft_s > 0
    finally:
        sub.close()


def test_an_artifact_evaluated_in_genai_is_exported_for_it(og, artifacts, tmp_path):
    art = artifacts("llama", "gptq", bits=4, group_size=32, symmetric=True)
    res = evaluate(str(art), _settings(tmp_path, runtime="onnxruntime-genai", metrics=("perplexity",)))
    assert res["runtime"] == "onnxruntime-genai" and res["identity"]["kind"] == "onnxruntime-genai"
    assert res["metrics"]["perplexity"]["c.txt"]["perplexity"] > 1
    # the result says where its scores came from, and which genai computed them
    assert res["runtime_info"]["logits_from"].startswith("onnxruntime-genai")
    assert res["versions"]["onnxruntime_genai"] == og.__version__


def test_a_greedy_probe_that_reaches_eos_is_checked_up_to_it(og, tiny_models, tmp_path):
    """genai's search stops at EOS and leaves it out; onnxruntime's loop emits it. The tiny llama's EOS
    is made a token its greedy decode of the probe picks after others (and not before), so the
    decode reaches EOS: the check compares both up to it and keeps the folder."""
    from slmedge.export.verify import probe_text, source_tokenizer, torch_logits

    src = tmp_path / "src"
    shutil.copytree(tiny_models("llama"), src)
    ids = source_tokenizer(src)(probe_text(None), add_special_tokens=True)["input_ids"]
    seq = list(ids)
    for _ in range(ort_genai.GREEDY_TOKENS):
        seq.append(int(torch_logits(src, seq)[-1].argmax()))
    new = seq[len(ids):]
    stop = max(i for i in range(1, len(new)) if new[i] not in new[:i])  # tiny llama: [288, 365, 254, 254, ...]
    for name in ("config.json", "generation_config.json"):
        f = src / name
        if f.is_file():
            cfg = json.loads(f.read_text())
            cfg["eos_token_id"] = new[stop]
            f.write_text(json.dumps(cfg))
    out = tmp_path / "genai"
    report = export_genai(src, out, "fp32")
    greedy = report["verification"]["greedy"]
    assert greedy["ended_at_eos"] and greedy["genai_tokens"] == greedy["onnxruntime_tokens"] == new[:stop]
    assert greedy["torch_tokens"] == new[:stop] and (out / "genai_config.json").is_file()


def test_a_wrong_kv_cache_layout_fails_the_check_and_leaves_nothing(og, tiny_models, tmp_path, monkeypatch):
    real = ort_genai.genai_config

    def swapped(folder, *a, **k):  # keys fed where values go: the prefill is right, every decode step wrong
        cfg = real(folder, *a, **k)
        ins = cfg["model"]["decoder"]["inputs"]
        ins["past_key_names"], ins["past_value_names"] = ins["past_value_names"], ins["past_key_names"]
        return cfg

    monkeypatch.setattr(ort_genai, "genai_config", swapped)
    with pytest.raises(GenaiVerificationError, match="nothing was written"):
        export_genai(tiny_models("llama"), tmp_path / "out", "fp32")
    assert not list(tmp_path.iterdir())


def test_refuses_to_overwrite_what_slmedge_did_not_write(og, tiny_models, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    res = runner.invoke(app, ["export", str(tiny_models("llama")), "--format", "onnxruntime-genai", "-o", str(out),
                              "--overwrite"])
    one_line_error(res, "did not write")
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_missing_genai_is_one_line_with_the_install_command(genai_dirs, tiny_models, tmp_path, monkeypatch):
    folder, _ = genai_dirs["fp32"]
    monkeypatch.setitem(sys.modules, "onnxruntime_genai", None)  # import fails as if not installed
    r = runner.invoke(app, ["evaluate", str(folder), "--metrics", "perplexity", "--results-db", str(tmp_path / "db")])
    one_line_error(r, "onnxruntime-genai is not installed", "pip install 'slmedge[genai]'")
    with pytest.raises(RuntimeNotInstalledError):
        open_subject(str(folder))
    r = runner.invoke(app, ["export", str(tiny_models("llama")), "--format", "onnxruntime-genai", "-o",
                            str(tmp_path / "out")])
    one_line_error(r, "onnxruntime-genai is not installed", "pip install 'slmedge[genai]'")
    assert not (tmp_path / "out").exists()


# --- targets: arm64 under qemu, ssh ---------------------------------------------------------------


def _offer_genai(profile_text: str) -> str:
    """A profile's text with onnxruntime-genai among its runtimes."""
    import re

    def add(m):
        names = json.loads(m.group(1))
        return "runtimes = " + json.dumps(names + [n for n in ["onnxruntime-genai"] if n not in names])

    return re.sub(r"^runtimes = (\[.*\])$", add, profile_text, count=1, flags=re.M)


def test_arm64_emulated_scores_like_native_x86(og, genai_dirs, tmp_path, monkeypatch):
    from slmedge.targets.emulation import env_root
    from slmedge.targets.profiles import get_profile

    f = env_root() / "env.json"
    if not f.is_file():
        missing_prerequisite(f"no arm64 environment in {f.parent}: slmedge targets setup arm64")
    if not (json.loads(f.read_text()).get("versions") or {}).get("onnxruntime-genai"):
        missing_prerequisite("the arm64 environment has no onnxruntime-genai: slmedge targets setup arm64")
    shipped = get_profile("arm64")
    if "onnxruntime-genai" not in shipped.runtimes:  # a user profile of the same name offers it
        monkeypatch.setenv("SLMEDGE_TARGETS", str(tmp_path / "profiles"))
        (tmp_path / "profiles").mkdir()
        (tmp_path / "profiles" / "arm64.toml").write_text(_offer_genai(Path(shipped.file).read_text()))
    folder, _ = genai_dirs["int4"]
    settings = dict(metrics=("perplexity", "tasks", "latency"), ppl_windows=1, pp=8, tg=2)
    native = evaluate(str(folder), _settings(tmp_path, **settings))
    arm = evaluate(str(folder), _settings(tmp_path, target="arm64", **settings))
    assert arm["runtime"] == "onnxruntime-genai" and arm["versions"]["target"]["machine"] == "aarch64"
    assert arm["versions"]["target"]["onnxruntime-genai"] == og.__version__
    _same_scores(arm, native, 1e-3)
    assert arm["metrics"]["latency"]["emulated"] is True


def test_ssh_target_gets_the_folder_and_scores_like_local(og, genai_dirs, sshd, tmp_path, monkeypatch):
    monkeypatch.setenv("SLMEDGE_TARGETS", str(tmp_path / "profiles"))
    work = _ssh_profile(tmp_path / "profiles", sshd)
    prof = tmp_path / "profiles" / "ssh-localhost.toml"
    prof.write_text(_offer_genai(prof.read_text()))
    folder, _ = genai_dirs["fp32"]
    settings = dict(metrics=("perplexity", "tasks", "latency"), ppl_windows=1, pp=8, tg=2)
    local = evaluate(str(folder), _settings(tmp_path, **settings))
    remote = evaluate(str(folder), _settings(tmp_path, target="ssh-localhost", **settings))
    assert remote["runtime"] == "onnxruntime-genai" and remote["target"] == "ssh-localhost"
    _same_scores(remote, local, 1e-6)
    copied = {p.name for p in work.rglob("*") if p.is_file()}
    assert {"genai_config.json", "model.onnx"} <= copied  # what genai opens travelled with the model


def test_an_arm64_environment_that_passed_gets_only_the_missing_wheels(tmp_path):
    """The incremental path of `slmedge targets setup arm64`: a record that passed its check and
    lacks only wheels (a runtime registered since) gets those; anything else is a full setup."""
    from slmedge.targets.emulation import PYTHON, _wanted, _wheels_to_add

    (tmp_path / "sysroot" / "usr" / "bin").mkdir(parents=True)
    (tmp_path / "sysroot" / "usr" / "bin" / PYTHON).touch()
    want = _wanted()
    old = {k: v for k, v in want.items() if k != "onnxruntime-genai"}
    versions = {"machine": "aarch64", "onnxruntime": "1", "llama.cpp": "1"}
    record = {"wanted": old, "versions": versions, "runtimes": ["onnxruntime", "llama.cpp"]}
    assert _wheels_to_add(tmp_path, record) == ["onnxruntime-genai"]
    assert _wheels_to_add(tmp_path, {**record, "runtimes": None}) == ["onnxruntime-genai"]  # from its wanted
    assert _wheels_to_add(tmp_path, {**record, "wanted": want, "versions": {**versions,
                                                                           "onnxruntime-genai": "1"}}) == []
    assert _wheels_to_add(tmp_path, {**record, "wanted": {**old, "llama-cpp-python": "0.0.1"}}) is None  # a rebuild
    assert _wheels_to_add(tmp_path, {**record, "wanted": {**old, "setup_version": -1}}) is None
    assert _wheels_to_add(tmp_path, {**record, "versions": {**versions, "machine": "x86_64"}}) is None  # failed
    assert _wheels_to_add(tmp_path, None) is None
    (tmp_path / "sysroot" / "usr" / "bin" / PYTHON).unlink()
    assert _wheels_to_add(tmp_path, record) is None


def test_torch_is_compared_at_every_position_of_the_sequence_not_on_the_few_generated_tokens(og, genai_dirs,
                                                                                              monkeypatch):
    """A lossy file's greedy tokens can leave torch's on half of the 8 generated ones while its logits agree
    at nearly every position (a correct 4-bit file with 4-bit tables did: 50% of 8): judged over the whole
    sequence with the format's tolerance it passes; logits that are wrong everywhere still fail."""
    from slmedge.export.onnx import TOLERANCES

    folder, src = genai_dirs["int4"]
    real = ort_genai.torch_logits
    n_new = {}

    def top_two_swapped(source, seq):  # torch's two best swapped at half the generated tokens' positions
        ref = np.array(real(source, seq), copy=True)
        for row in ref[-(ort_genai.GREEDY_TOKENS // 2):]:
            a, b = np.argsort(row)[-2:]
            row[a], row[b] = row[b], row[a]
        n_new["positions"] = len(seq)
        return ref

    monkeypatch.setattr(ort_genai, "torch_logits", top_two_swapped)
    greedy = ort_genai.verify_genai(folder, src, TOLERANCES["kept"])
    assert greedy["torch_agreement"] <= 0.5 < TOLERANCES["kept"]["top1"]  # what the old check refused on
    assert greedy["vs_torch"]["positions"] == n_new["positions"] >= 30
    assert greedy["vs_torch"]["top1_agreement"] >= TOLERANCES["kept"]["top1"]

    rng = np.random.default_rng(0)
    monkeypatch.setattr(ort_genai, "torch_logits",
                        lambda source, seq: rng.permutation(np.array(real(source, seq)), axis=1))  # every position wrong
    with pytest.raises(GenaiVerificationError, match="along its greedy sequence differ from torch's"):
        ort_genai.verify_genai(folder, src, TOLERANCES["kept"])
