"""Nothing outlives slmedge: each long-running command, killed with SIGKILL in the middle of its work
(the command line's own process, alone: what ``kill -9 PID``, the out-of-memory killer or a CI
timeout does), leaves no process of its own alive 10 s later (children and grandchildren: a study's
workers and multiprocessing's resource tracker, the supervised child of evaluate and export, the
memory probe), and the next run that writes into the same place leaves no temporary file there.

Each command is held at a point of its real work where its temporary files are on disk
(tests/running.py), then killed.
"""

import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

from running import alive, cmdline, descendants, held_at, kill_and_check, slmedge, temp_names, wait_for

from conftest import tiny_study_file

CORPUS_ARGS = ["--langs", "", "--no-wikitext", "--seqlen", "32", "--ppl-windows", "1"]


def _again(args, cwd, env=None, timeout=900):
    r = subprocess.run([sys.executable, "-m", "slmedge", *args], cwd=cwd, env=env, capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0, r.stderr[-2000:]
    return r


def test_a_killed_gguf_export_leaves_nothing_running_and_its_two_temp_files_go_with_the_next_export(tiny_models,
                                                                                                    tmp_path):
    """q8_0 of an fp32 folder goes through llama.cpp's quantizer: the stage file and the file being
    written are both on disk when the export is killed (the two hidden files a kill used to leave)."""
    out = tmp_path / "out" / "m.gguf"
    args = ["export", str(tiny_models("llama")), "--format", "gguf", "--type", "q8_0", "-o", str(out)]
    ready = tmp_path / "sealing"
    proc = slmedge(args, tmp_path, held_at("slmedge.export.gguf", "seal_gguf", ready))
    wait_for(ready, proc)
    left = [n for n in temp_names(tmp_path) if "-tmp-" in n]
    assert len(left) == 2 and any("-stage-" in n for n in left), left
    kill_and_check(proc, expect=1)  # the supervised child
    assert not out.exists() and len([n for n in temp_names(tmp_path) if "-tmp-" in n]) == 2
    _again(args, tmp_path)
    assert out.is_file() and temp_names(tmp_path) == []


def test_a_killed_onnx_export_leaves_nothing_running_and_its_temp_folder_goes_with_the_next_export(tiny_models,
                                                                                                  tmp_path):
    out = tmp_path / "onnx"
    args = ["export", str(tiny_models("llama")), "--format", "onnx", "--type", "fp32", "-o", str(out), "--no-verify"]
    ready = tmp_path / "counting"
    proc = slmedge(args, tmp_path, held_at("slmedge.export.onnx", "_op_counts", ready))
    wait_for(ready, proc)
    assert any("-dir-onnx" in n for n in temp_names(tmp_path))
    kill_and_check(proc, expect=1)
    assert not out.exists() and temp_names(tmp_path)
    _again(args, tmp_path)
    assert (out / "model.onnx").is_file() and temp_names(tmp_path) == []


def test_a_killed_compression_leaves_its_temp_folder_to_the_next_one(tiny_models, calib_file, tmp_path):
    out = tmp_path / "art"
    args = ["compress", str(tiny_models("llama")), "--method", "gptq", "--bits", "4", "--group-size", "32",
            "--calibration", str(calib_file), "--nsamples", "4", "--seqlen", "32", "-o", str(out)]
    ready = tmp_path / "writing"
    proc = slmedge(args, tmp_path, held_at("slmedge.compress.artifact", "save_file", ready))
    wait_for(ready, proc)
    assert any("-dir-art" in n for n in temp_names(tmp_path))
    kill_and_check(proc, expect=0, marker=str(out))
    assert not out.exists()
    _again(args, tmp_path)
    assert (out / "slmedge.json").is_file() and temp_names(tmp_path) == []


def test_a_killed_evaluation_takes_its_child_and_the_memory_probe_with_it(exports, tmp_path):
    """The supervised child of evaluate and its own child, the memory probe (held where it starts, by a
    sitecustomize that only the probe's command line triggers): all gone 10 s after kill -9."""
    hook = tmp_path / "hook"
    hook.mkdir()
    ready = tmp_path / "probing"
    (hook / "sitecustomize.py").write_text(
        "import time, pathlib\n"
        "if b'slmedge.evaluate._memprobe' in pathlib.Path('/proc/self/cmdline').read_bytes():\n"
        f"    pathlib.Path({str(ready)!r}).write_text('x')\n"
        "    time.sleep(120)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")])}
    args = ["evaluate", exports["llama.cpp"], "--metrics", "memory", "--results-db", str(tmp_path / "db.sqlite")]
    proc = slmedge(args, tmp_path, env=env)
    wait_for(ready, proc)
    kids = descendants(proc.pid)
    assert len(kids) == 2 and any("slmedge.evaluate._memprobe" in cmdline(p) for p in kids), \
        [cmdline(p)[:100] for p in kids]
    kill_and_check(proc, expect=2, marker=exports["llama.cpp"])
    with sqlite3.connect(tmp_path / "db.sqlite") as con:  # the run it had begun is not done
        assert con.execute("SELECT COUNT(*) FROM runs WHERE status = 'done'").fetchone()[0] == 0


def test_a_killed_evaluation_leaves_its_cached_export_to_the_next_one(artifacts, tmp_path):
    """Killed while writing its cached GGUF of an artifact: the next evaluation of it removes what
    was left and writes the cache entry whole."""
    art = artifacts("llama", "rtn", bits=4)
    corpus = tmp_path / "c.txt"
    corpus.write_text(" ".join(["The quick brown fox jumps over the lazy dog."] * 40))
    cache = tmp_path / "cache"
    env = {**os.environ, "SLMEDGE_CACHE_DIR": str(cache)}
    args = ["evaluate", str(art), "--runtime", "llama.cpp", "--metrics", "perplexity", *CORPUS_ARGS, "--corpus",
            str(corpus), "--results-db", str(tmp_path / "db.sqlite")]
    ready = tmp_path / "sealing"
    proc = slmedge(args, tmp_path, held_at("slmedge.export.gguf", "seal_gguf", ready), env=env)
    wait_for(ready, proc)
    assert any("-tmp-" in n for n in temp_names(cache / "exports"))
    kill_and_check(proc, expect=1)
    _again(args, tmp_path, env=env)
    assert temp_names(cache) == [] and list((cache / "exports").glob("*.gguf"))


def test_a_killed_study_takes_its_workers_and_the_resource_tracker_with_it(tiny_models, tmp_path):
    """kill -9 of the study's own process while a worker compresses: the worker (a spawned process
    holding a model) and multiprocessing's resource tracker are gone within 10 s; the study, run
    again, finishes and leaves no temporary file in its workdir."""
    f = tiny_study_file(tmp_path, tiny_models("llama"), "killed",
                        ['label = "gptq"\nmethod = "gptq"\nbits = 4\ngroup_size = 32'], exports=(),
                        workdir="work", calibration=True)
    db = tmp_path / "s.sqlite"
    args = ["study", str(f), "--results-db", str(db)]
    proc = slmedge(args, tmp_path)
    deadline = time.monotonic() + 300
    started = False
    while time.monotonic() < deadline and proc.poll() is None and not started:
        time.sleep(0.2)
        if db.is_file():
            try:
                with sqlite3.connect(db, timeout=5) as con:
                    started = con.execute("SELECT COUNT(*) FROM study_events WHERE event = 'started'").fetchone()[0] > 0
            except sqlite3.Error:
                pass
    assert started and proc.poll() is None, proc.communicate()[1][-1000:]
    kids = descendants(proc.pid)
    assert any("resource_tracker" in cmdline(p) for p in kids) and any("spawn_main" in cmdline(p) for p in kids), \
        [cmdline(p)[:100] for p in kids]
    kill_and_check(proc, expect=2, marker=str(tmp_path))
    r = _again(args, tmp_path)
    assert "resuming" in r.stdout or "job(s) run" in r.stdout, r.stdout
    assert temp_names(tmp_path / "work") == [] and temp_names(tmp_path) == []


def test_a_killed_study_on_ray_takes_rays_processes_with_it(tiny_models, tmp_path):
    """With --engine ray and no cluster address, slmedge starts Ray on this machine: its GCS server and
    raylet (children of the study's process, tied to it by Ray with the same prctl slmedge uses), the
    raylet's workers and its two agents. kill -9 of the study: all but the agents are gone within 10 s;
    the agents (DashboardAgent, RuntimeEnvAgent) end on Ray's own schedule, once their check of the
    raylet runs (2 s after it starts; measured here up to ~50 s after the kill, when they were still
    starting on 2 busy cores), within 120 s."""
    from conftest import require_import

    require_import("ray", "ray is not installed (pip install -e '.[ray]'; scripts/setup.sh installs it)")
    f = tiny_study_file(tmp_path, tiny_models("llama"), "killed-ray",
                        ['label = "gptq"\nmethod = "gptq"\nbits = 4\ngroup_size = 32'], exports=(),
                        workdir="work", calibration=True)
    import shutil
    import tempfile

    db = tmp_path / "s.sqlite"
    raydir = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))  # short: Ray's socket paths have 107 bytes
    env = {**os.environ, "RAY_TMPDIR": str(raydir)}
    proc = slmedge(["study", str(f), "--results-db", str(db), "--engine", "ray"], tmp_path, env=env)
    deadline = time.monotonic() + 300
    started = False
    while time.monotonic() < deadline and proc.poll() is None and not started:
        time.sleep(0.2)
        if db.is_file():
            try:
                with sqlite3.connect(db, timeout=5) as con:
                    started = con.execute("SELECT COUNT(*) FROM study_events WHERE event = 'started'").fetchone()[0] > 0
            except sqlite3.Error:
                pass
    assert started and proc.poll() is None, proc.communicate()[1][-1000:]
    time.sleep(3)  # the task reaches a worker
    kids = descendants(proc.pid)
    assert any("raylet" in cmdline(p) for p in kids), [cmdline(p)[:100] for p in kids]
    agents = {p for p in kids if cmdline(p).startswith(("ray::DashboardAgent", "ray::RuntimeEnvAgent"))}
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    try:
        for group, within in ((kids - agents, 10), (kids, 120)):
            deadline = time.monotonic() + within
            while any(alive(p) for p in group) and time.monotonic() < deadline:
                time.sleep(0.2)
            left = [f"{p}: {cmdline(p)[:80]}" for p in group if alive(p)]
            assert not left, f"alive {within} s after kill -9: {left}"
    finally:
        for p in kids:
            if alive(p):
                os.kill(p, signal.SIGKILL)
        shutil.rmtree(raydir, ignore_errors=True)
