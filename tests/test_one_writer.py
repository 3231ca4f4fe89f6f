"""One writer per output: an output is locked while it is written, and a second writer of the same
output at the same time is refused, naming the first (or, for caches, waits for it). Never two
successes for one file.

Each case holds the first writer in the middle of its real work (tests/running.py), starts the
second with the same command line, and checks: the second is refused at once with exit 1 and the
first's PID and command; the first then finishes, exit 0, its output whole.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from running import held_at, slmedge, temp_names, wait_for

from slmedge.fsutil import LOCK_MARK, OutputBusyError, output_lock, remove_stale, temp_name

HOLD = ("import sys, time\nfrom slmedge.fsutil import output_lock\n"
        "with output_lock(sys.argv[1]):\n    print('held', flush=True)\n    time.sleep(float(sys.argv[2]))\n")


def _holder(path: Path, seconds: float = 60) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(path), str(seconds)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


# --- the lock ---------------------------------------------------------------------------------------


def test_a_second_writer_is_refused_naming_the_first_and_the_os_frees_a_dead_ones_lock(tmp_path):
    out = tmp_path / "m.gguf"
    first = _holder(out)
    try:
        with pytest.raises(OutputBusyError, match=rf"{re.escape(str(out))} is being written by another slmedge process "
                                                  rf"\(PID {first.pid}, since .*: -c {re.escape(str(out))} 60\)"):
            with output_lock(out):
                pass
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    assert (tmp_path / (LOCK_MARK + "m.gguf")).exists()  # left by the killed holder ...
    with output_lock(out):  # ... whose lock the OS released
        pass
    assert not (tmp_path / (LOCK_MARK + "m.gguf")).exists()  # and removed by the next writer


def test_a_lock_is_reentrant_and_makes_and_removes_missing_folders(tmp_path):
    out = tmp_path / "a" / "b" / "m.gguf"
    with output_lock(out):
        assert out.parent.is_dir()
        with output_lock(tmp_path / "a" / ".." / "a" / "b" / "m.gguf", wait=True):  # the same file, named otherwise
            pass
    assert not (tmp_path / "a").exists()  # nothing was written there: the folders it made are gone
    with output_lock(out):
        out.write_text("x")
    assert out.read_text() == "x" and os.listdir(out.parent) == ["m.gguf"]


def test_a_cache_writer_waits_for_the_first(tmp_path):
    out = tmp_path / "cached.gguf"
    first = _holder(out, seconds=2)
    started = time.monotonic()
    with output_lock(out, wait=True):
        waited = time.monotonic() - started
    first.wait()
    assert waited > 1.0, waited


# --- what killed runs leave -------------------------------------------------------------------------


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_only_what_dead_writers_left_is_removed(tmp_path):
    """Under an output's lock, the temporary names of that output whose process is gone go (nobody is
    writing it now); other outputs' temporary names go when their lock is free, stay while it is held;
    a name whose PID is another live process stays (an earlier version, which took no lock, may be
    writing it); a folder a kill set aside while replacing it is put back; nothing else is touched."""
    dead = _dead_pid()
    held_other = _holder(tmp_path / "busy.gguf")
    live = held_other.pid
    try:
        made = {
            temp_name(tmp_path / "m.gguf", "file").name: "file",  # this process's PID: not being written
            f".slmedge-tmp-{dead}-0123abcd-stage-m.gguf": "file",  # the GGUF writer's stage, earlier versions
            f".slmedge-tmp-{dead}-0123abcd-file-free.gguf": "file",  # another output, its lock free
            f".slmedge-tmp-{dead}-0123abcd-file-busy.gguf": "file",  # another output, being written
            f".slmedge-tmp-{live}-stage-m.gguf": "file",  # an earlier version's name, its process alive
            f".slmedge-tmp-{live}-0123abcd-file-m.gguf": "file",  # a live process's name
            f".slmedge-tmp-{dead}-0123abcd-old-art": "dir",  # a finished folder set aside, never put back
            f".slmedge-tmp-{dead}-0123abcd-dir-art": "dir",
            f".slmedge-tmp-{'0' * 32}-new.json": "file",  # an earlier version's name without a PID, just written
            f"{LOCK_MARK}gone.gguf": "file",  # a lock file no one holds
            ".slmedge-tmp-notes": "file", "notes.txt": "file", ".hidden": "file", "x-m.gguf": "file",
        }
        for name, kind in made.items():
            if kind == "dir":
                (tmp_path / name).mkdir()
                (tmp_path / name / "slmedge.json").write_text("{}")
            else:
                (tmp_path / name).write_text("x")
        with output_lock(tmp_path / "m.gguf"):
            pass
        left = sorted(os.listdir(tmp_path))
        assert left == sorted([f".slmedge-tmp-{dead}-0123abcd-file-busy.gguf", f"{LOCK_MARK}busy.gguf",
                               f".slmedge-tmp-{live}-stage-m.gguf", f".slmedge-tmp-{live}-0123abcd-file-m.gguf",
                               f".slmedge-tmp-{'0' * 32}-new.json", "art", ".slmedge-tmp-notes", "notes.txt",
                               ".hidden", "x-m.gguf"]), left
        assert (tmp_path / "art" / "slmedge.json").is_file()  # the set-aside folder, back in its place
    finally:
        held_other.send_signal(signal.SIGKILL)
        held_other.wait()
    old = time.time() - 3600
    os.utime(tmp_path / f".slmedge-tmp-{'0' * 32}-new.json", (old, old))
    assert sorted(remove_stale(tmp_path)) == sorted([f".slmedge-tmp-{dead}-0123abcd-file-busy.gguf",
                                                     f".slmedge-tmp-{live}-stage-m.gguf",
                                                     f".slmedge-tmp-{live}-0123abcd-file-m.gguf",
                                                     f".slmedge-tmp-{'0' * 32}-new.json"])


# --- two writers of one output, on the command line -------------------------------------------------


def _two_writers(tmp_path: Path, args: list[str], module: str, attr: str, out: Path, words: tuple[str, ...]):
    """The first writer held in its work; the second refused at once, naming it; the first finishes."""
    ready = tmp_path / "first-is-writing"
    first = slmedge(args, tmp_path, held_at(module, attr, ready, seconds=30))
    try:
        wait_for(ready, first)
        writer = int(ready.read_text())
        second = subprocess.run([sys.executable, "-m", "slmedge", *args], cwd=tmp_path, capture_output=True,
                                text=True, timeout=300)
        assert second.returncode == 1, second.stderr
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error:"), second.stderr
        assert "is being written by another slmedge process" in lines[0] and f"PID {writer}," in lines[0], lines[0]
        for w in words:
            assert w in lines[0], lines[0]
        assert first.poll() is None, "the second writer should have been refused while the first wrote"
        out_text, err = first.communicate(timeout=600)
        assert first.returncode == 0, err
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert temp_names(tmp_path) == []
    return out


def test_two_gguf_exports_to_one_file(tiny_models, tmp_path):
    out = tmp_path / "same.gguf"
    args = ["export", str(tiny_models("llama")), "--format", "gguf", "--type", "f32", "-o", str(out), "--overwrite"]
    _two_writers(tmp_path, args, "slmedge.export.gguf", "seal_gguf", out, (str(out), "slmedge export"))
    from slmedge.models.gguf_seal import check_gguf

    assert check_gguf(out)["qtype"] == "f32"


def test_two_onnx_exports_to_one_folder(tiny_models, tmp_path):
    out = tmp_path / "onnx"
    args = ["export", str(tiny_models("llama")), "--format", "onnx", "--type", "fp32", "-o", str(out), "--no-verify"]
    _two_writers(tmp_path, args, "slmedge.export.onnx", "_op_counts", out, (str(out), "--format onnx"))
    from slmedge.export.inspect import verified_onnx_manifest

    assert verified_onnx_manifest(out)["type"] == "fp32"


def test_two_compressions_into_one_folder_with_overwrite(tiny_models, calib_file, tmp_path):
    out = tmp_path / "art"
    args = ["compress", str(tiny_models("llama")), "--method", "rtn", "--bits", "4", "--group-size", "32", "-o",
            str(out), "--overwrite"]
    _two_writers(tmp_path, args, "slmedge.compress.api", "compress_model", out, (str(out), "--overwrite"))
    from slmedge.compress.artifact import Artifact

    assert Artifact.open(out).manifest["recipe"]["bits"] == 4


def test_two_runs_of_one_study(tiny_models, tmp_path):
    from conftest import tiny_study_file

    f = tiny_study_file(tmp_path, tiny_models("llama"), "twice", ['method = "none"'], exports=(), workdir="work")
    args = ["study", str(f), "--results-db", str(tmp_path / "s.sqlite")]
    _two_writers(tmp_path, args, "slmedge.study.engine", "_run_locked", tmp_path / "work",
                 ("the study 'twice'", "a study runs once at a time"))
    import sqlite3

    with sqlite3.connect(tmp_path / "s.sqlite") as con:
        assert con.execute("SELECT status, COUNT(*) FROM study_jobs GROUP BY status").fetchall() == [("done", 1)]


def test_two_evaluations_share_one_cached_export(artifacts, tmp_path, session_cache):
    """Two evaluations of one artifact in llama.cpp at once: the cached GGUF is written once, by the
    first; the second waits for it and uses it (both succeed)."""
    art = artifacts("llama", "rtn", bits=4)
    corpus = tmp_path / "c.txt"
    corpus.write_text(" ".join(["The quick brown fox jumps over the lazy dog."] * 40))
    base = ["evaluate", str(art), "--runtime", "llama.cpp", "--metrics", "perplexity", "--langs", "", "--no-wikitext",
            "--corpus", str(corpus), "--seqlen", "32", "--ppl-windows", "1", "--results-db", str(tmp_path / "db")]
    cache = tmp_path / "cache"
    env = {**os.environ, "SLMEDGE_CACHE_DIR": str(cache)}
    ready = tmp_path / "first-is-writing"
    first = slmedge([*base, "--json", str(tmp_path / "a.json")], tmp_path,
                    held_at("slmedge.export.gguf", "seal_gguf", ready, seconds=30), env=env)
    try:
        wait_for(ready, first)
        second = slmedge([*base, "--json", str(tmp_path / "b.json")], tmp_path,
                         held_at("slmedge.export.gguf", "seal_gguf", tmp_path / "second-wrote", seconds=0), env=env)
        _, err = second.communicate(timeout=600)
        assert second.returncode == 0, err
        _, err = first.communicate(timeout=600)
        assert first.returncode == 0, err
    finally:
        for p in (first,):
            if p.poll() is None:
                p.kill()
    assert not (tmp_path / "second-wrote").exists()  # it waited, then found the first one's export
    a, b = (json.loads((tmp_path / n).read_text())["identity"]["path"] for n in ("a.json", "b.json"))
    assert a == b and (tmp_path / a).is_file()  # relative to the JSON files' folder
    assert temp_names(cache / "exports") == []


def test_two_evaluations_writing_one_json_file(exports, tmp_path):
    """--json: the second evaluation naming the same file is refused when it starts, not left to
    replace the first one's results when it ends (the results store takes both runs: it is shared)."""
    corpus = tmp_path / "c.txt"
    corpus.write_text(" ".join(["The quick brown fox jumps over the lazy dog."] * 40))
    out = tmp_path / "results.json"
    args = ["evaluate", exports["llama.cpp"], "--metrics", "perplexity", "--langs", "", "--no-wikitext", "--corpus",
            str(corpus), "--seqlen", "32", "--ppl-windows", "1", "--results-db", str(tmp_path / "db"), "--json", str(out)]
    _two_writers(tmp_path, args, "slmedge.evaluate.api", "write_json_atomic", out, (f"--json {out}",))
    assert json.loads(out.read_text())["metrics"]["perplexity"]
