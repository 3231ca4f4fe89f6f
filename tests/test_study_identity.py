"""A study job is identified by its settings and the content of what it reads: a changed input
reruns exactly the jobs downstream of it, unchanged inputs rerun nothing, and a study that names
something absent is refused before anything runs."""

import json
import shutil
import sqlite3
from pathlib import Path

import pytest
from conftest import one_line_error
from test_study import _InlinePool
from typer.testing import CliRunner

import slmedge.study.engine as engine
import slmedge.study.inputs as inputs
from slmedge.cli import app
from slmedge.evaluate.store import ResultsStore
from slmedge.study.jobs import build_jobs
from slmedge.study.spec import load_study

runner = CliRunner()
TEXT = "The quick brown fox jumps over the lazy dog while the cat sleeps in the sun. " * 12
TASKS = [{"query": "The sky is", "choices": ["blue", "green grass", "a"], "gold": 0},
         {"query": "Two and two make", "choices": ["four", "seven", "many fish"], "gold": 0}]
RTN = 'label = "rtn-w4"\nmethod = "rtn"\nbits = 4\ngroup_size = 32'  # reads no calibration data
WANDA = 'label = "wanda-50"\nmethod = "wanda"\nsparsity = "0.5"'  # calibrates


def _files(root: Path) -> dict:
    """A --data-dir overlay whose English NTREX corpus is ours, a task file, a calibration file."""
    overlay = root / "data"
    (overlay / "perplexity" / "ntrex128").mkdir(parents=True)
    (overlay / "perplexity" / "ntrex128" / "en.txt").write_text(TEXT, encoding="utf-8")
    tasks = root / "mini.jsonl"
    tasks.write_text("".join(json.dumps(r) + "\n" for r in TASKS), encoding="utf-8")
    calib = root / "calib.txt"
    calib.write_text("\n".join(TEXT.split(". ")) * 3, encoding="utf-8")
    return {"overlay": overlay, "tasks": tasks, "calib": calib}


def _study(root: Path, models, files: dict, methods=('method = "none"', RTN, WANDA), exports=('"none"',),
           metrics=("perplexity", "tasks"), name="ident") -> Path:
    text = f'''name = "{name}"
models = {json.dumps([str(m) for m in models])}
seeds = [0]
targets = ["cpu"]
workdir = "work-{name}"

[calibration]
dataset = "{files['calib']}"
nsamples = 4
seqlen = 32
batch_size = 4

[evaluate]
metrics = {json.dumps(list(metrics))}
langs = ["en"]
wikitext = false
seqlen = 32
ppl_windows = 2
tasks = ["{files['tasks']}"]
threads = 1
''' + "".join(f"\n[[methods]]\n{m}\n" for m in methods) + "".join(f"\n[[exports]]\nformat = {e}\n" for e in exports)
    f = root / f"{name}.toml"
    f.write_text(text)
    return f


def _run(f: Path, store, files) -> dict:
    return engine.run_study(load_study(f), store, workers=1, data_dir=str(files["overlay"]))


def _ran(counts: dict) -> dict:
    return {k: n for k, n in counts["ran_by_kind"].items() if n}


def _out_of_grid(store) -> list[tuple[str, int]]:
    with sqlite3.connect(store.path) as con:
        return con.execute("SELECT kind, COUNT(*) FROM study_jobs WHERE in_grid = 0 AND status = 'done' "
                           "GROUP BY kind ORDER BY kind").fetchall()


def _rewrite(path: Path, text: str) -> None:
    """New content (another size, so no (size, mtime) coincidence can hide it)."""
    path.write_text(text, encoding="utf-8")


def test_a_changed_corpus_task_or_calibration_file_reruns_only_the_jobs_that_read_it(tmp_path, tiny_models,
                                                                                     monkeypatch):
    monkeypatch.setattr(engine, "_LocalPool", _InlinePool)
    files = _files(tmp_path)
    f = _study(tmp_path, [tiny_models("llama")], files)
    store = ResultsStore(tmp_path / "s.sqlite")
    first = _run(f, store, files)  # 2 compress (rtn, wanda), 3 evaluations (base, rtn, wanda)
    assert first["failed"] == 0 and _ran(first) == {"compress": 2, "evaluate": 3}
    assert _ran(_run(f, store, files)) == {}  # unchanged inputs: nothing runs again
    assert _out_of_grid(store) == []

    # The perplexity corpus in the --data-dir overlay: the evaluations read it, nothing else does.
    _rewrite(files["overlay"] / "perplexity" / "ntrex128" / "en.txt", TEXT + "A new last sentence. ")
    counts = _run(f, store, files)
    assert _ran(counts) == {"evaluate": 3} and counts["already_done"] == 2
    assert counts["inputs_changed"] == {"evaluate": 3}
    assert _out_of_grid(store) == [("evaluate", 3)]  # the old results stay recorded, out of the grid

    # The task file: again only the evaluations.
    _rewrite(files["tasks"], files["tasks"].read_text() + json.dumps(TASKS[0]) + "\n")
    assert _ran(_run(f, store, files)) == {"evaluate": 3}

    # The calibration file: wanda's compress job and its evaluation; rtn reads no calibration data
    # and the base model none at all.
    _rewrite(files["calib"], files["calib"].read_text() + "\nAnother line of calibration text.")
    assert _ran(_run(f, store, files)) == {"compress": 1, "evaluate": 1}
    assert _out_of_grid(store) == [("compress", 1), ("evaluate", 7)]

    # An input the metrics do not read changes nothing: without perplexity, the corpus is not read.
    f2 = _study(tmp_path, [tiny_models("llama")], files, metrics=("tasks",), name="ident2")
    jobs = build_jobs(load_study(f2), tmp_path / "w", str(files["overlay"]))
    _rewrite(files["overlay"] / "perplexity" / "ntrex128" / "en.txt", TEXT)
    assert [j.id for j in build_jobs(load_study(f2), tmp_path / "w", str(files["overlay"]))] == [j.id for j in jobs]
    store.close()


def test_a_changed_model_folder_reruns_everything_from_it_and_nothing_else(tmp_path, tiny_models, monkeypatch):
    monkeypatch.setattr(engine, "_LocalPool", _InlinePool)
    files = _files(tmp_path)
    a = shutil.copytree(tiny_models("llama"), tmp_path / "model-a")
    b = shutil.copytree(tiny_models("llama"), tmp_path / "model-b")
    f = _study(tmp_path, [a, b], files, methods=('method = "none"', RTN))
    store = ResultsStore(tmp_path / "m.sqlite")
    assert _ran(_run(f, store, files)) == {"compress": 2, "evaluate": 4}
    assert _ran(_run(f, store, files)) == {}
    config = a / "config.json"
    _rewrite(config, config.read_text() + "\n")  # the same model, other bytes: a changed input all the same
    res = runner.invoke(app, ["study", str(f), "--results-db", str(store.path), "--data-dir", str(files["overlay"])])
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    assert ("3 job(s) run, 3 of them because what they read changed since they last ran (1 compress, 2 evaluate; "
            "the earlier results are kept, out of the grid), 3 already done") in text, text  # model-b's reused
    with sqlite3.connect(store.path) as con:
        stale = con.execute("SELECT labels FROM study_jobs WHERE in_grid = 0").fetchall()
    assert len(stale) == 3 and {json.loads(s)["model"] for (s,) in stale} == {str(a)}
    store.close()


def test_versions_and_slmedge_source_are_part_of_a_jobs_identity(tmp_path, tiny_models, monkeypatch):
    """llama.cpp's version shapes the GGUF exports and their evaluations only; slmedge's own source
    shapes every job. Built, not run."""
    files = _files(tmp_path)
    f = _study(tmp_path, [tiny_models("llama")], files, methods=('method = "none"', RTN),
               exports=('"none"', '"gguf"'))
    study = load_study(f)
    before = {j.id: j for j in build_jobs(study, tmp_path / "w", str(files["overlay"]))}
    assert len(before) == 7  # 1 compress, 2 exports, 4 evaluations
    real = inputs.package_version
    monkeypatch.setattr(inputs, "package_version",
                        lambda d: "99.0" if d.replace("_", "-") == "llama-cpp-python" else real(d))
    after = {j.id: j for j in build_jobs(study, tmp_path / "w", str(files["overlay"]))}
    changed = [j for j in before.values() if j.id not in after]
    assert sorted((j.kind, j.labels["export"]) for j in changed) == [
        ("evaluate", "gguf-auto"), ("evaluate", "gguf-auto"), ("export", "gguf-auto"), ("export", "gguf-auto")]
    monkeypatch.setattr(inputs, "slmedge_digest", lambda: "another-source")
    edited = {j.id for j in build_jobs(study, tmp_path / "w", str(files["overlay"]))}
    assert not edited & set(after)  # an edited slmedge: every job is new


def test_data_files_are_identified_by_content_not_by_where_they_are(tmp_path, tiny_models):
    """The overlay's copy of a shipped corpus is the same input as the shipped file."""
    from slmedge.data.files import SHIPPED

    files = _files(tmp_path)
    shutil.copy(SHIPPED / "perplexity" / "ntrex128" / "en.txt", files["overlay"] / "perplexity" / "ntrex128" / "en.txt")
    study = load_study(_study(tmp_path, [tiny_models("llama")], files))
    shipped = [j.id for j in build_jobs(study, tmp_path / "w", None)]
    assert [j.id for j in build_jobs(study, tmp_path / "w", str(files["overlay"]))] == shipped
    _rewrite(files["overlay"] / "perplexity" / "ntrex128" / "en.txt", TEXT)
    assert [j.id for j in build_jobs(study, tmp_path / "w", str(files["overlay"]))] != shipped


def test_file_hashes_are_remembered_across_runs_until_the_file_changes(tmp_path, monkeypatch):
    import slmedge.fsutil as fsutil

    calls = []
    real = fsutil.sha256_file
    monkeypatch.setattr(fsutil, "sha256_file", lambda p, *a: calls.append(Path(p).name) or real(p, *a))
    big = tmp_path / "weights.bin"
    big.write_bytes(b"x" * 1000)
    first = inputs.FileHashes(tmp_path / "h.json")
    digest = first.sha256(big)
    first.save()
    again = inputs.FileHashes(tmp_path / "h.json")  # the next process
    assert again.sha256(big) == digest and calls == ["weights.bin"]
    big.write_bytes(b"y" * 1001)
    assert again.sha256(big) != digest and calls == ["weights.bin", "weights.bin"]


# --- refused before anything runs ------------------------------------------------------------------


def test_a_method_with_bits_alone_is_listed_with_the_recipes_defaults(tmp_path, tiny_models):
    files = _files(tmp_path)
    f = _study(tmp_path, [tiny_models("llama")], files, methods=('method = "rtn"\nbits = 4',))
    res = runner.invoke(app, ["study", str(f), "--dry-run", "--results-db", str(tmp_path / "r.sqlite"),
                              "--data-dir", str(files["overlay"])])
    assert res.exit_code == 0, res.output
    assert "2 jobs (1 compress, 0 export, 1 evaluate)" in res.output and "rtn-w4g128" in res.output
    jobs = build_jobs(load_study(f), tmp_path / "w", str(files["overlay"]))
    assert jobs[0].labels["group_size"] == 128  # the Recipe's default, not None
    assert not (tmp_path / "work-ident").exists() and not (tmp_path / "r.sqlite").exists()


@pytest.mark.parametrize("dry", [True, False])
def test_a_missing_model_is_refused_in_one_line_naming_it_before_anything_runs(tmp_path, tiny_models, dry):
    files = _files(tmp_path)
    missing = tmp_path / "no-such-model"
    f = _study(tmp_path, [tiny_models("llama"), missing], files)
    args = ["study", str(f), "--results-db", str(tmp_path / "r.sqlite")] + (["--dry-run"] if dry else [])
    res = runner.invoke(app, args)
    one_line_error(res, f"{f.name}, line 2", str(missing), "not found")
    assert res.exit_code == 1  # a missing input, not an impossible setting (2)
    assert len(res.output.strip().splitlines()) == 1
    assert not (tmp_path / "work-ident").exists() and not (tmp_path / "r.sqlite").exists()


@pytest.mark.parametrize("dry", [True, False])
def test_a_missing_corpus_is_refused_before_anything_runs(tmp_path, tiny_models, dry):
    files = _files(tmp_path)
    f = _study(tmp_path, [tiny_models("llama")], files)
    f.write_text(f.read_text().replace("wikitext = false", f'wikitext = false\ncorpora = ["{tmp_path / "gone.txt"}"]'))
    args = ["study", str(f), "--results-db", str(tmp_path / "r.sqlite")] + (["--dry-run"] if dry else [])
    res = runner.invoke(app, args)
    one_line_error(res, "gone.txt")
    assert res.exit_code == 1
    assert not (tmp_path / "work-ident").exists() and not (tmp_path / "r.sqlite").exists()


def test_an_impossible_setting_still_exits_2(tmp_path, tiny_models):
    files = _files(tmp_path)
    f = _study(tmp_path, [tiny_models("llama")], files, exports=('"onnx"\ntype = "int3"',))
    res = runner.invoke(app, ["study", str(f), "--dry-run"])
    one_line_error(res, "unknown ONNX type 'int3'", f"{f.name}, line")
    assert res.exit_code == 2
