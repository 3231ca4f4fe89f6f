"""A results store whose writer was killed in the middle of a transaction (kill -9, the out-of-memory
killer, a power loss) has a hot journal beside it: the pages as they were before the transaction. A
read-only SQLite connection cannot roll it back ("attempt to write a readonly database"). Every
command that reads the store meets it as the store of its last commit, nothing committed lost: the
read-write ones roll the journal back in place, ``slmedge report`` (which never changes the store)
reads a rolled-back copy.

The hot journal is real: a process writing through the store's own transaction (``writing``), with a
cache of two pages so that its changes reach the file before the commit, is killed with SIGKILL.
"""

import os
import shutil
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from running import wait_for

from conftest import study_data_files, tiny_study_file
from slmedge.evaluate import store as store_mod
from slmedge.evaluate.store import ResultsStore, ResultsStoreError

WRITER = """
import pathlib, sys, time
from slmedge.evaluate.store import ResultsStore
store = ResultsStore(sys.argv[1])
store.db.execute("PRAGMA cache_size = 2")  # changed pages spill into the file before the commit
with store.writing() as db:
    for i in range(400):
        db.execute("INSERT INTO results (run_id, metric, value, extra, recorded_at) VALUES (1, 'half', 0, ?, 't')",
                   ("x" * 2000,))
    pathlib.Path(sys.argv[2]).write_text("in the transaction")
    time.sleep(120)
"""


def _killed_mid_transaction(db: Path, tmp_path: Path) -> Path:
    """Kill a writer of ``db`` with SIGKILL inside a transaction; the hot journal it leaves."""
    ready = tmp_path / "writing"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(db), str(ready)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    wait_for(ready, proc, timeout=120)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    journal = db.with_name(db.name + "-journal")
    assert journal.is_file() and journal.stat().st_size > 0
    with pytest.raises(sqlite3.OperationalError, match="readonly"):  # what a read-only open meets
        sqlite3.connect(db.resolve().as_uri() + "?mode=ro", uri=True).execute("SELECT COUNT(*) FROM runs")
    return journal


def _committed(db: Path) -> list[tuple]:
    """Every row of the store's tables as committed (read through a read-write connection of a copy)."""
    out = []
    with sqlite3.connect(db) as con:
        for table in ("runs", "results", "study_jobs", "study_events", "migrations"):
            out += [(table, *r) for r in con.execute(f"SELECT * FROM {table} ORDER BY rowid")]
    return out


def _slmedge(*args, cwd):
    return subprocess.run([sys.executable, "-m", "slmedge", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=900)


@pytest.fixture(scope="module")
def hot_store(tiny_models, exports, tmp_path_factory):
    """A store holding a finished study (its jobs and the evaluations' runs) and a hot journal beside it:
    (folder, study file, the store's bytes, the journal's bytes, its committed rows)."""
    root = tmp_path_factory.mktemp("hot")
    db = root / "db.sqlite"
    f = tiny_study_file(root, tiny_models("llama"), "hot", ['label = "rtn"\nmethod = "rtn"\nbits = 4\ngroup_size = 32'])
    r = _slmedge("study", str(f), "--results-db", str(db), cwd=root)
    assert r.returncode == 0, r.stderr[-2000:]
    before = db.read_bytes()
    committed = _committed(db)
    assert any(row[0] == "study_jobs" for row in committed) and any(row[0] == "results" for row in committed)
    journal = _killed_mid_transaction(db, root)
    assert db.read_bytes() != before, "the killed writer's pages reached the file"
    return root, f, db.read_bytes(), journal.read_bytes(), committed


def _restore(hot, tmp_path: Path) -> Path:
    """The hot store (and its journal) copied into ``tmp_path``, as the killed writer left it."""
    _, _, data, journal, _ = hot
    db = tmp_path / "db.sqlite"
    db.write_bytes(data)
    db.with_name(db.name + "-journal").write_bytes(journal)
    return db


def test_the_stores_readers_see_the_last_commit(hot_store, tmp_path):
    committed = hot_store[4]
    db = _restore(hot_store, tmp_path)
    ro = ResultsStore(db, readonly=True)  # report's way: reads a rolled-back copy, changes nothing
    try:
        assert ro.rows() and not [r for r in ro.rows(include_unfinished=True) if r["metric"] == "half"]
    finally:
        ro.close()
    assert db.read_bytes() == hot_store[2] and db.with_name("db.sqlite-journal").is_file()
    rw = ResultsStore(db)  # evaluate's, study's, the supervisor's way: rolled back in place
    try:
        assert rw.rows() == ResultsStore(db, readonly=True).rows()
    finally:
        rw.close()
    assert not db.with_name("db.sqlite-journal").exists() and _committed(db) == committed


def test_report_reads_it_and_leaves_it_as_it_is(hot_store, tmp_path):
    db = _restore(hot_store, tmp_path)
    r = _slmedge("report", str(db), "--format", "md", "-o", str(tmp_path / "r.md"), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "rtn" in (tmp_path / "r.md").read_text()
    assert db.read_bytes() == hot_store[2] and db.with_name("db.sqlite-journal").read_bytes() == hot_store[3]


def test_a_study_resumes_on_it(hot_store, tmp_path):
    root, f, _, _, committed = hot_store
    db = _restore(hot_store, root)  # where the study ran: its jobs are known by their place
    r = _slmedge("study", str(f), "--results-db", str(db), cwd=root)
    assert r.returncode == 0, r.stderr
    assert not db.with_name("db.sqlite-journal").exists()
    after = _committed(db)
    kept = [row for row in committed if row[0] in ("runs", "results", "migrations")]
    assert set(kept) <= set(after) and not [row for row in after if "half" in row]
    with sqlite3.connect(db) as con:  # (a job reruns only where slmedge's own code changed since: its key)
        assert {s for (s,) in con.execute("SELECT status FROM study_jobs")} == {"done"}


def test_an_evaluation_records_into_it(hot_store, exports, tmp_path):
    committed = hot_store[4]
    db = _restore(hot_store, tmp_path)
    corpus, _ = study_data_files(tmp_path)
    r = _slmedge("evaluate", exports["llama.cpp"], "--metrics", "perplexity", "--langs", "", "--no-wikitext",
                 "--corpus", str(corpus), "--seqlen", "32", "--ppl-windows", "1", "--results-db", str(db), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    after = _committed(db)
    assert set(committed) <= set(after)
    runs = [row for row in after if row[0] == "runs"]
    assert len(runs) == sum(row[0] == "runs" for row in committed) + 1


def test_another_programs_database_with_a_hot_journal_is_left_as_it_is(tmp_path):
    db = tmp_path / "other.sqlite"
    with sqlite3.connect(db) as con:
        con.execute("CREATE TABLE migrations (name TEXT, applied_at TEXT)")  # not slmedge's: no migration rows
        con.execute("CREATE TABLE results (x)")
    shutil.copyfile(db, tmp_path / "kept")
    writer = WRITER.replace("from slmedge.evaluate.store import ResultsStore\nstore = ResultsStore(sys.argv[1])\n",
                            "import sqlite3\nclass S:\n    db = sqlite3.connect(sys.argv[1])\n"
                            "    def writing(self):\n        return self.db\nstore = S()\n")
    writer = writer.replace("INSERT INTO results (run_id, metric, value, extra, recorded_at) VALUES "
                            "(1, 'half', 0, ?, 't')", "INSERT INTO results VALUES (?)")
    ready = tmp_path / "writing"
    proc = subprocess.Popen([sys.executable, "-c", writer, str(db), str(ready)])
    wait_for(ready, proc, timeout=120)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    journal = db.with_name(db.name + "-journal")
    data, jdata = db.read_bytes(), journal.read_bytes()
    for readonly in (False, True):
        with pytest.raises(ResultsStoreError, match="is not an slmedge results store"):
            ResultsStore(db, readonly=readonly)
        assert db.read_bytes() == data and journal.read_bytes() == jdata


def test_where_it_cannot_be_written_the_error_says_what_to_do(hot_store, tmp_path, monkeypatch):
    """A store in a read-only place (as root, the folder's mode would not stop the write; the check is
    made to say no): evaluate and study refuse it in one line naming the journal and the way out;
    report reads it."""
    db = _restore(hot_store, tmp_path)
    monkeypatch.setattr(store_mod.os, "access", lambda p, mode: False)
    with pytest.raises(ResultsStoreError, match=r"db\.sqlite-journal beside it.*copy db\.sqlite and "
                                                r"db\.sqlite-journal together into a folder you can write"):
        ResultsStore(db)
    assert db.read_bytes() == hot_store[2]
    ro = ResultsStore(db, readonly=True)
    assert ro.rows()
    ro.close()
