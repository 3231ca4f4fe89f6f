"""Studies: strict study files, a small grid on both engines, kill -9 and resume, the report."""

import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import missing_prerequisite, one_line_error, require_import, safetensors_full_disk, study_data_files
from typer.testing import CliRunner

from slmedge.cli import app
from slmedge.evaluate.store import ResultsStore
from slmedge.study.engine import run_study
from slmedge.study.report import load_rows
from slmedge.study.spec import StudyError, load_study

runner = CliRunner()


def _study(tmp_path, model: Path, name="tiny", methods=None, exports=('"none"', '"gguf"')) -> Path:
    corpus, tasks = study_data_files(tmp_path)
    methods = methods or ['method = "none"', 'label = "rtn-w4"\nmethod = "rtn"\nbits = 4\ngroup_size = 32',
                          'label = "magnitude-50"\nmethod = "magnitude"\nsparsity = "0.5"']
    text = f'''name = "{name}"
models = ["{model}"]
seeds = [0]
targets = ["cpu"]
workdir = "work-{name}"

[evaluate]
metrics = ["perplexity", "fidelity", "tasks", "memory"]
langs = []
wikitext = false
corpora = ["{corpus}"]
seqlen = 32
ppl_windows = 2
fidelity_windows = 1
tasks = ["{tasks}"]
threads = 1
''' + "".join(f"\n[[methods]]\n{m}\n" for m in methods) + "".join(f'\n[[exports]]\nformat = {e}\n' for e in exports)
    f = tmp_path / f"{name}.toml"
    f.write_text(text)
    return f


# --- the study file ------------------------------------------------------------------------------


def test_study_files_are_validated_with_the_line(tmp_path, tiny_models):
    good = _study(tmp_path, tiny_models("llama"))
    assert len(load_study(good).methods) == 3
    text = good.read_text()
    # (bad text, words of the error, the text of the line it must name)
    cases = [
        (text.replace('group_size = 32', 'group_size = 32\ncolour = "red"'), ["unknown key 'colour'"], 'colour = "red"'),
        (text.replace('method = "rtn"\nbits = 4', 'method = "rtn"\nbits = 4\nsparsity = "0.5"'),
         ["rtn quantizes and does not prune"], None),  # the [[methods]] entry's header
        (text.replace('method = "magnitude"', 'method = "shrink"'), ["unknown method 'shrink'"], 'method = "shrink"'),
        (text.replace('targets = ["cpu"]', 'targets = ["mars"]'), ["unknown target 'mars'"], "targets ="),
        (text.replace('format = "gguf"', 'format = "gguf"\ntype = "q9_9"'), ["unknown GGUF type 'q9_9'"], 'type = "q9_9"'),
        (text.replace('targets = ["cpu"]', 'targets = ["arm64"]').replace('\n[[exports]]\nformat = "gguf"\n', ''),
         ["runs exported files only"], "targets ="),
        (text.replace("seqlen = 32", "seqlen = 1"), ["seqlen must be an integer of at least 2, got 1"], "[evaluate]"),
        (text.replace('seeds = [0]', 'seeds = ["zero"]'), ["'seeds' must be a list of integers"], "seeds ="),
    ]
    for i, (bad, words, needle) in enumerate(cases):
        f = tmp_path / f"bad{i}.toml"
        f.write_text(bad)
        lines = bad.splitlines()
        if needle is None:
            line = lines.index('label = "rtn-w4"')  # the header is the line before it (1-based: index)
        else:
            line = next(n for n, x in enumerate(lines, 1) if x.startswith(needle))
        with pytest.raises(StudyError) as err:
            load_study(f)
        for w in [*words, f"{f.name}, line {line}:"]:
            assert w in str(err.value), (i, str(err.value))
    res = runner.invoke(app, ["study", str(tmp_path / "bad0.toml")])
    one_line_error(res, "unknown key 'colour'")


def test_a_budget_sweep_is_one_row_per_budget(tmp_path, tiny_models):
    f = _study(tmp_path, tiny_models("llama"), methods=[
        'method = "none"', 'label = "gptq-mix"\nmethod = "gptq"\nbpw = [5.0, 4.5, 4]', 'method = "rtn"\nbpw = [4.25, 6]',
        'method = "gptq"\nbpw = 4.75\nbpw_grids = ["q4_k", "q6_k"]'])
    study = load_study(f)
    got = [(m.label, m.method, m.settings.get("bpw")) for m in study.methods]
    assert got == [("base", "none", None), ("gptq-mix-bpw5", "gptq", 5.0), ("gptq-mix-bpw4.5", "gptq", 4.5),
                   ("gptq-mix-bpw4", "gptq", 4.0), ("rtn-bpw4.25", "rtn", 4.25), ("rtn-bpw6", "rtn", 6.0),
                   ("gptq-bpw4.75-q4_k-q6_k", "gptq", 4.75)]
    assert study.methods[-1].settings["bpw_grids"] == ["q4_k", "q6_k"]
    res = runner.invoke(app, ["study", str(f), "--dry-run"])
    assert res.exit_code == 0, res.output
    assert "6 compress" in res.output, res.output
    text = f.read_text()
    for bad, words in ((text.replace("bpw = [5.0, 4.5, 4]", "bpw = []"), "a non-empty list of numbers"),
                       (text.replace("bpw = [5.0, 4.5, 4]", 'bpw = [5.0, "4"]'), "a non-empty list of numbers"),
                       (text.replace("bpw = [5.0, 4.5, 4]", "bpw = [4.5, 4.5]"), "lists a budget twice"),
                       (text.replace("bpw = [5.0, 4.5, 4]", "bpw = [5.0, 99]"), "bpw"),
                       (text.replace("bpw = [5.0, 4.5, 4]", "bpw = [5.0]\ngrid = \"q4_0\""), "not both"),
                       (text.replace('"q6_k"]', '"q9_9"]'), "unknown grid 'q9_9'")):
        g = tmp_path / "bad-sweep.toml"
        g.write_text(bad)
        with pytest.raises(StudyError) as err:
            load_study(g)
        assert words in str(err.value), str(err.value)
        assert f"{g.name}, line " in str(err.value), str(err.value)


def test_jobs_are_shared_and_listed(tmp_path, tiny_models):
    f = _study(tmp_path, tiny_models("llama"))
    res = runner.invoke(app, ["study", str(f), "--dry-run"])
    assert res.exit_code == 0, res.output
    # 2 compress (rtn, magnitude), 3 exports (base, rtn, magnitude), 6 evaluations: each built once
    assert "11 jobs (2 compress, 3 export, 6 evaluate)" in res.output


# --- running: both engines, kill -9 --------------------------------------------------------------

NUMERIC = ("perplexity", "bits_per_byte", "acc", "acc_norm", "kl_mean", "top1_agreement", "file_bytes")


def _numbers(store, study):
    return {(r["labels"]["method"], r["labels"]["export"]): {m: r["metrics"].get(m) for m in NUMERIC}
            for r in load_rows(store, study)}


@pytest.fixture(scope="module")
def local_store(tiny_models, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("study-local")
    f = _study(tmp, tiny_models("llama"))
    store = ResultsStore(tmp / "local.sqlite")
    counts = run_study(load_study(f), store)
    assert counts["ran"] == 11 and counts["failed"] == 0
    again = run_study(load_study(f), store)  # everything finished: nothing runs twice
    assert again["ran"] == 0 and again["already_done"] == 11
    yield store, f
    store.close()


def test_an_edited_study_reports_its_current_grid_and_keeps_the_rest(local_store, tmp_path):
    import shutil

    store, f = local_store
    copy = ResultsStore(shutil.copy(store.path, tmp_path / "copy.sqlite"))
    text = f.read_text()
    dropped = '\n[[methods]]\nlabel = "magnitude-50"\nmethod = "magnitude"\nsparsity = "0.5"\n'
    assert dropped in text
    shrunk = f.with_name("tiny-without-magnitude.toml")  # same study name, same folder, same jobs
    shrunk.write_text(text.replace(dropped, ""))
    counts = run_study(load_study(shrunk), copy)
    assert counts["ran"] == 0 and counts["already_done"] == 7
    assert {r["labels"]["method"] for r in load_rows(copy, "tiny")} == {"base", "rtn-w4"}
    counts = run_study(load_study(f), copy)  # the method comes back: its results were kept
    assert counts["ran"] == 0 and len(load_rows(copy, "tiny")) == 6
    copy.close()


def test_a_small_grid_gives_identical_results_on_both_engines(local_store, tmp_path):
    ray = require_import("ray", "ray is not installed (pip install -e '.[ray]'; scripts/setup.sh installs it)")

    store, f = local_store
    ray_store = ResultsStore(tmp_path / "ray.sqlite")
    try:
        # A GGUF records its source artifact's path in its metadata (padded to 32 bytes): the Ray
        # workdir's path has the local one's length, so the files' sizes compare too.
        twin = f.parent.with_name(f.parent.name.replace("local", "ray__")) / "work-tiny"
        counts = run_study(load_study(f), ray_store, engine="ray", workdir=twin)
    finally:
        ray.shutdown()
    assert counts["ran"] == 11 and counts["failed"] == 0
    a, b = _numbers(store, "tiny"), _numbers(ray_store, "tiny")
    assert a.keys() == b.keys() and len(a) == 6
    for key in a:
        assert a[key] == b[key], key
    ray_store.close()


def test_a_killed_study_resumes_with_every_job_done_once(tmp_path, tiny_models):
    f = _study(tmp_path, tiny_models("llama"), name="killme")
    db = tmp_path / "k.sqlite"
    from slmedge.study.inputs import SOURCE_DIGEST_ENV, slmedge_digest

    # The resume below runs in this process: the child identifies jobs by the same slmedge source
    # (an edit of the working tree since this process started would otherwise give other job ids).
    env = {**os.environ, SOURCE_DIGEST_ENV: slmedge_digest()}
    proc = subprocess.Popen([sys.executable, "-c", "from slmedge.cli import main; main()", "study", str(f),
                             "--results-db", str(db)], env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    done_at_kill = 0
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        time.sleep(0.3)
        if db.is_file():
            try:
                with sqlite3.connect(db, timeout=5) as con:
                    done_at_kill = con.execute("SELECT COUNT(*) FROM study_jobs WHERE status = 'done'").fetchone()[0]
            except sqlite3.Error:
                continue
            if done_at_kill >= 3:
                break
    assert proc.poll() is None, proc.stderr.read().decode()[-500:]
    os.killpg(proc.pid, signal.SIGKILL)  # the runner and its workers, mid-grid
    proc.wait()
    assert 3 <= done_at_kill < 11
    res = runner.invoke(app, ["study", str(f), "--results-db", str(db)])
    assert res.exit_code == 0, res.output
    assert "resuming" in res.output
    with sqlite3.connect(db) as con:
        assert con.execute("SELECT COUNT(*) FROM study_jobs WHERE status = 'done'").fetchone()[0] == 11
        finished = con.execute("SELECT job_id, COUNT(*) FROM study_events WHERE event = 'finished' "
                               "GROUP BY job_id").fetchall()
        assert len(finished) == 11 and all(n == 1 for _, n in finished)  # every job recorded done once
        # no job that had finished was started again
        for (job_id,) in con.execute("SELECT job_id FROM study_events WHERE event = 'finished'"):
            fin = con.execute("SELECT MIN(id) FROM study_events WHERE job_id = ? AND event = 'finished'",
                              (job_id,)).fetchone()[0]
            assert con.execute("SELECT COUNT(*) FROM study_events WHERE job_id = ? AND event = 'started' AND id > ?",
                               (job_id, fin)).fetchone()[0] == 0


def test_discarded_artifacts_are_rebuilt_only_when_a_job_needs_them(tmp_path, tiny_models):
    methods = ['method = "none"', 'label = "rtn-w4"\nmethod = "rtn"\nbits = 4\ngroup_size = 32']
    f = _study(tmp_path, tiny_models("llama"), name="lean", methods=methods, exports=('"none"',))
    store = ResultsStore(tmp_path / "lean.sqlite")
    counts = run_study(load_study(f), store, discard_artifacts=True)  # 1 compress, 2 evaluations
    assert counts["ran"] == 3 and counts["discarded_bytes"] > 0
    artifacts = tmp_path / "work-lean" / "artifacts"
    assert not any(artifacts.iterdir())  # the compressed model went once both evaluations had it
    before = _numbers(store, "lean")
    again = run_study(load_study(f), store)  # nothing needs the artifact: it stays gone
    assert again["ran"] == again["rebuilt"] == 0 and not any(artifacts.iterdir())
    # A GGUF export joins the grid: the rtn export needs the discarded artifact, which is rebuilt.
    f.write_text(f.read_text() + '\n[[exports]]\nformat = "gguf"\n')
    res = runner.invoke(app, ["study", str(f), "--results-db", str(store.path), "--discard-artifacts"])
    assert res.exit_code == 0, res.output
    assert "3 job(s) run" not in res.output and "5 job(s) run, 1 of them rebuilt" in res.output, res.output
    assert "artifacts no job needs any more discarded" in res.output
    assert not any(artifacts.iterdir()) and not any((tmp_path / "work-lean" / "exports").iterdir())
    after = _numbers(store, "lean")
    assert len(after) == 4 and all(after[k] == before[k] for k in before)  # the first results were kept
    with sqlite3.connect(store.path) as con:
        assert con.execute("SELECT COUNT(*) FROM study_events WHERE event = 'rebuilding'").fetchone()[0] == 1
    store.close()


def test_a_corrupt_artifact_is_rebuilt_by_the_next_run(tmp_path, tiny_models):
    """A study's artifact damaged on disk (a tensor file's bytes changed, its checksum no longer
    holds) is made again by the next run that needs it, instead of failing every job that reads it
    with advice to rerun (issue 41); a manifest whose seal was removed is refused instead
    (tests/test_seals.py)."""
    methods = ['label = "rtn-w4"\nmethod = "rtn"\nbits = 4\ngroup_size = 32']
    f = _study(tmp_path, tiny_models("llama"), name="dent", methods=methods, exports=('"gguf"',))
    db = tmp_path / "dent.sqlite"
    res = runner.invoke(app, ["study", str(f), "--results-db", str(db)])
    assert res.exit_code == 0, res.output
    (art,) = [p for p in (tmp_path / "work-dent" / "artifacts").iterdir() if p.is_dir()]
    damaged = max((p for p in art.iterdir() if p.suffix == ".safetensors"), key=lambda p: p.stat().st_size)
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 0xFF  # one bit of the last tensor
    damaged.write_bytes(bytes(data))
    for gguf_file in (tmp_path / "work-dent" / "exports").rglob("*.gguf"):
        gguf_file.unlink()
    # Another measurement of the export joins the grid: the export is needed again, and it reads the artifact.
    f.write_text(f.read_text().replace("ppl_windows = 2", "ppl_windows = 3"))
    res = runner.invoke(app, ["study", str(f), "--results-db", str(db)])
    assert res.exit_code == 0, res.output
    assert "2 of them rebuilt" in res.output, res.output  # the artifact, and the export deleted above
    from slmedge.compress.artifact import Artifact

    Artifact.open(art, verify=True)  # whole again
    with sqlite3.connect(db) as con:
        details = [d for (d,) in con.execute("SELECT detail FROM study_events WHERE event = 'rebuilding'")]
    assert len(details) == 2 and any(str(art) in d and "changed since it was written" in d for d in details), details


class _InlinePool:
    """The local engine's interface, running each job in this process (so a test can patch it)."""

    def __init__(self, workers):
        pass

    def submit(self, job, threads, data_dir, needs_gpu):
        from concurrent.futures import Future

        from slmedge.study.engine import run_job

        fut = Future()
        try:
            fut.set_result(run_job(job, threads, data_dir))
        except Exception as exc:  # noqa: BLE001
            fut.set_exception(exc)
        return fut

    def wait_any(self, handles):
        return list(handles)

    result = staticmethod(lambda handle: handle.result())

    def close(self):
        pass


def test_a_full_disk_stops_the_grid_with_one_clear_error(tmp_path, tiny_models, monkeypatch):
    import slmedge.compress.artifact as artifact
    import slmedge.study.engine as engine

    monkeypatch.setattr(engine, "_LocalPool", _InlinePool)
    monkeypatch.setattr(artifact, "save_file", safetensors_full_disk)
    f = _study(tmp_path, tiny_models("llama"), name="full", exports=('"none"',))
    store = ResultsStore(tmp_path / "full.sqlite")
    with pytest.raises(engine.StudyRunError, match="no space left on the device .* 1 job.s. failed and 3 were not "
                                                   "started; finished jobs are kept"):
        run_study(load_study(f), store, workers=1)
    with sqlite3.connect(store.path) as con:  # the base evaluation finished; nothing started after the failure
        assert con.execute("SELECT kind, status FROM study_jobs WHERE status IS NOT NULL AND status != 'pending' "
                           "ORDER BY kind").fetchall() == [("compress", "failed"), ("evaluate", "done")]
    assert not list((tmp_path / "work-full" / "artifacts").glob("*/slmedge.json"))
    store.close()


# --- the report ------------------------------------------------------------------------------------


def test_report_has_the_tables_and_plots(local_store, tmp_path):
    store, _ = local_store
    out = tmp_path / "r.html"
    res = runner.invoke(app, ["report", str(store.path), "--study", "tiny", "-o", str(out)])
    assert res.exit_code == 0, res.output
    html = out.read_text()
    for title in ("Perplexity per language", "Zero-shot task accuracy", "Fidelity to the base model",
                  "Memory and latency per target", "Caveats", "rtn-w4", "magnitude-50"):
        assert title in html, title
    assert html.count("data:image/png;base64,") >= 3  # compression level, tasks, Pareto front(s)
    md = tmp_path / "r.md"
    res = runner.invoke(app, ["report", str(store.path), "--study", "tiny", "--format", "md", "-o", str(md)])
    assert res.exit_code == 0 and "| evaluation |" in md.read_text()
    assert len(list((tmp_path / "r_files").glob("*.png"))) >= 3
    # Missing folders above -o are created, as compress and export create theirs (issue 41)
    deep = tmp_path / "missing" / "dir" / "r.html"
    res = runner.invoke(app, ["report", str(store.path), "--study", "tiny", "-o", str(deep)])
    assert res.exit_code == 0 and "Caveats" in deep.read_text(), res.output
    res = runner.invoke(app, ["report", str(store.path), "--study", "nope", "-o", str(out)])
    one_line_error(res, "no finished evaluations of study 'nope'")
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        missing_prerequisite("chromium is not installed (apt-get install chromium; scripts/setup.sh installs it)")
    dom = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                          "--disable-background-networking", "--disable-component-update", "--disable-sync",
                          f"--user-data-dir={tmp_path / 'chrome'}", "--virtual-time-budget=5000", "--dump-dom",
                          out.as_uri()], capture_output=True, text=True, timeout=120).stdout
    n = html.count("<img")
    assert f'data-plots-rendered="{n}/{n}"' in dom, dom[-300:]


def _kill_rtn_compress(job: dict, threads=None, data_dir=None):
    """``run_job``, except that the worker process running the rtn-w4 compression dies the way a
    native crash or the out-of-memory killer ends it (SIGKILL)."""
    from slmedge.study.engine import run_job

    if job["kind"] == "compress" and job["spec"]["method"] == "rtn":
        os.kill(os.getpid(), signal.SIGKILL)
    return run_job(job, threads, data_dir)


def test_a_worker_that_dies_fails_its_job_and_the_grid_goes_on(tmp_path, tiny_models, monkeypatch):
    import slmedge.study.engine as engine

    monkeypatch.setattr(engine, "run_job", _kill_rtn_compress)  # what the local pool's workers are sent
    f = _study(tmp_path, tiny_models("llama"), name="dies", exports=('"none"',))
    store = ResultsStore(tmp_path / "dies.sqlite")
    with pytest.raises(engine.StudyRunError, match=r"1 job\(s\) failed \(1 blocked behind them\).*compress .*"
                                                   r"WorkerDiedError: its worker process was killed"):
        run_study(load_study(f), store, workers=1)
    with sqlite3.connect(store.path) as con:  # the other chains ran to the end in a new worker
        states = con.execute("SELECT kind, status, count(*) FROM study_jobs WHERE status IS NOT NULL "
                             "GROUP BY kind, status ORDER BY kind, status").fetchall()
    assert states == [("compress", "done", 1), ("compress", "failed", 1), ("evaluate", "done", 2),
                      ("evaluate", "pending", 1)], states
    store.close()
