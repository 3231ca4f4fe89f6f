"""A target that takes another's exactness numbers once a probe proves they compute the same
(``[evaluate.<target>] same_as``): validated with the line, its jobs depend on the other's, its
rows are the other's (marked) beside the probe's, and a probe that disagrees makes it measure."""

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import study_data_files

from slmedge.evaluate.store import ResultsStore
from slmedge.study import carry
from slmedge.study.engine import run_job, run_study
from slmedge.study.jobs import build_jobs
from slmedge.study.report import caveats, load_rows
from slmedge.study.spec import StudyError, load_study


def _profiles(tmp_path, monkeypatch) -> None:
    """A second in-process target, "laptop" (this CPU again, one thread)."""
    folder = tmp_path / "profiles"
    folder.mkdir(exist_ok=True)
    (folder / "laptop.toml").write_text('name = "laptop"\ntransport = "local"\ndetect = true\nthreads = 1\n'
                                        'runtimes = ["torch", "onnxruntime", "llama.cpp"]\n')
    monkeypatch.setenv("SLMEDGE_TARGETS", str(folder))


def _study(tmp_path, model: Path, laptop: str = 'same_as = "cpu"\nprobe_tokens = 24\n') -> Path:
    corpus, tasks = study_data_files(tmp_path)
    f = tmp_path / "same.toml"
    f.write_text(f'''name = "same"
models = ["{model}"]
targets = ["cpu", "laptop"]
workdir = "work-same"

[evaluate]
metrics = ["perplexity", "fidelity", "tasks", "memory"]
langs = []
wikitext = false
corpora = ["{corpus}"]
seqlen = 32
ppl_windows = 1
fidelity_windows = 1
tasks = ["{tasks}"]
threads = 1

[evaluate.laptop]
metrics = ["perplexity", "fidelity", "tasks"]
{laptop}
[[methods]]
method = "none"

[[methods]]
label = "rtn-w4"
method = "rtn"
bits = 4
group_size = 32

[[exports]]
format = "gguf"
type = "auto"
''')
    return f


@pytest.mark.parametrize("laptop, words", [
    ('same_as = "laptop"', "names laptop itself"),
    ('same_as = "arm64"', "the study's targets are cpu, laptop"),
    ('probe_tokens = 64', "'probe_tokens' goes with same_as"),
    ('same_as = "cpu"\nprobe_tokens = 8', "probe_tokens must be an integer from 16 to 4,096, got 8"),
    ('same_as = "cpu"\nprobe_tolerance = -1', "probe_tolerance must be in [0, 100], got -1"),
    ('same_as = "cpu"\nprobe_tolerance = "small"', "'probe_tolerance' must be a float"),
    ('same_as = "cpu"\nmetrics = ["perplexity", "latency"]', "latency is the device's own"),
])
def test_same_as_is_checked_with_the_line(tmp_path, tiny_models, monkeypatch, laptop, words):
    _profiles(tmp_path, monkeypatch)
    f = _study(tmp_path, tiny_models("llama"), laptop)
    if "metrics" in laptop:  # replace the table's own metrics line
        text = f.read_text().replace('[evaluate.laptop]\nmetrics = ["perplexity", "fidelity", "tasks"]\n',
                                     "[evaluate.laptop]\n")
        f.write_text(text)
    with pytest.raises(StudyError, match=r"line \d+") as err:
        load_study(f)
    assert words in str(err.value), str(err.value)


def test_a_metric_the_other_target_does_not_measure_is_refused(tmp_path, tiny_models, monkeypatch):
    _profiles(tmp_path, monkeypatch)
    f = _study(tmp_path, tiny_models("llama"))
    f.write_text(f.read_text().replace('metrics = ["perplexity", "fidelity", "tasks", "memory"]',
                                       'metrics = ["perplexity", "memory"]'))
    with pytest.raises(StudyError, match="takes fidelity, tasks from cpu, which does not measure it"):
        load_study(f)


def test_a_chain_of_same_as_is_refused(tmp_path, tiny_models, monkeypatch):
    _profiles(tmp_path, monkeypatch)
    f = _study(tmp_path, tiny_models("llama"))
    text = f.read_text().replace('targets = ["cpu", "laptop"]', 'targets = ["cpu", "laptop", "desk"]')
    text = text.replace("[[methods]]", '[evaluate.desk]\nmetrics = ["perplexity"]\nsame_as = "laptop"\n\n[[methods]]', 1)
    (tmp_path / "profiles" / "desk.toml").write_text('name = "desk"\ntransport = "local"\ndetect = true\n')
    f.write_text(text)
    with pytest.raises(StudyError, match="desk takes laptop's numbers, which are themselves cpu's: name cpu"):
        load_study(f)


def test_the_jobs_of_a_same_as_target_depend_on_the_others(tmp_path, tiny_models, monkeypatch):
    _profiles(tmp_path, monkeypatch)
    study = load_study(_study(tmp_path, tiny_models("llama")))
    assert study.same_as == {"laptop": {"target": "cpu", "probe_tokens": 24, "probe_tolerance": 0.01}}
    jobs = build_jobs(study, tmp_path / "w")
    evals = {(j.labels["method"], j.spec["target"]): j for j in jobs if j.kind == "evaluate"}
    for method in ("base", "rtn-w4"):
        cpu, laptop = evals[(method, "cpu")], evals[(method, "laptop")]
        assert "same_as" not in cpu.spec
        assert laptop.spec["same_as"]["job"] == cpu.id and cpu.id in laptop.deps
        assert laptop.output == cpu.output  # the same file
    # The other target's job is part of this one's identity: changing its settings changes both.
    f = _study(tmp_path, tiny_models("llama"))
    f.write_text(f.read_text().replace("ppl_windows = 1", "ppl_windows = 2"))
    again = {(j.labels["method"], j.spec["target"]): j.id for j in build_jobs(load_study(f), tmp_path / "w")
             if j.kind == "evaluate"}
    assert again[("base", "laptop")] != evals[("base", "laptop")].id


@pytest.fixture(scope="module")
def carried(tiny_models, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("same")
    mp = pytest.MonkeyPatch()
    _profiles(tmp, mp)
    f = _study(tmp, tiny_models("llama"))
    store = ResultsStore(tmp / "r.sqlite")
    counts = run_study(load_study(f), store)
    assert counts["failed"] == 0 and counts["ran_by_kind"] == {"compress": 1, "export": 2, "evaluate": 4}
    yield store, f, tmp
    store.close()
    mp.undo()


def test_a_proven_target_carries_the_others_rows_and_the_probes(carried):
    store, _, _ = carried
    rows = load_rows(store, "same")
    by = {(r["labels"]["method"], r["target"]): r for r in rows}
    assert len(by) == 4
    for method in ("base", "rtn-w4"):
        cpu, laptop = by[(method, "cpu")], by[(method, "laptop")]
        probe = laptop["facts"]["same_as"]
        # The same file in the same runtime on the same CPU: every token alike.
        assert probe["same"] is True and probe["max_abs_dlogp"] == 0.0 and probe["tokens"] == 24
        for metric in ("perplexity", "kl_mean", "top1_agreement", "acc"):
            assert laptop["metrics"][metric] == cpu["metrics"][metric], metric
        assert "file_bytes" not in laptop["metrics"]  # memory is the device's own: never carried
        assert laptop["metrics"]["probe_max_abs_dlogp"] == {"wikitext2": 0.0}
        # Marked in the store, row by row, and measured with the other target's settings.
        run_id = laptop["run_id"]
        extras = [json.loads(x) for (x,) in store.db.execute(
            "SELECT extra FROM results WHERE run_id = ? AND metric = 'perplexity'", (run_id,))]
        assert extras and all(e["carried_from"] == "cpu" for e in extras)
        assert laptop["settings"]["target"] == "laptop" and laptop["settings"]["same_as"]["same"] is True
    assert any("On laptop, 2 of 2 files' perplexity, fidelity and task numbers are cpu's" in c for c in caveats(rows))


def test_a_probe_that_disagrees_makes_the_target_measure_itself(carried, monkeypatch):
    store, f, tmp = carried
    study = load_study(f)
    jobs = build_jobs(study, tmp / "work-same")
    job = next(j for j in jobs if j.kind == "evaluate" and j.spec["target"] == "laptop" and j.labels["method"] == "rtn-w4")
    real = carry.reference_logprobs
    monkeypatch.setattr(carry, "reference_logprobs", lambda *a, **k: real(*a, **k) + 0.5)
    payload = job.to_dict()
    payload["same_as_run"] = {"settings": {}, "rows": [{"metric": "perplexity", "subset": "c.txt", "value": 1.0,
                                                       "stderr": None, "unit": "ppl", "extra": None}]}
    res = run_job(payload, threads=1)
    assert res["facts"]["same_as"]["same"] is False
    assert res["facts"]["same_as"]["max_abs_dlogp"] == pytest.approx(0.5)
    assert "carried_from" not in res["results"]
    assert res["results"]["metrics"]["perplexity"]["c.txt"]["perplexity"] != 1.0  # measured, not carried
    names = [c["args"][1] for c in res["rows"][1:]]
    assert {"perplexity", "kl_mean", "acc", "probe_max_abs_dlogp"} <= set(names)
    assert not any("carried_from" in (c["args"][6] or {}) for c in res["rows"][1:] if len(c["args"]) > 6)


def test_the_carried_rows_are_every_row_those_metrics_write(tiny_models, tmp_path):
    """METRIC_ROWS lists every row perplexity, fidelity and tasks write: a new row would not be carried."""
    from slmedge.evaluate.api import EvalSettings, Evaluation
    from slmedge.study.engine import _RowRecorder

    corpus, tasks = study_data_files(tmp_path)
    from slmedge.compress.api import compress
    from slmedge.compress.recipe import Recipe

    art = tmp_path / "art"
    compress(str(tiny_models("llama")), Recipe(method="rtn", bits=4, group_size=32), art, device="cpu")
    for metric in carry.METRIC_ROWS:
        rec = _RowRecorder()
        ev = Evaluation(str(art), EvalSettings(metrics=(metric,), langs=(), wikitext=False, corpora=(str(corpus),),
                                               seqlen=32, ppl_windows=1, fidelity_windows=1, tasks=(str(tasks),),
                                               threads=1), store=rec)
        try:
            ev.run()
        finally:
            ev.close()
        written = {c["args"][1] for c in rec.calls[1:]}
        assert written and written <= set(carry.METRIC_ROWS[metric]), (metric, written)


def test_compare_is_strict_about_shape_and_nan():
    a = np.zeros(5)
    assert carry.compare(a, a, 0.0)["same"] is True
    assert carry.compare(a, a + 1e-3, 1e-2)["same"] is True
    assert carry.compare(a, a + 1e-1, 1e-2)["same"] is False
    assert carry.compare(a, np.zeros(4), 1.0)["same"] is False
    b = a.copy()
    b[2] = np.nan
    assert carry.compare(a, b, 1.0)["same"] is False
