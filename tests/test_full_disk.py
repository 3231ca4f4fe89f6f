"""A full disk, for real (issue 41, part 5): a small tmpfs, mounted for each test, holds the output.

Each write slmedge makes (an artifact, a GGUF, the SQLite results store, the ``--json`` copy) must
end in one ``error:`` line naming the path, ``no space left on PATH (needed about N MB)``, exit 1,
and leave nothing that looks complete (no artifact folder, no .gguf, no temporary name); a finished
evaluation whose ``--json`` copy could not be written stays finished in the store.

Mounting needs root (or CAP_SYS_ADMIN): elsewhere the tests skip with the reason, and under
``CI=true`` as root a mount that fails is a failure (``missing_prerequisite``)."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import uuid
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conftest import missing_prerequisite
from slmedge.cli import app

runner = CliRunner()


@pytest.fixture
def small_disk(tmp_path):
    """(size) -> a folder on a tmpfs of that size, unmounted at teardown."""
    mounted: list[Path] = []

    def mount(size: str) -> Path:
        where = tmp_path / f"disk-{uuid.uuid4().hex[:6]}"
        where.mkdir()
        if os.geteuid() != 0:  # CI runs as root (scripts/setup.sh installs as root): a skip there hides the test
            missing_prerequisite("mounting a tmpfs needs root; this test runs as uid %d" % os.geteuid())
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            missing_prerequisite(f"cannot mount a tmpfs here ({proc.stderr.strip() or proc.returncode})")
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def _fill(folder: Path, leave: int = 0) -> None:
    """Fill ``folder``'s file system but for ``leave`` bytes (to the last block by default: a lock
    file, being empty, still fits, as a new inode takes no block)."""
    st = os.statvfs(folder)
    free = st.f_bavail * st.f_frsize
    with open(folder / "filler", "wb") as f:
        f.write(b"\0" * max(free - leave, 0))


def _one_line(result, path: Path) -> str:
    text = result.output.strip()
    assert result.exit_code == 1, text
    assert len(text.splitlines()) == 1 and text.startswith("error:"), text
    assert "Traceback" not in text and ".slmedge-tmp-" not in text, text
    assert f"no space left on {path}" in text and "MB)" in text and "needed" in text, text
    print(text)  # shown with -s: the line a user reads
    return text


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith((".slmedge-tmp-", ".slmedge-lock-")))


def test_an_artifact_on_a_full_disk(small_disk, tiny_models):
    disk = small_disk("1m")
    _fill(disk, leave=32 * 1024)  # room for the first files, not for the tensors (about 0.2 MB)
    out = disk / "art"
    result = runner.invoke(app, ["compress", str(tiny_models("llama")), "--method", "rtn", "-g", "32", "-o", str(out)])
    _one_line(result, out)
    assert not out.exists()
    assert _leftovers(disk) == []


def test_a_gguf_on_a_full_disk(small_disk, tiny_models):
    disk = small_disk("1m")
    _fill(disk, leave=32 * 1024)  # the f32 GGUF of the tiny model takes about 0.4 MB
    out = disk / "m.gguf"
    result = runner.invoke(app, ["export", str(tiny_models("llama")), "--format", "gguf", "--type", "f32", "-o",
                                 str(out)])
    _one_line(result, out)
    assert not out.exists()
    assert _leftovers(disk) == []


def test_the_results_store_on_a_full_disk(small_disk, tiny_models):
    disk = small_disk("1m")
    _fill(disk)
    db = disk / "results.sqlite"
    result = runner.invoke(app, ["evaluate", str(tiny_models("llama")), "--metrics", "memory", "--context", "64",
                                 "--results-db", str(db)])
    _one_line(result, db)
    assert _leftovers(disk) == []


def test_a_json_copy_on_a_full_disk_leaves_the_evaluation_finished(small_disk, tiny_models, tmp_path):
    disk = small_disk("1m")
    _fill(disk)
    db = tmp_path / "results.sqlite"
    out = disk / "r.json"
    result = runner.invoke(app, ["evaluate", str(tiny_models("llama")), "--metrics", "memory", "--context", "64",
                                 "--results-db", str(db), "--json", str(out)])
    text = _one_line(result, out)
    assert f"the evaluation finished and is recorded as run 1 in {db}" in text, text
    assert not out.exists() and _leftovers(disk) == []
    with sqlite3.connect(db) as con:
        runs = con.execute("SELECT status FROM runs").fetchall()
    assert runs == [("done",)], runs  # the evaluation finished: a copy that could not be written is no failure
