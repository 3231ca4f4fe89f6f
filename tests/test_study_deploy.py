"""The on-device study: each grid row as the files a device runs (format = "deployable"), on the
local CPU and on the emulated arm64 target; the report's per-target Pareto plots, best-under
tables and device projections from the files' bytes; the compression level kept in the store."""

import json
import sqlite3
from pathlib import Path

import pytest
from conftest import one_line_error, require_arm64_env, study_data_files, tiny_study_file
from typer.testing import CliRunner

from slmedge.cli import app
from slmedge.evaluate.store import ResultsStore
from slmedge.study.engine import run_study
from slmedge.study.jobs import build_jobs
from slmedge.study.report import load_rows, tables
from slmedge.study.spec import StudyError, load_study

runner = CliRunner()


def _study(tmp_path, model: Path, targets=("cpu", "arm64"), extra="") -> Path:
    corpus, tasks = study_data_files(tmp_path)
    text = f'''name = "deploy"
models = ["{model}"]
targets = {json.dumps(list(targets))}
workdir = "work-deploy"

[evaluate]
metrics = ["perplexity", "fidelity", "tasks", "memory", "latency"]
langs = []
wikitext = false
corpora = ["{corpus}"]
seqlen = 32
ppl_windows = 1
fidelity_windows = 1
tasks = ["{tasks}"]
threads = 1
pp = 16
tg = 4
repeats = 1

[evaluate.arm64]
metrics = ["perplexity", "fidelity"]
{extra}
[[methods]]
method = "none"

[[methods]]
label = "rtn-w4"
method = "rtn"
bits = 4
group_size = 32

[[methods]]
label = "magnitude-50"
method = "magnitude"
sparsity = "0.5"

[[exports]]
format = "deployable"
'''
    f = tmp_path / "deploy.toml"
    f.write_text(text)
    return f


def test_deployable_exports_are_each_methods_natural_files(tmp_path, tiny_models):
    study = load_study(_study(tmp_path, tiny_models("llama")))
    jobs = build_jobs(study, tmp_path / "w")
    exports = {(j.labels["method"], j.spec["format"], j.spec["type"]) for j in jobs if j.kind == "export"}
    assert exports == {("base", "gguf", "f16"), ("base", "onnx", "fp16"),
                       ("rtn-w4", "gguf", "auto"), ("rtn-w4", "onnx", "auto"),
                       ("magnitude-50", "gguf", "f16"), ("magnitude-50", "gguf", "q8_0"),
                       ("magnitude-50", "onnx", "fp16"), ("magnitude-50", "onnx", "int8")}
    evals = [j for j in jobs if j.kind == "evaluate"]
    assert len(evals) == 2 * len(exports)  # every file on every target
    arm = {tuple(j.spec["settings"]["metrics"]) for j in evals if j.spec["target"] == "arm64"}
    cpu = {tuple(j.spec["settings"]["metrics"]) for j in evals if j.spec["target"] == "cpu"}
    assert arm == {("perplexity", "fidelity")} and cpu == {("perplexity", "fidelity", "tasks", "memory", "latency")}


def test_per_target_settings_are_checked_with_the_line(tmp_path, tiny_models):
    good = _study(tmp_path, tiny_models("llama"))
    bad = tmp_path / "bad.toml"
    bad.write_text(good.read_text().replace("[evaluate.arm64]", "[evaluate.mars]"))
    with pytest.raises(StudyError, match=r"line \d+: \[evaluate.mars\] names no target: unknown target .mars."):
        load_study(bad)
    bad.write_text(good.read_text().replace('metrics = ["perplexity", "fidelity"]', 'metrics = ["perplexity"]\ncolour = 1'))
    with pytest.raises(StudyError, match="unknown key 'colour'"):
        load_study(bad)
    bad.write_text(good.read_text().replace('format = "deployable"', 'format = "deployable"\ntype = "q4_0"'))
    with pytest.raises(StudyError, match="picks each method's types itself"):
        load_study(bad)


@pytest.fixture(scope="module")
def deployed(tiny_models, tmp_path_factory):
    """The grid run once with --discard-artifacts: its files are gone when the report is made."""
    tmp = tmp_path_factory.mktemp("deploy")
    require_arm64_env()  # skips (fails under CI=true) without the emulated target
    f = _study(tmp, tiny_models("llama"))
    store = ResultsStore(tmp / "r.sqlite")
    sizes: dict = {}
    counts = run_study(load_study(f), store, discard_artifacts=True,
                       progress=lambda j, c, left: _record_size(j, sizes))
    assert counts["failed"] == 0 and counts["ran_by_kind"] == {"compress": 2, "export": 8, "evaluate": 16}
    assert set(counts["seconds_by_kind"]) == {"compress", "export", "evaluate"}
    assert not list((tmp / "work-deploy" / "exports").iterdir())  # every file discarded
    yield store, f, sizes, tmp
    store.close()


def _record_size(job, sizes):
    """The bytes of each export's model files as the export job left them (before any discard)."""
    if job.kind == "export":
        from slmedge.export.formats import get_format

        fmt = get_format(job.spec["format"])
        sizes[job.id] = sum(Path(p).stat().st_size for p in fmt.model_files(fmt.model_file(Path(job.output))))


def test_the_report_shows_every_file_on_every_target_after_discard(deployed, tmp_path):
    from slmedge.study.report import file_size

    store, f, sizes, _ = deployed
    rows = load_rows(store, "deploy")
    assert len(rows) == 16 and {r["target"] for r in rows} == {"cpu", "arm64"}
    db = store.db
    for r in rows:  # each point's size is its file's, read before the file was discarded
        subject = json.loads(db.execute("SELECT spec FROM study_jobs WHERE run_id = ?", (r["run_id"],)).fetchone()[0])["subject"]
        assert file_size(r) == sizes[subject], r["name"]
        assert r["compression_bits"] is not None and r["family"] in ("base", "quantize", "prune")
    fams = {r["labels"]["method"]: r["family"] for r in rows}
    assert fams == {"base": "base", "rtn-w4": "quantize", "magnitude-50": "prune"}
    # The base's level is what it is stored as (the tiny model: fp32 safetensors), exported as f16.
    base_gguf = [r for r in rows if r["labels"]["method"] == "base" and r["labels"]["export"] == "gguf-f16"]
    assert all(15.5 < r["compression_bits"] < 17.5 and r["level"] == "f16 gguf file" for r in base_gguf)
    assert all(r["facts"]["source"] == {"bits_per_weight": 32.0, "level": "float32 safetensors"} for r in base_gguf)
    rtn = [r for r in rows if r["labels"]["method"] == "rtn-w4" and r["labels"]["export"] == "gguf-auto"]
    assert rtn and all(r["export"]["codes"] == "kept" and r["compression_bits"] < 8 and r["level"] == "q4_1 gguf file"
                       for r in rtn)

    out = tmp_path / "r.html"
    res = runner.invoke(app, ["report", str(store.path), "--study", "deploy", "-o", str(out)])
    assert res.exit_code == 0, res.output
    html = out.read_text()
    for target in ("cpu", "arm64"):
        for q in ("mean KL to the base", "perplexity (geometric mean over the languages)"):
            assert f"Pareto front on {target}: {q} against file size (MB)" in html, (target, q)
    assert "Pareto front on cpu: mean task accuracy against decode tokens/s" in html
    assert "Pareto front on arm64: mean KL to the base against decode tokens/s" not in html  # emulated: no speed
    assert "magnitude-50 (gguf-q8_0)" in html and "magnitude-50 (onnx-int8)" in html  # pruned rows present
    assert "Best under a size budget on cpu" in html and "Best under a speed floor on cpu" in html
    assert "PROJECTED decode bound on device profiles" in html and "raspberry-pi-5 (projected tok/s)" in html
    assert "Findings" in html and "sparsity in gguf-f16 on cpu" in html


def test_projections_are_rooflines_of_each_files_bytes(deployed):
    from slmedge.study.report import file_size, projection_table
    from slmedge.targets.profiles import get_profile

    store, *_ = deployed
    rows = load_rows(store, "deploy")
    table = projection_table(rows)
    assert table and "projections, not measurements" in table["title"]
    pi = get_profile("raspberry-pi-5", detect=False)
    for r in rows:
        proj = r["facts"]["projections"]["raspberry-pi-5"]
        size = file_size(r)
        # decode reads every weight byte once per token (plus the KV cache): the bound is below
        # bandwidth / file bytes and within the KV cache's share of it
        assert proj["decode_bound_tps"] <= pi.memory_bandwidth_gbs * 1e9 / size
        assert proj["decode_bound_tps"] > 0.5 * pi.memory_bandwidth_gbs * 1e9 / size
    small = min(rows, key=file_size)
    big = max(rows, key=file_size)
    assert small["facts"]["projections"]["raspberry-pi-5"]["decode_bound_tps"] > \
        big["facts"]["projections"]["raspberry-pi-5"]["decode_bound_tps"]


def test_best_under_tables_take_the_users_budgets(deployed):
    from slmedge.study.report import file_size

    store, *_ = deployed
    rows = load_rows(store, "deploy")
    sizes = sorted(file_size(r) / 1e6 for r in rows if r["target"] == "cpu")
    budget = (sizes[0] + sizes[1]) / 2  # only the smallest file fits
    t = next(t for t in tables(rows, budgets_mb=[budget]) if t["title"] == "Best under a size budget on cpu")
    assert t["rows"][0][1] == "1"
    smallest = min((r for r in rows if r["target"] == "cpu"), key=file_size)
    assert all(cell.startswith(str(smallest["labels"]["method"])) for cell in t["rows"][0][2:] if cell != "–")
    res = runner.invoke(app, ["report", str(store.path), "--study", "deploy", "--under-mb", "ten", "-o", "x.html"])
    one_line_error(res, "--under-mb takes numbers separated by commas, not 'ten'")
    res = runner.invoke(app, ["report", str(store.path), "--study", "deploy", "--under-mb", "10,-5", "-o", "x.html"])
    one_line_error(res, "--under-mb")
    assert "must be in (0, 1,000,000,000], got -5" in res.output, res.output


def test_an_older_store_without_facts_still_reports(deployed, tmp_path):
    """A store written before the facts column: its rows report, their levels read as before."""
    import shutil

    store, *_ = deployed
    copy = tmp_path / "old.sqlite"
    shutil.copy(store.path, copy)
    with sqlite3.connect(copy) as con:
        con.execute("UPDATE study_jobs SET facts = NULL")
    old = ResultsStore(copy, readonly=True)
    try:
        rows = load_rows(old, "deploy")
        assert len(rows) == 16 and all(r["facts"] == {} for r in rows)
    finally:
        old.close()


def test_a_changed_base_file_changes_every_job_that_depends_on_it(tmp_path, tiny_models):
    """A GGUF base: its content (sha256) is part of every job built from it, down to each file's
    evaluation on each target."""
    from slmedge.export.api import export

    gguf = tmp_path / "base.gguf"
    export(str(tiny_models("llama")), "gguf", "f16", gguf, verify=False)
    f = _study(tmp_path, gguf)
    first = {(j.kind, json.dumps(j.labels, sort_keys=True)): j.id for j in build_jobs(load_study(f), tmp_path / "w")}
    assert sum(1 for k, _ in first if k == "evaluate") == 16
    export(str(tiny_models("llama")), "gguf", "q8_0", gguf, verify=False, overwrite=True)  # same path, new content
    changed = {(j.kind, json.dumps(j.labels, sort_keys=True)): j.id for j in build_jobs(load_study(f), tmp_path / "w")}
    assert changed.keys() == first.keys()
    assert all(first[k] != changed[k] for k in first)  # every job depends on the base's content


def test_the_new_formats_are_exports_of_a_study(tmp_path, tiny_models):
    """compressed-tensors (torch loads it) and onnxruntime-genai (its own runtime) as [[exports]]:
    each is written once, evaluated in its runtime, and scores what the artifact scores."""
    from conftest import require_import

    require_import("compressed_tensors", "compressed-tensors is not installed (pip install 'slmedge[compressed-tensors]')")
    require_import("onnxruntime_genai", "onnxruntime-genai is not installed (pip install 'slmedge[genai]')")
    f = tiny_study_file(tmp_path, tiny_models("llama"), "formats",
                        ['label = "rtn-w4"\nmethod = "rtn"\nbits = 4\ngroup_size = 32'],
                        exports=('"none"', '"compressed-tensors"', '"onnxruntime-genai"'), ppl_windows=2)
    store = ResultsStore(tmp_path / "r.sqlite")
    try:
        counts = run_study(load_study(f), store)
        assert counts["failed"] == 0 and counts["ran_by_kind"] == {"compress": 1, "export": 2, "evaluate": 3}
        rows = {r["labels"]["format"]: r for r in load_rows(store, "formats")}
        assert {k: r["runtime"] for k, r in rows.items()} == {"none": "torch", "compressed-tensors": "torch",
                                                             "onnxruntime-genai": "onnxruntime-genai"}
        ppl = {k: r["metrics"]["perplexity"]["c.txt"] for k, r in rows.items()}
        # transformers 5.17-5.20 decode the checkpoint in fp32, bit for bit; 5.21+ multiply the codes by their
        # fp16 scales in fp16 (each weight within 2^-11 relative; tests/test_export_compressed_tensors.py)
        assert ppl["compressed-tensors"] == pytest.approx(ppl["none"], rel=2e-4)
        assert ppl["onnxruntime-genai"] == pytest.approx(ppl["none"], rel=2e-2)  # int4 kernels, fp16 embedding
        assert rows["compressed-tensors"]["export"]["codes"] == "kept"
        assert rows["onnxruntime-genai"]["export"]["codes"] == "kept"
    finally:
        store.close()
