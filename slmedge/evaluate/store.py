"""The results store: SQLite, one row per metric, append-only named migrations.

Path: ``--results-db``, else ``$SLMEDGE_RESULTS_DB``, else ``<user data dir>/slmedge/results.sqlite``.
Every row carries its run (model, artifact hash, runtime, threads, target, versions), and rows are
committed as each metric finishes, so an interrupted evaluation keeps what it finished.
Migrations are applied in order and recorded by name; a database written by a newer slmedge
(with migrations this one does not know) is refused rather than altered.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from pathlib import Path

from platformdirs import user_data_dir

from ..errors import SlmedgeError

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
]


class ResultsStoreError(SlmedgeError):
    """The results database cannot be opened or is newer than this slmedge."""


def default_path() -> Path:
    env = os.environ.get(ENV)
    return Path(env).expanduser() if env else Path(user_data_dir("slmedge")) / "results.sqlite"


class ResultsStore:
    def __init__(self, path: Path | str | None = None):
        self.path = Path(path).expanduser() if path else default_path()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.db = sqlite3.connect(str(self.path), timeout=60)
        except (OSError, sqlite3.Error) as exc:
            raise ResultsStoreError(f"cannot open the results store {self.path}: {exc}") from exc
        try:
            self._migrate()
        except sqlite3.DatabaseError as exc:
            self.db.close()
            raise ResultsStoreError(f"{self.path} is not an slmedge results database ({exc})") from exc

    def _migrate(self) -> None:
        self.db.execute("CREATE TABLE IF NOT EXISTS migrations (name TEXT PRIMARY KEY, applied_at TEXT NOT NULL)")
        applied = {row[0] for row in self.db.execute("SELECT name FROM migrations")}
        known = {name for name, _ in MIGRATIONS}
        unknown = applied - known
        if unknown:
            raise ResultsStoreError(f"{self.path} was written by a newer slmedge (migration {sorted(unknown)[-1]}); "
                                    "upgrade slmedge or use another --results-db")
        for name, sql in MIGRATIONS:
            if name in applied:
                continue
            # The migration and its record in one transaction: a crash leaves neither.
            self.db.executescript(f"BEGIN; {sql}; INSERT INTO migrations VALUES ('{name}', '{_now()}'); COMMIT;")

    def start_run(self, model: str, artifact_sha256: str | None, runtime: str, threads: int, target: str,
                  versions: dict, settings: dict, emulated: bool = False) -> int:
        with self.db:
            cur = self.db.execute(
                "INSERT INTO runs (started_at, model, artifact_sha256, runtime, threads, target, emulated, versions, "
                "settings) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (_now(), model, artifact_sha256, runtime, threads, target, int(emulated),
                 json.dumps(versions, sort_keys=True), json.dumps(settings, sort_keys=True, default=str)))
        return int(cur.lastrowid)

    def add(self, run_id: int, metric: str, value, subset: str = "", stderr=None, unit: str | None = None,
            extra: dict | None = None) -> None:
        with self.db:  # one commit per row: nothing finished is lost on an interrupt
            self.db.execute(
                "INSERT INTO results (run_id, metric, subset, value, stderr, unit, extra, recorded_at) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (run_id, metric, subset, None if value is None else float(value),
                 None if stderr is None else float(stderr), unit,
                 json.dumps(extra, sort_keys=True, default=str) if extra else None, _now()))

    def rows(self, run_id: int | None = None) -> list[dict]:
        sql = ("SELECT r.id, r.model, r.artifact_sha256, r.runtime, r.threads, r.target, r.emulated, x.metric, "
               "x.subset, x.value, x.stderr, x.unit FROM results x JOIN runs r ON r.id = x.run_id")
        args: tuple = ()
        if run_id is not None:
            sql += " WHERE r.id = ?"
            args = (run_id,)
        cols = ["run", "model", "artifact_sha256", "runtime", "threads", "target", "emulated", "metric", "subset",
                "value", "stderr", "unit"]
        return [dict(zip(cols, row)) for row in self.db.execute(sql + " ORDER BY x.id", args)]

    def close(self) -> None:
        self.db.close()


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
