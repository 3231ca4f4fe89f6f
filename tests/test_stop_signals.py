"""A stop asked from outside ends a command as Ctrl-C does: SIGTERM (``kill PID``, a scheduler, a CI
timeout) and SIGHUP (a closed terminal) to the command line's own process give one line,
``terminated (SIGTERM)``, exit 128 + N, the run being recorded marked failed with that line, and no
temporary file or lock left; ``kill -INT PID`` (to that process alone, not a terminal's Ctrl-C to
the process group) stops it as Ctrl-C does: ``interrupted``, 130.

Each command is real and held at a point of its work where its temporary files are on disk
(tests/running.py): evaluate and export run in a supervised child (the signal reaches the supervisor,
which passes it on), compress in the command line's process itself.
"""

import signal
import sqlite3
import time
from pathlib import Path

import pytest
from running import alive, descendants, held_at, slmedge, temp_names, wait_for
from test_native_crash import CRASHY

STOPS = [(signal.SIGTERM, 143, "terminated (SIGTERM)"), (signal.SIGHUP, 129, "terminated (SIGHUP)"),
         (signal.SIGINT, 130, "interrupted")]
IDS = ["SIGTERM", "SIGHUP", "kill -INT"]


def _stop(proc, sig, kids_expected: int) -> tuple[str, set[int]]:
    """Send ``sig`` to ``proc`` alone; its stderr once it ended, and the processes it had started."""
    kids = descendants(proc.pid)
    assert len(kids) == kids_expected, kids
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    deadline = time.monotonic() + 10
    while any(alive(p) for p in kids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in kids), "a process slmedge started outlived it"
    return err, kids


def _runs(db: Path) -> list[tuple]:
    with sqlite3.connect(db) as con:
        return con.execute("SELECT status, error FROM runs").fetchall()


def _held_evaluation(gguf: str, tmp_path: Path, *extra, setup: str = ""):
    """``slmedge evaluate`` of ``gguf`` recording into tmp_path/db.sqlite, held in its scoring (a
    runtime that sleeps there); (the process, the store)."""
    corpus = tmp_path / "c.txt"
    corpus.write_text(" ".join(["The quick brown fox jumps over the lazy dog."] * 40), encoding="utf-8")
    ready = tmp_path / "scoring"
    db = tmp_path / "db.sqlite"
    args = ["evaluate", gguf, "--runtime", "crashy", "--metrics", "perplexity", "--langs", "", "--no-wikitext",
            "--corpus", str(corpus), "--seqlen", "32", "--ppl-windows", "1", "--results-db", str(db), *extra]
    proc = slmedge(args, tmp_path, setup + CRASHY.format(how="slow", ready=str(ready)))
    wait_for(ready, proc)
    return proc, db


@pytest.mark.parametrize("sig,code,line", STOPS, ids=IDS)
def test_a_stopped_evaluation_says_so_marks_its_run_failed_and_leaves_no_lock(sig, code, line, exports, tmp_path):
    proc, db = _held_evaluation(exports["llama.cpp"], tmp_path, "--json", str(tmp_path / "out" / "r.json"))
    assert temp_names(tmp_path), "the --json output's lock is held while the evaluation runs"
    err, _ = _stop(proc, sig, 1)
    assert proc.returncode == code, err
    assert err.strip().splitlines() == [line], err
    assert _runs(db) == [("failed", line)]
    assert temp_names(tmp_path) == []  # (the --json copy holds what finished, as after Ctrl-C)


@pytest.mark.parametrize("sig,code,line", STOPS, ids=IDS)
def test_a_stopped_export_says_so_and_removes_its_temp_folder_and_lock(sig, code, line, tiny_models, tmp_path):
    out = tmp_path / "onnx"
    args = ["export", str(tiny_models("llama")), "--format", "onnx", "--type", "fp32", "-o", str(out), "--no-verify"]
    ready = tmp_path / "counting"
    proc = slmedge(args, tmp_path, held_at("slmedge.export.onnx", "_op_counts", ready))
    wait_for(ready, proc)
    left = temp_names(tmp_path)
    assert any("-dir-onnx" in n for n in left) and any(n.startswith(".slmedge-lock-") for n in left), left
    err, _ = _stop(proc, sig, 1)
    assert proc.returncode == code, err
    assert err.strip().splitlines()[-1:] == [line] and "Traceback" not in err, err  # (torch's import may warn first)
    assert not out.exists() and temp_names(tmp_path) == []


@pytest.mark.parametrize("sig,code,line", STOPS[:2], ids=IDS[:2])
def test_a_stopped_compression_says_so_and_removes_its_temp_folder(sig, code, line, tiny_models, tmp_path):
    """compress is not supervised: the signal lands in the command line's own process."""
    out = tmp_path / "art"
    args = ["compress", str(tiny_models("llama")), "--method", "rtn", "--bits", "4", "--group-size", "32", "-o",
            str(out)]
    ready = tmp_path / "writing"
    proc = slmedge(args, tmp_path, held_at("slmedge.compress.artifact", "save_file", ready))
    wait_for(ready, proc)
    assert any("-dir-art" in n for n in temp_names(tmp_path))
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err
    assert err.strip().splitlines()[-1:] == [line], err
    assert "Traceback" not in err and not out.exists() and temp_names(tmp_path) == []


def test_a_command_started_with_sighup_ignored_keeps_it_ignored(exports, tmp_path):
    """``nohup slmedge ...``: SIGHUP stays ignored (the command goes on), SIGTERM still stops it."""
    proc, db = _held_evaluation(exports["llama.cpp"], tmp_path,
                                setup="import signal as _s\n_s.signal(_s.SIGHUP, _s.SIG_IGN)\n")
    proc.send_signal(signal.SIGHUP)
    time.sleep(2)
    assert proc.poll() is None and _runs(db) == [("running", None)]
    err, _ = _stop(proc, signal.SIGTERM, 1)
    assert proc.returncode == 143 and _runs(db) == [("failed", "terminated (SIGTERM)")], err
