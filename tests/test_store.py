"""The results store loses nothing that is not its own: a file that is not an slmedge store is
refused untouched, a failed evaluation is never reported as one, an older store is upgraded (and
only read by `report`), and `report -o` replaces only a report slmedge wrote."""

import hashlib
import json
import os
import sqlite3
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conftest import one_line_error
from slmedge.cli import app
from slmedge.errors import OutputExistsError
from slmedge.evaluate.store import MIGRATIONS, ResultsStore, ResultsStoreError

runner = CliRunner()
TEXT = "The quick brown fox jumps over the lazy dog while the cat sleeps in the sun. " * 12


def _refused(res, *words):
    """Exit 1, no traceback, the error as the last line (a command may say what it does first)."""
    lines = res.output.strip().splitlines()
    assert res.exit_code == 1 and "Traceback" not in res.output and lines[-1].startswith("error:"), res.output
    assert sum(line.startswith("error:") for line in lines) == 1, res.output
    for w in words:
        assert w in lines[-1], res.output


def _fingerprint(path: Path) -> tuple:
    st = path.stat()
    return st.st_size, st.st_mtime_ns, hashlib.sha256(path.read_bytes()).hexdigest()


def _tables(path: Path) -> set[str]:
    with sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True) as con:
        return {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}


def _foreign_sqlite(path: Path) -> Path:
    with sqlite3.connect(path) as con:
        con.execute("CREATE TABLE invoices (id INTEGER PRIMARY KEY, amount REAL)")
        con.execute("INSERT INTO invoices (amount) VALUES (12.5)")
    con.close()
    os.utime(path, ns=(1_000_000_000_000_000_000, 1_000_000_000_000_000_000))  # a distinct, old mtime
    return path


def _study_file(tmp_path: Path, model: Path) -> Path:
    from conftest import tiny_study_file

    corpus = tmp_path / "c.txt"
    corpus.write_text(TEXT, encoding="utf-8")
    return tiny_study_file(tmp_path, model, "s", ['method = "none"'], corpus=corpus)


def _eval_args(model, db, *corpora, seqlen=32):
    args = ["evaluate", str(model), "--metrics", "perplexity", "--langs", "", "--no-wikitext", "--seqlen", str(seqlen),
            "--ppl-windows", "1", "--results-db", str(db)]
    for c in corpora:
        args += ["--corpus", str(c)]
    return args


def _runs(db: Path) -> list[tuple]:
    if not db.exists() or "runs" not in _tables(db):
        return []
    with sqlite3.connect(db) as con:
        return con.execute("SELECT id, status, error FROM runs ORDER BY id").fetchall()


def _fake_run(store: ResultsStore, model: str, corpus: str, ppl: float, status: str = "done") -> int:
    """A run as an evaluation records it, without running a model."""
    rid = store.begin_run(model, "ab" * 32, "torch", 1, "cpu", {"slmedge": "test"},
                          {"limit": None, "ppl_windows": 1, "seqlen": 32})
    store.add(rid, "perplexity", ppl, corpus, 0.1, "ppl")
    store.add(rid, "bits_per_byte", 1.5, corpus, None, "bits/byte")
    store.add(rid, "file_bytes", 2e6, "", None, "bytes")
    store.add(rid, "bits_per_weight", 4.5, "", None, "bits")
    if status != "running":
        store.end_run(rid, None if status == "done" else "DataError: boom")
    return rid


# --- files that are not slmedge stores ---------------------------------------------------------------


def test_a_foreign_sqlite_file_is_refused_untouched_by_every_command(tmp_path, tiny_models, monkeypatch):
    db = _foreign_sqlite(tmp_path / "invoices.sqlite")
    before = _fingerprint(db)
    commands = {
        "evaluate": _eval_args(tiny_models("llama"), db, tmp_path / "nothing-needed.txt"),
        "report": ["report", str(db), "-o", str(tmp_path / "r.html")],
        "study": ["study", str(_study_file(tmp_path, tiny_models("llama"))), "--results-db", str(db)],
        "run": ["run", "--results-db", str(db)],
    }
    (tmp_path / "nothing-needed.txt").write_text(TEXT, encoding="utf-8")
    for name, args in commands.items():
        res = runner.invoke(app, args)
        if name == "study":
            _refused(res, str(db), "not an slmedge results store", "left untouched")
        else:
            one_line_error(res, str(db), "not an slmedge results store", "left untouched")
            assert res.exit_code == 1, (name, res.output)
        assert _fingerprint(db) == before, name  # byte for byte, mtime included
        assert _tables(db) == {"invoices"}, name  # no migrations table, no runs
    assert not (tmp_path / "r.html").exists()
    # The library refuses the same way, whichever mode.
    for readonly in (False, True):
        with pytest.raises(ResultsStoreError, match="not an slmedge results store"):
            ResultsStore(db, readonly=readonly)
    assert _fingerprint(db) == before
    # A report from $SLMEDGE_RESULTS_DB is refused the same way.
    monkeypatch.setenv("SLMEDGE_RESULTS_DB", str(db))
    one_line_error(runner.invoke(app, ["report", "-o", str(tmp_path / "r.html")]), str(db))
    assert _fingerprint(db) == before


@pytest.mark.parametrize("content", [b"run,model,ppl\n1,smollm2,23.1\n", b"SQLite format 3\x00 but then garbage" * 10,
                                     b"\x00" * 4096])
def test_a_file_that_is_not_a_store_is_refused_untouched(content, tmp_path, tiny_models):
    f = tmp_path / "results.sqlite"
    f.write_bytes(content)
    before = _fingerprint(f)
    (tmp_path / "c.txt").write_text(TEXT, encoding="utf-8")
    for args in (_eval_args(tiny_models("llama"), f, tmp_path / "c.txt"), ["report", str(f), "-o", "r.html"]):
        res = runner.invoke(app, args)
        one_line_error(res, str(f))
        assert res.exit_code == 1, res.output
        assert _fingerprint(f) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.txt", "results.sqlite"]  # no journal, no report


def test_a_sqlite_file_with_a_migrations_table_of_its_own_is_foreign(tmp_path):
    # Laravel's, say: same table name, other columns.
    db = tmp_path / "app.sqlite"
    with sqlite3.connect(db) as con:
        con.execute("CREATE TABLE migrations (id INTEGER PRIMARY KEY, migration TEXT, batch INTEGER)")
        con.execute("INSERT INTO migrations (migration, batch) VALUES ('2014_create_users', 1)")
    con.close()
    before = _fingerprint(db)
    with pytest.raises(ResultsStoreError, match="not an slmedge results store"):
        ResultsStore(db)
    assert _fingerprint(db) == before


def test_report_never_creates_or_converts_a_store(tmp_path):
    empty = tmp_path / "empty.sqlite"
    empty.write_bytes(b"")
    res = runner.invoke(app, ["report", str(empty), "-o", str(tmp_path / "r.html")])
    one_line_error(res, str(empty), "no results store")
    assert res.exit_code == 1 and empty.stat().st_size == 0
    missing = tmp_path / "missing.sqlite"
    res = runner.invoke(app, ["report", str(missing), "-o", str(tmp_path / "r.html")])
    one_line_error(res, str(missing), "no results store")
    assert res.exit_code == 1 and not missing.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.sqlite"]
    # The default store (the user data dir, or $SLMEDGE_RESULTS_DB) is not created either.
    res = runner.invoke(app, ["report", "-o", str(tmp_path / "r.html")], env={"SLMEDGE_RESULTS_DB": str(missing)})
    one_line_error(res, "no results store")
    assert not missing.exists()
    # evaluate/study may start a store in an empty file or at a missing path.
    for path in (empty, missing):
        store = ResultsStore(path)
        store.close()
        assert "migrations" in _tables(path) and "runs" in _tables(path)
    assert ResultsStoreError.exit_code == 1


def test_report_reads_the_store_read_only(tmp_path):
    db = tmp_path / "r.sqlite"
    store = ResultsStore(db)
    _fake_run(store, "tiny", "a.txt", 10.0)
    store.close()
    before = _fingerprint(db)
    res = runner.invoke(app, ["report", str(db), "-o", str(tmp_path / "r.html")])
    assert res.exit_code == 0, res.output
    assert _fingerprint(db) == before
    ro = ResultsStore(db, readonly=True)
    with pytest.raises(ResultsStoreError, match="read-only"):
        ro.add(1, "perplexity", 1.0)
    ro.close()


# --- failed evaluations ----------------------------------------------------------------------------


def test_an_evaluation_with_bad_input_leaves_no_run(tmp_path, tiny_models):
    db = tmp_path / "r.sqlite"
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n\n", encoding="utf-8")
    res = runner.invoke(app, _eval_args(tiny_models("llama"), db, empty))
    one_line_error(res, str(empty), "empty")
    assert res.exit_code == 1
    bad_task = tmp_path / "t.jsonl"
    bad_task.write_text(json.dumps({"query": "The sky is", "choices": ["blue", "green"], "gold": 0}) + "\n"
                        + json.dumps({"query": "Q", "choices": ["a"], "gold": 3}) + "\n", encoding="utf-8")
    res = runner.invoke(app, ["evaluate", str(tiny_models("llama")), "--metrics", "perplexity,tasks", "--langs", "",
                              "--seqlen", "32", "--ppl-windows", "1", "--tasks", str(bad_task),
                              "--results-db", str(db)])
    one_line_error(res, "t.jsonl:2", "gold 3")
    assert res.exit_code == 1
    assert _runs(db) == []  # neither evaluation recorded a run
    store = ResultsStore(db)
    assert store.rows(include_unfinished=True) == []
    store.close()


def test_the_run_is_recorded_only_after_every_input_was_read(tmp_path, tiny_models):
    from slmedge.errors import DataError
    from slmedge.evaluate.api import EvalSettings, Evaluation

    store = ResultsStore(tmp_path / "r.sqlite")
    good, empty = tmp_path / "a.txt", tmp_path / "empty.txt"
    good.write_text(TEXT, encoding="utf-8")
    empty.write_text("", encoding="utf-8")
    bad_task = tmp_path / "t.jsonl"
    bad_task.write_text('{"query": "Q", "choices": ["a", "b"], "gold": 0}\n{"query": "Q"}\n', encoding="utf-8")
    cases = [(dict(corpora=(str(good), str(empty))), "empty"),
             (dict(corpora=(str(good),), metrics=("perplexity", "tasks"), tasks=(str(bad_task),)), "t.jsonl:2")]
    for over, words in cases:
        settings = EvalSettings(**{**dict(metrics=("perplexity",), langs=(), wikitext=False, seqlen=32,
                                          ppl_windows=1), **over})
        ev = Evaluation(str(tiny_models("llama")), settings, store)
        with pytest.raises(DataError, match=words):
            ev.run()
        ev.close()
        assert ev.run_id is None
    assert _runs(store.path) == [] and store.rows(include_unfinished=True) == []
    store.close()


def test_an_evaluation_that_fails_midway_is_marked_failed_and_left_out_of_the_report(tmp_path, tiny_models,
                                                                                       monkeypatch):
    import importlib

    from slmedge.errors import DataError

    perplexity = importlib.import_module("slmedge.evaluate.perplexity")  # the module (the package exports a function of that name)

    db = tmp_path / "r.sqlite"
    good, short, later = tmp_path / "a.txt", tmp_path / "short.txt", tmp_path / "c.txt"
    good.write_text(TEXT, encoding="utf-8")
    short.write_text("Too short.", encoding="utf-8")  # fewer tokens than one window: refused before a run is recorded
    res = runner.invoke(app, _eval_args(tiny_models("llama"), db, good, short))
    one_line_error(res, "short.txt", "shorter than one window")
    assert res.exit_code == 1 and _runs(db) == []
    # A failure while measuring (the second corpus): the run is marked failed, its first numbers kept, marked.
    later.write_text(TEXT, encoding="utf-8")
    measured = perplexity.runtime_perplexity

    def second_fails(runtime, encoder, text, *args, **kwargs):
        if second_fails.calls:
            raise DataError("the second corpus failed while measuring")
        second_fails.calls += 1
        return measured(runtime, encoder, text, *args, **kwargs)

    second_fails.calls = 0
    with monkeypatch.context() as m:
        m.setattr(perplexity, "runtime_perplexity", second_fails)
        res = runner.invoke(app, _eval_args(tiny_models("llama"), db, good, later))
    one_line_error(res, "failed while measuring")
    assert res.exit_code == 1
    [(run_id, status, error)] = _runs(db)
    assert status == "failed" and "failed while measuring" in error
    store = ResultsStore(db)
    assert store.rows() == []  # by default only finished runs' results
    kept = store.rows(run_id)  # what it finished is kept, marked
    assert {r["metric"] for r in kept} == {"perplexity", "bits_per_byte"} and {r["status"] for r in kept} == {"failed"}
    assert {r["subset"] for r in store.rows(include_unfinished=True)} == {"a.txt"}
    store.close()
    out = tmp_path / "r.html"
    res = runner.invoke(app, ["report", str(db), "-o", str(out)])
    one_line_error(res, str(db), "no finished evaluations")
    assert res.exit_code == 1 and not out.exists()
    # A good evaluation joins it: the report shows that one only, and says one was left out.
    other = tmp_path / "b.txt"
    other.write_text(TEXT, encoding="utf-8")
    res = runner.invoke(app, _eval_args(tiny_models("llama"), db, other))
    assert res.exit_code == 0, res.output
    assert [s for _, s, _ in _runs(db)] == ["failed", "done"]
    res = runner.invoke(app, ["report", str(db), "-o", str(out)])
    assert res.exit_code == 0, res.output
    assert "1 evaluations" in res.output and "1 that failed or did not finish left out" in res.output
    html = out.read_text(encoding="utf-8")
    assert "<p>1 evaluations.</p>" in html and "1 evaluation that failed or did not finish is left out" in html
    assert "b.txt" in html and "a.txt" not in html  # the failed run's perplexity is not a column
    store = ResultsStore(db)
    assert {r["subset"] for r in store.rows()} == {"b.txt"}
    store.close()


def test_a_run_still_running_or_without_results_is_not_an_evaluation(tmp_path):
    db = tmp_path / "r.sqlite"
    store = ResultsStore(db)
    _fake_run(store, "tiny", "done.txt", 10.0)
    _fake_run(store, "tiny", "running.txt", 11.0, status="running")
    store.end_run(store.begin_run("tiny", None, "torch", 1, "cpu", {}, {}))  # done, but nothing measured
    store.close()
    md = tmp_path / "r.md"
    res = runner.invoke(app, ["report", str(db), "--format", "md", "-o", str(md)])
    assert res.exit_code == 0, res.output
    text = md.read_text(encoding="utf-8")
    assert "1 evaluations." in text and "2 evaluations that failed or did not finish are left out" in text
    assert "done.txt" in text and "running.txt" not in text


def test_a_study_evaluation_is_recorded_as_done(tmp_path, tiny_models):
    from slmedge.study.engine import run_study
    from slmedge.study.report import load_rows
    from slmedge.study.spec import load_study

    store = ResultsStore(tmp_path / "s.sqlite")
    counts = run_study(load_study(_study_file(tmp_path, tiny_models("llama"))), store, workers=1)
    assert counts["ran"] == 1 and counts["failed"] == 0
    [(_, status, error)] = _runs(store.path)
    assert (status, error) == ("done", None)
    assert len(load_rows(store, "s")) == 1 and {r["status"] for r in store.rows()} == {"done"}
    store.close()


# --- a store written by the previous schema --------------------------------------------------------------


def _old_store(path: Path) -> Path:
    """A store as slmedge wrote it before run statuses: migrations 0001-0003 only, with rows,
    and a run without results (a failed evaluation of that time)."""
    with sqlite3.connect(path) as con:
        con.execute("CREATE TABLE migrations (name TEXT PRIMARY KEY, applied_at TEXT NOT NULL)")
        for name, sql in MIGRATIONS[:3]:
            con.executescript(f"BEGIN; {sql}; INSERT INTO migrations VALUES ('{name}', '2025-01-01T00:00:00Z'); COMMIT;")
        for model in ("old-model", "old-empty"):
            con.execute("INSERT INTO runs (started_at, model, artifact_sha256, runtime, threads, target, emulated, "
                        "versions, settings) VALUES ('2025-01-01T00:00:00Z', ?, NULL, 'torch', 2, 'cpu', 0, '{}', "
                        "'{\"seqlen\": 64, \"ppl_windows\": 2}')", (model,))
        con.execute("INSERT INTO results (run_id, metric, subset, value, stderr, unit, extra, recorded_at) "
                    "VALUES (1, 'perplexity', 'oldcorpus.txt', 42.5, 0.5, 'ppl', NULL, '2025-01-01T00:00:00Z')")
    con.close()
    assert "0004_run_status" in dict(MIGRATIONS) and len(MIGRATIONS) > 3
    return path


def test_a_store_of_the_previous_schema_is_read_then_upgraded(tmp_path):
    db = _old_store(tmp_path / "old.sqlite")
    before = _fingerprint(db)
    out = tmp_path / "r.html"
    res = runner.invoke(app, ["report", str(db), "-o", str(out)])  # read through a copy: not upgraded
    assert res.exit_code == 0, res.output
    assert _fingerprint(db) == before
    html = out.read_text(encoding="utf-8")
    assert "<p>1 evaluations.</p>" in html and "oldcorpus.txt" in html and "42.50" in html
    assert "old-empty" not in html and "1 evaluation that failed or did not finish is left out" in html
    store = ResultsStore(db)  # a writing command upgrades it
    with sqlite3.connect(db) as con:
        assert [r[0] for r in con.execute("SELECT name FROM migrations ORDER BY rowid")] == [n for n, _ in MIGRATIONS]
    assert [(r["run"], r["status"], r["value"]) for r in store.rows()] == [(1, "done", 42.5)]
    assert store.run_status(1) == ("done", None) and store.run_status(2) == ("done", None)
    new = _fake_run(store, "new-model", "oldcorpus.txt", 40.0)
    assert store.run_status(new) == ("done", None)
    store.close()


# --- report -o ------------------------------------------------------------------------------------


def _reportable_store(tmp_path: Path) -> ResultsStore:
    store = ResultsStore(tmp_path / "r.sqlite")
    _fake_run(store, "tiny", "a.txt", 10.0)
    return store


def test_report_replaces_only_its_own_report_and_only_with_overwrite(tmp_path):
    from slmedge.study.report import is_report

    store = _reportable_store(tmp_path)
    store.close()
    db = str(store.path)
    foreign = tmp_path / "notes.html"
    foreign.write_text("<!doctype html><html><body>my own notes about slmedge-report</body></html>", encoding="utf-8")
    before = _fingerprint(foreign)
    for extra in ([], ["--overwrite"]):
        res = runner.invoke(app, ["report", db, "-o", str(foreign), *extra])
        one_line_error(res, str(foreign))
        assert res.exit_code == 1, res.output
        assert _fingerprint(foreign) == before
    assert "not a report slmedge wrote" in res.output
    # The store itself is never a report output.
    res = runner.invoke(app, ["report", db, "-o", db, "--overwrite"])
    one_line_error(res, db)
    ours = tmp_path / "r.html"
    assert runner.invoke(app, ["report", db, "-o", str(ours)]).exit_code == 0
    assert is_report(ours)
    first = ours.read_text(encoding="utf-8")
    assert first.startswith("<!doctype html><!-- slmedge-report ") and "1 evaluations" in first
    store = ResultsStore(db)
    _fake_run(store, "tiny", "z.txt", 12.0)
    store.close()
    res = runner.invoke(app, ["report", db, "-o", str(ours)])
    one_line_error(res, str(ours), "--overwrite")
    assert ours.read_text(encoding="utf-8") == first
    res = runner.invoke(app, ["report", db, "-o", str(ours), "--overwrite"])
    assert res.exit_code == 0, res.output
    assert "2 evaluations" in ours.read_text(encoding="utf-8")
    assert not [p for p in tmp_path.iterdir() if ".slmedge-tmp-" in p.name]


def test_a_markdown_report_and_its_plots_are_replaced_only_when_ours(tmp_path):
    from slmedge.study.report import is_report, write_report

    store = _reportable_store(tmp_path)
    md = tmp_path / "r.md"
    write_report(store, md, "md")
    assert md.read_text(encoding="utf-8").startswith("<!-- slmedge-report ") and is_report(md)
    figs = tmp_path / "r_files"
    names = sorted(p.name for p in figs.iterdir())
    assert names[-1] == "slmedge-report.json" and names[:-1] == [f"plot{i + 1}.png" for i in range(len(names) - 1)]
    assert len(names) >= 3  # perplexity against compression level, the Pareto front by size
    assert all(f"](r_files/{n})" in md.read_text(encoding="utf-8") for n in names[:-1])
    with pytest.raises(OutputExistsError, match="--overwrite"):
        write_report(store, md, "md")
    write_report(store, md, "md", overwrite=True)  # ours: replaced
    # A plot folder holding a file of the user's is never replaced, even with --overwrite.
    (figs / "my-photo.png").write_bytes(b"mine")
    res = runner.invoke(app, ["report", str(store.path), "--format", "md", "-o", str(md), "--overwrite"])
    one_line_error(res, str(figs))
    assert (figs / "my-photo.png").read_bytes() == b"mine"
    # A foreign Markdown file is refused with or without --overwrite.
    notes = tmp_path / "notes.md"
    notes.write_text("# my notes\n", encoding="utf-8")
    for overwrite in (False, True):
        with pytest.raises(OutputExistsError):
            write_report(store, notes, "md", overwrite=overwrite)
    assert notes.read_text(encoding="utf-8") == "# my notes\n" and not (tmp_path / "notes_files").exists()
    store.close()


def test_a_failed_write_names_the_report_not_its_temporary_file(tmp_path, monkeypatch):
    import slmedge.fsutil as fsutil

    store = _reportable_store(tmp_path)
    store.close()
    out = tmp_path / "r.html"
    assert runner.invoke(app, ["report", str(store.path), "-o", str(out)]).exit_code == 0
    first = out.read_bytes()

    def refuse(src, dst):
        raise PermissionError(13, "Permission denied", str(src))

    monkeypatch.setattr(fsutil.os, "replace", refuse)
    res = runner.invoke(app, ["report", str(store.path), "-o", str(out), "--overwrite"])
    one_line_error(res, str(out), "Permission denied")
    assert ".slmedge-tmp-" not in res.output
    assert out.read_bytes() == first
    assert not [p for p in tmp_path.iterdir() if ".slmedge-tmp-" in p.name]


def test_a_gguf_base_is_recognised_by_its_source_kind(tmp_path):
    from slmedge.study.report import caveats

    base = tmp_path / "my-base.gguf"
    base.write_bytes(b"GGUF")  # resolve() goes by what is on disk; nothing is loaded

    def row(model, study="s"):
        return {"study": study, "labels": {"model": model}, "emulated": False, "settings": {}, "metrics": {}}

    text = " ".join(caveats([row(str(base))]))
    assert "The base model my-base.gguf is a GGUF file dequantized to fp32" in text  # its name: no local path
    assert str(tmp_path) not in text
    assert "SmolLM2" not in text  # not the embedded model's caveat
    assert "is a GGUF file" not in " ".join(caveats([row(str(tmp_path / "gone.gguf"))]))  # names nothing now
    assert "is a GGUF file" not in " ".join(caveats([row(str(base), study=None)]))  # a plain run: what was evaluated
    assert "SmolLM2-135M baseline" in " ".join(caveats([row("smollm2-135m")]))
