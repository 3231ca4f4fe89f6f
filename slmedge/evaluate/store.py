"""The results store: SQLite, one row per metric, append-only named migrations.

Path: ``--results-db``, else ``$SLMEDGE_RESULTS_DB``, else ``<user data dir>/slmedge/results.sqlite``.
Every row carries its run (model, artifact hash, runtime, threads, target, versions), and rows are
committed as each metric finishes, so an interrupted evaluation keeps what it finished. A run has
a status: ``running`` while it is measured, ``done`` once every metric finished, ``failed`` (with
the error) when it stopped; readers take ``done`` runs unless asked for the others.

Migrations are applied in order and recorded by name; a database written by a newer slmedge
(with migrations this one does not know) is refused rather than altered. A file that is not an
slmedge store (a text file, another program's SQLite database) is refused before anything is
written to it, so it is left byte for byte as it was. Opened with ``readonly=True`` (``slmedge
report``) the file is opened read-only and never created or upgraded: a store written by an
older slmedge is read through an upgraded copy in memory.

A writer killed in the middle of a transaction leaves a hot journal beside the store; the next
read-write open rolls it back (the store as of its last commit, nothing committed lost), and a
read-only one reads a rolled-back copy (``_recover``, ``_rolled_back``).
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import time
from pathlib import Path

from platformdirs import user_data_dir

from ..errors import SlmedgeError
from ..fsutil import disk_full, no_space

ENV = "SLMEDGE_RESULTS_DB"

MIGRATIONS: list[tuple[str, str]] = [
    ("0001_runs_and_results", """
        CREATE TABLE runs (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            started_at TEXT NOT NULL,
            model TEXT NOT NULL,
            artifact_sha256 TEXT,
            runtime TEXT NOT NULL,
            threads INTEGER,
            target TEXT NOT NULL,
            emulated INTEGER NOT NULL DEFAULT 0,
            versions TEXT NOT NULL,
            settings TEXT NOT NULL
        );
        CREATE TABLE results (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            run_id INTEGER NOT NULL REFERENCES runs(id),
            metric TEXT NOT NULL,
            subset TEXT NOT NULL DEFAULT '',
            value REAL,
            stderr REAL,
            unit TEXT,
            extra TEXT,
            recorded_at TEXT NOT NULL
        );
        CREATE INDEX results_by_run ON results(run_id);
    """),
    ("0002_study_jobs", """
        CREATE TABLE study_jobs (
            study TEXT NOT NULL,
            job_id TEXT NOT NULL,
            kind TEXT NOT NULL,
            spec TEXT NOT NULL,
            labels TEXT NOT NULL,
            deps TEXT NOT NULL,
            status TEXT NOT NULL DEFAULT 'pending',
            output TEXT,
            run_id INTEGER REFERENCES runs(id),
            seconds REAL,
            finished_at TEXT,
            PRIMARY KEY (study, job_id)
        );
        CREATE TABLE study_events (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            study TEXT NOT NULL,
            job_id TEXT NOT NULL,
            event TEXT NOT NULL,
            detail TEXT,
            at TEXT NOT NULL
        );
    """),
    # Jobs that the study file no longer asks for (a setting changed) stay recorded, out of the grid.
    ("0003_study_jobs_in_grid", """
        ALTER TABLE study_jobs ADD COLUMN in_grid INTEGER NOT NULL DEFAULT 1;
    """),
    # A run is 'running' while measured, 'done' when every metric finished, 'failed' (with its
    # error) when it stopped. Runs recorded before this migration were only ever written by
    # evaluations, so they read as done.
    ("0004_run_status", """
        ALTER TABLE runs ADD COLUMN status TEXT NOT NULL DEFAULT 'done'
            CHECK (status IN ('running', 'done', 'failed'));
        ALTER TABLE runs ADD COLUMN error TEXT;
        ALTER TABLE runs ADD COLUMN finished_at TEXT;
    """),
    # What a finished study job made, kept in the store (JSON): a compress job's compression level,
    # an export's type, size and whether its codes were kept, an evaluation's compression level of
    # what it evaluated. The report reads them here, so a deleted artifact keeps its place in it.
    ("0005_study_job_facts", """
        ALTER TABLE study_jobs ADD COLUMN facts TEXT;
    """),
]

RUN_STATUSES = ("running", "done", "failed")
_SQLITE_MAGIC = b"SQLite format 3\x00"
# Tables each migration creates: a database claiming a migration must hold its tables.
_TABLES = {"0001_runs_and_results": {"runs", "results"}, "0002_study_jobs": {"study_jobs", "study_events"}}


class ResultsStoreError(SlmedgeError):
    """The results database is missing, is not an slmedge store, cannot be opened, is newer than
    this slmedge, or holds nothing of what was asked."""

    exit_code = 1


def default_path() -> Path:
    env = os.environ.get(ENV)
    return Path(env).expanduser() if env else Path(user_data_dir("slmedge")) / "results.sqlite"


def _foreign(path: Path, why: str) -> ResultsStoreError:
    return ResultsStoreError(f"{path} is not an slmedge results store ({why}); it was left untouched: "
                             "give another results store")


def inspect_file(path: Path, recover: bool = True) -> list[str] | None:
    """What ``path`` holds, read without writing anything: None when it is missing or empty (a
    store may be created there), else the migrations slmedge applied to it. A file that is not an
    slmedge store raises :class:`ResultsStoreError`, and is not modified. A store a stopped writer
    left a hot journal beside is rolled back to its last commit first (``_recover``); with
    ``recover=False`` that raises ``_Unfinished`` instead."""
    if not path.exists():
        return None
    if path.is_dir():
        raise ResultsStoreError(f"{path} is a directory, not an slmedge results store")
    try:
        with open(path, "rb") as handle:
            head = handle.read(len(_SQLITE_MAGIC))
    except OSError as exc:
        raise ResultsStoreError(f"cannot read the results store {path}: {exc.strerror or exc}") from exc
    if not head:
        return None
    if head != _SQLITE_MAGIC:
        raise _foreign(path, "not an SQLite database")
    try:
        tables, applied = _migrations_of(path, _ro_uri(path))
    except _Unfinished:
        if not recover:
            raise
        tables, applied = _recover(path)
    return _applied_of(path, tables, applied)


def _applied_of(path: Path, tables: set[str], applied: list[str]) -> list[str]:
    """``applied``, checked: refused when the migrations or tables are not slmedge's, or newer."""
    known = [name for name, _ in MIGRATIONS]
    if not applied:
        # slmedge creates the migrations table, then the first migration: a crash between leaves this.
        if tables - {"migrations"}:
            raise _foreign(path, "an SQLite database with tables of its own and no slmedge migration")
        return applied
    if known[0] not in applied:
        raise _foreign(path, f"its migrations ({', '.join(applied[:3])}) are not slmedge's")
    unknown = [a for a in applied if a not in known]
    if unknown:
        raise ResultsStoreError(f"{path} was written by a newer slmedge (migration {sorted(unknown)[-1]}); "
                                "upgrade slmedge or use another --results-db")
    missing = set().union(*(_TABLES.get(a, set()) for a in applied)) - tables
    if missing:
        raise _foreign(path, f"its migrations are slmedge's but its tables {', '.join(sorted(missing))} are gone")
    return applied


class _Unfinished(Exception):
    """A read-only connection met a hot journal: a writer died mid-transaction (``_recover``)."""


def _migrations_of(path: Path, uri: str, shown: Path | None = None) -> tuple[set[str], list[str]]:
    """(tables, applied migrations) of the SQLite file at ``uri``, refused when not an slmedge store."""
    shown = shown or path
    try:
        con = sqlite3.connect(uri, uri=True, timeout=60)
    except sqlite3.Error as exc:
        raise ResultsStoreError(f"cannot open the results store {shown}: {exc}") from exc
    try:
        tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
                  if not r[0].startswith("sqlite_")}
        if "migrations" not in tables:
            raise _foreign(shown, "an SQLite database without slmedge's migrations table")
        columns = {r[1] for r in con.execute("PRAGMA table_info(migrations)")}
        if columns != {"name", "applied_at"}:
            raise _foreign(shown, "its migrations table is not slmedge's")
        return tables, [r[0] for r in con.execute("SELECT name FROM migrations ORDER BY rowid")]
    except sqlite3.OperationalError as exc:
        if getattr(exc, "sqlite_errorname", "") == "SQLITE_READONLY_ROLLBACK" or "readonly database" in str(exc):
            raise _Unfinished() from exc
        raise _foreign(shown, f"SQLite cannot read it: {exc}") from exc
    except sqlite3.DatabaseError as exc:
        raise _foreign(shown, f"SQLite cannot read it: {exc}") from exc
    finally:
        con.close()


def _rolled_back(path: Path) -> tuple[sqlite3.Connection, set[str], list[str]]:
    """The store at ``path`` as of its last commit, in memory: the file and its hot journal copied
    into a temporary folder, where a read-write connection rolls the journal back (``_recover``);
    with its tables and applied migrations. ``path`` and its journal are not touched."""
    import shutil
    import tempfile

    journal = path.with_name(path.name + "-journal")
    with tempfile.TemporaryDirectory(prefix="slmedge-store-") as tmp:
        copy = Path(tmp) / "store.sqlite"
        try:
            shutil.copyfile(path, copy)
            shutil.copyfile(journal, copy.with_name(copy.name + "-journal"))
        except FileNotFoundError:  # the journal went meanwhile (another process rolled it back)
            copy.with_name(copy.name + "-journal").unlink(missing_ok=True)
        except OSError as exc:
            raise ResultsStoreError(f"cannot read the results store {path}: {exc.strerror or exc}") from exc
        try:
            tables, applied = _migrations_of(copy, copy.as_uri(), shown=path)  # read-write: rolled back here
        except _Unfinished:
            raise ResultsStoreError(f"cannot undo the unfinished write in a copy of {path}") from None
        disk = sqlite3.connect(str(copy))
        try:
            memory = sqlite3.connect(":memory:")
            disk.backup(memory)
        finally:
            disk.close()
    return memory, tables, applied


def _recover(path: Path) -> tuple[set[str], list[str]]:
    """A store whose writer died in the middle of a transaction (``kill -9``, the out-of-memory killer,
    a power loss) has a hot journal beside it (``NAME-journal``: the pages as they were before); a
    read-only connection cannot roll it back ("attempt to write a readonly database"). SQLite rolls
    it back on the first read of a read-write connection: the store is then as it was at its last
    commit, nothing committed lost. That is done here, once a rolled-back copy has shown the file to
    be an slmedge store (another program's database is left as it is). Where the file or its folder
    cannot be written, the error says what to do (``slmedge report`` reads the copy instead)."""
    memory, tables, applied = _rolled_back(path)
    memory.close()
    _applied_of(path, tables, applied)  # refuses what is not ours, untouched
    journal = path.with_name(path.name + "-journal")
    try:
        if not (os.access(path, os.W_OK) and os.access(path.parent, os.W_OK)):
            raise PermissionError(path)
        con = sqlite3.connect(str(path), timeout=60)
        try:
            con.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()  # rolls the hot journal back
        finally:
            con.close()
    except (OSError, sqlite3.Error):
        raise ResultsStoreError(
            f"the results store {path} holds a write that a stopped process left unfinished ({journal.name} beside "
            f"it), which cannot be undone where the store is (the file or {path.parent} cannot be written): make "
            f"them writable, or copy {path.name} and {journal.name} together into a folder you can write and use "
            "that copy; slmedge undoes the write when it opens it, and loses nothing recorded before "
            "(slmedge report reads it as it is)"
        ) from None
    return _migrations_of(path, _ro_uri(path))


def _ro_uri(path: Path) -> str:
    return path.resolve().as_uri() + "?mode=ro"


class ResultsStore:
    """The store at ``path`` (default: ``default_path()``).

    ``readonly=False`` (evaluate, study, run): a missing or empty file becomes a new store and an
    older store is upgraded in place. ``readonly=True`` (report): the file must already be an
    slmedge store; it is opened read-only and nothing is ever written to it."""

    def __init__(self, path: Path | str | None = None, readonly: bool = False):
        self.path = Path(path).expanduser() if path else default_path()
        self.readonly = readonly
        if readonly:
            try:
                applied = inspect_file(self.path, recover=False)
            except _Unfinished:  # a stopped writer's hot journal: read the store as of its last commit
                memory, tables, applied = _rolled_back(self.path)
                self._open_readonly(_applied_of(self.path, tables, applied), memory)
                return
            if applied is None:
                what = "is empty" if self.path.exists() else "does not exist"
                raise ResultsStoreError(f"no results store at {self.path} (the file {what}); nothing was created")
            self._open_readonly(applied)
            return
        applied = inspect_file(self.path)  # refuses what is not ours before anything is written
        created = applied is None and not self.path.exists()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.db = sqlite3.connect(str(self.path), timeout=60)
        except (OSError, sqlite3.Error) as exc:
            raise ResultsStoreError(f"cannot open the results store {self.path}: {exc}") from exc
        try:
            self._migrate(self.db)
        except sqlite3.DatabaseError as exc:
            self.db.close()
            if created:  # a store this call began: nothing of it is left to look like one
                for leftover in (self.path, self.path.with_name(self.path.name + "-journal")):
                    leftover.unlink(missing_ok=True)
            if disk_full(exc):  # a new store's tables: a few pages each, written twice (the journal)
                raise no_space(self.path, 2 * 4096 * 16, left="no results were recorded") from exc
            raise ResultsStoreError(f"cannot write the results store {self.path} ({exc})") from exc

    def _open_readonly(self, applied: list[str], disk: sqlite3.Connection | None = None) -> None:
        if disk is None:
            try:
                disk = sqlite3.connect(_ro_uri(self.path), uri=True, timeout=60)
            except sqlite3.Error as exc:
                raise ResultsStoreError(f"cannot open the results store {self.path}: {exc}") from exc
        if len(applied) == len(MIGRATIONS):
            self.db = disk
            return
        # An older store: read an upgraded copy, leave the file as it is.
        try:
            self.db = sqlite3.connect(":memory:")
            disk.backup(self.db)
            self._migrate(self.db)
        except sqlite3.Error as exc:
            raise ResultsStoreError(f"cannot read the results store {self.path}: {exc}") from exc
        finally:
            disk.close()

    def _migrate(self, db) -> None:
        db.execute("CREATE TABLE IF NOT EXISTS migrations (name TEXT PRIMARY KEY, applied_at TEXT NOT NULL)")
        applied = {row[0] for row in db.execute("SELECT name FROM migrations")}
        known = {name for name, _ in MIGRATIONS}
        unknown = applied - known
        if unknown:
            raise ResultsStoreError(f"{self.path} was written by a newer slmedge (migration {sorted(unknown)[-1]}); "
                                    "upgrade slmedge or use another --results-db")
        for name, sql in MIGRATIONS:
            if name in applied:
                continue
            # The migration and its record in one transaction: a crash leaves neither.
            db.executescript(f"BEGIN; {sql}; INSERT INTO migrations VALUES ('{name}', '{_now()}'); COMMIT;")

    def _writable(self) -> None:
        if self.readonly:
            raise ResultsStoreError(f"the results store {self.path} was opened read-only")

    @contextlib.contextmanager
    def writing(self, nbytes: int = 0):
        """One write transaction of about ``nbytes`` of data (committed on leaving). A full disk is a
        DiskFullError naming the store and about what the write needed (its data, and a page of the
        table and one of its index each written twice: the rollback journal keeps the old page),
        and the transaction is rolled back: the store keeps what it held before."""
        try:
            with self.db:
                yield self.db
        except sqlite3.OperationalError as exc:
            if not disk_full(exc):
                raise
            page = self.db.execute("PRAGMA page_size").fetchone()[0]
            raise no_space(self.path, 2 * (nbytes + 2 * page),
                           left="the results recorded before are kept, this one was not recorded") from exc

    # --- runs ---------------------------------------------------------------------------------

    def start_run(self, model: str, artifact_sha256: str | None, runtime: str, threads: int, target: str,
                  versions: dict, settings: dict, emulated: bool = False, status: str = "done") -> int:
        """Record a run whose rows follow. As before run statuses existed, the run counts as done
        (the study engine replays a finished evaluation's rows through here); an evaluation that
        is still being measured is recorded with ``begin_run`` and ended with ``end_run``."""
        self._writable()
        if status not in RUN_STATUSES:
            raise ValueError(f"run status must be one of {RUN_STATUSES}, not {status!r}")
        texts = (json.dumps(versions, sort_keys=True), json.dumps(settings, sort_keys=True, default=str))
        with self.writing(sum(len(t) for t in texts) + 256) as db:
            cur = db.execute(
                "INSERT INTO runs (started_at, model, artifact_sha256, runtime, threads, target, emulated, versions, "
                "settings, status, finished_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (_now(), model, artifact_sha256, runtime, threads, target, int(emulated), *texts, status,
                 None if status == "running" else _now()))
        return int(cur.lastrowid)

    def begin_run(self, *args, **kwargs) -> int:
        """``start_run``'s arguments; the run is 'running' until ``end_run``. (A supervising parent that
        sees this process die marks it failed: ``slmedge.procs.note``.)"""
        from ..procs import note

        run_id = self.start_run(*args, **{**kwargs, "status": "running"})
        note("run", [str(self.path), run_id])
        return run_id

    def end_run(self, run_id: int, error: str | None = None) -> None:
        """Mark a run done, or failed with ``error`` (one line kept)."""
        from ..procs import note

        self._writable()
        status = "done" if error is None else "failed"
        with self.writing(len(str(error or "")) + 64) as db:
            db.execute("UPDATE runs SET status = ?, error = ?, finished_at = ? WHERE id = ?",
                            (status, None if error is None else str(error)[:2000], _now(), run_id))
        note("run", None)

    def run_status(self, run_id: int) -> tuple[str, str | None] | None:
        """(status, error) of a run; None when there is no such run."""
        row = self.db.execute("SELECT status, error FROM runs WHERE id = ?", (run_id,)).fetchone()
        return None if row is None else (row[0], row[1])

    def add(self, run_id: int, metric: str, value, subset: str = "", stderr=None, unit: str | None = None,
            extra: dict | None = None) -> None:
        self._writable()
        text = json.dumps(extra, sort_keys=True, default=str) if extra else None
        with self.writing(len(text or "") + len(metric) + len(subset) + 128) as db:  # a commit per row: nothing
            db.execute(                                                      # finished is lost on an interrupt
                "INSERT INTO results (run_id, metric, subset, value, stderr, unit, extra, recorded_at) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (run_id, metric, subset, None if value is None else float(value),
                 None if stderr is None else float(stderr), unit, text, _now()))

    def rows(self, run_id: int | None = None, include_unfinished: bool = False) -> list[dict]:
        """One dict per result row, each with its run's ``status`` (``extra``: the row's extra dict, or None).
        The rows of one run whatever its status (``run_id``); else those of finished ('done') runs only,
        unless ``include_unfinished``."""
        sql = ("SELECT r.id, r.model, r.artifact_sha256, r.runtime, r.threads, r.target, r.emulated, r.status, "
               "x.metric, x.subset, x.value, x.stderr, x.unit, x.extra FROM results x JOIN runs r ON r.id = x.run_id")
        args: tuple = ()
        if run_id is not None:
            sql += " WHERE r.id = ?"
            args = (run_id,)
        elif not include_unfinished:
            sql += " WHERE r.status = 'done'"
        cols = ["run", "model", "artifact_sha256", "runtime", "threads", "target", "emulated", "status", "metric",
                "subset", "value", "stderr", "unit", "extra"]
        out = [dict(zip(cols, row)) for row in self.db.execute(sql + " ORDER BY x.id", args)]
        for r in out:
            r["extra"] = json.loads(r["extra"]) if r["extra"] else None
        return out

    def run_settings(self, run_id: int) -> dict:
        """The settings a run was measured with ({} for no such run)."""
        row = self.db.execute("SELECT settings FROM runs WHERE id = ?", (run_id,)).fetchone()
        return json.loads(row[0]) if row else {}

    def close(self) -> None:
        self.db.close()


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
