"""A crash in native code (a segfault in llama.cpp or onnxruntime) ends ``slmedge evaluate`` or
``slmedge export`` with one line naming the runtime and the file, and exit 128 + the signal (139
for a segfault), not a silent 139: the command runs in a child process that the command line's own
process supervises (slmedge.cli.common.supervised).

The crashes are real: a runtime registered by the test dereferences a null pointer
(``ctypes.string_at(0)``) inside its scoring call; llama.cpp's loader is made to do the same inside
an export's verification.
"""

import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from running import alive, descendants, kill_and_check, slmedge, temp_names, wait_for

CRASHY = '''
import ctypes, os, signal, sys
from pathlib import Path
from slmedge.runtimes.base import Runtime
from slmedge.runtimes.registry import register_runtime

HOW = {how!r}

@register_runtime("crashy", export_format="gguf", suffixes=(".gguf",))
class Crashy(Runtime):
    """A runtime whose scoring call crashes the process the way native code does."""

    def __init__(self, path, threads=None):
        super().__init__(threads)
        self.path = Path(path)

    @classmethod
    def open_file(cls, path, threads=None, n_ctx=2048, gpu=False, gpu_layers=-1):
        return cls(path, threads)

    @property
    def vocab_size(self):
        return 256

    def logits(self, ids):
        if HOW == "segfault":
            ctypes.string_at(0)  # a null pointer read: SIGSEGV
        elif HOW == "abort":
            os.abort()  # what a failed assertion in C does: SIGABRT
        elif HOW == "killed":
            os.kill(os.getpid(), signal.SIGKILL)  # what the out-of-memory killer does
        elif HOW == "slow":
            open({ready!r}, "w").write(str(os.getpid()))
            import time
            time.sleep(120)
        raise AssertionError("not reached")

    def _prefill(self, ids):
        raise NotImplementedError

    def _step(self, token, state, position):
        raise NotImplementedError
'''


@pytest.fixture
def corpus(tmp_path):
    f = tmp_path / "c.txt"
    f.write_text(" ".join(["The quick brown fox jumps over the lazy dog."] * 40), encoding="utf-8")
    return f


def _evaluate_with(how: str, gguf: str, tmp_path: Path, corpus: Path, *extra, ready: Path | None = None):
    args = ["evaluate", gguf, "--runtime", "crashy", "--metrics", "perplexity", "--langs", "", "--no-wikitext",
            "--corpus", str(corpus), "--seqlen", "32", "--ppl-windows", "1", "--results-db", str(tmp_path / "db.sqlite"),
            "--json", str(tmp_path / "out.json"), *extra]
    return slmedge(args, tmp_path, CRASHY.format(how=how, ready=str(ready or tmp_path / "ready")))


def _runs(db: Path) -> list[tuple]:
    with sqlite3.connect(db) as con:
        return con.execute("SELECT status, error FROM runs").fetchall()


@pytest.mark.parametrize("how,code,words", [
    ("segfault", 139, "crashy crashed (SIGSEGV, segmentation fault) on {file}: the file may be damaged"),
    ("abort", 134, "crashy crashed (SIGABRT, aborted) on {file}"),
    ("killed", 137, "slmedge evaluate was killed (SIGKILL, killed) while crashy was running on {file}: by the "
                    "out-of-memory killer or another process"),
])
def test_a_crash_in_a_runtime_is_one_line_naming_it_and_the_file(how, code, words, exports, tmp_path, corpus):
    gguf = exports["llama.cpp"]
    proc = _evaluate_with(how, gguf, tmp_path, corpus)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == code, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert words.format(file=gguf) in lines[0], lines[0]
    assert "Traceback" not in err and "Fatal Python error" not in err
    assert not (tmp_path / "out.json").exists()
    # The run it had begun recording is failed, with the same line (not left 'running', never 'done').
    assert _runs(tmp_path / "db.sqlite") == [("failed", lines[0].removeprefix("error: "))]


def test_under_debug_a_crash_shows_pythons_traceback_instead(exports, tmp_path, corpus):
    args = ["--debug", "evaluate", exports["llama.cpp"], "--runtime", "crashy", "--metrics", "perplexity", "--langs",
            "", "--no-wikitext", "--corpus", str(corpus), "--seqlen", "32", "--ppl-windows", "1", "--results-db",
            str(tmp_path / "db.sqlite")]
    proc = slmedge(args, tmp_path, CRASHY.format(how="segfault", ready=""))
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == -signal.SIGSEGV  # not supervised: the process itself died
    assert "Fatal Python error: Segmentation fault" in err and "in logits" in err, err[-2000:]


def test_a_crash_in_llama_cpp_during_an_export_names_llama_cpp_and_the_file(tiny_models, tmp_path):
    """llama.cpp's loader crashes while the export verifies the file it wrote: one line naming llama.cpp
    and the output (never the temporary name it was written under), exit 139, no output; the next
    export writes it, and what the crash left is gone."""
    out = tmp_path / "m.gguf"
    args = ["export", str(tiny_models("llama")), "--format", "gguf", "--type", "f32", "-o", str(out)]
    crash = ("import ctypes, slmedge.backends.llamacpp as b\n"
             "def _load(*a, **k):\n    ctypes.string_at(0)\n"
             "b._load = _load\n")
    proc = slmedge(args, tmp_path, crash)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 139, err
    lines = err.strip().splitlines()
    assert lines == [f"error: llama.cpp crashed (SIGSEGV, segmentation fault) on {out}: the file may be damaged or "
                     "not what llama.cpp expects, or llama.cpp has a bug; nothing it was doing was recorded as "
                     "finished"], err
    assert not out.exists() and temp_names(tmp_path)
    r = subprocess.run([sys.executable, "-m", "slmedge", *args], cwd=tmp_path, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr
    assert out.is_file() and temp_names(tmp_path) == []


def test_the_supervisor_passes_sigterm_on_and_the_child_answers_it(exports, tmp_path, corpus):
    """SIGTERM to the command line's process (a CI timeout, systemd, kill PID): passed on to the child
    doing the work, which stops as on Ctrl-C and exits 143 (tests/test_stop_signals.py); nothing is
    left running."""
    ready = tmp_path / "scoring"
    proc = _evaluate_with("slow", exports["llama.cpp"], tmp_path, corpus, ready=ready)
    wait_for(ready, proc)
    kids = descendants(proc.pid)
    assert len(kids) == 1
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM and err.strip().splitlines() == ["terminated (SIGTERM)"], err
    deadline = time.monotonic() + 10
    while any(alive(p) for p in kids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in kids)


def test_ctrl_c_reaches_the_child_once_and_is_one_line(exports, tmp_path, corpus):
    """Ctrl-C in a terminal signals the whole foreground process group: the child says 'interrupted'
    and exits 130; the supervising parent says nothing and passes 130 on."""
    ready = tmp_path / "scoring"
    args = ["evaluate", exports["llama.cpp"], "--runtime", "crashy", "--metrics", "perplexity", "--langs", "",
            "--no-wikitext", "--corpus", str(corpus), "--seqlen", "32", "--ppl-windows", "1", "--results-db",
            str(tmp_path / "db.sqlite")]
    proc = slmedge(args, tmp_path, CRASHY.format(how="slow", ready=str(ready)), start_new_session=True,
                   preexec_fn=None)
    wait_for(ready, proc)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err.strip().splitlines() == ["interrupted"], err
    assert _runs(tmp_path / "db.sqlite") == [("failed", "interrupted")]


def test_a_kill_of_the_supervisor_takes_the_child_with_it(exports, tmp_path, corpus):
    ready = tmp_path / "scoring"
    proc = _evaluate_with("slow", exports["llama.cpp"], tmp_path, corpus, ready=ready)
    wait_for(ready, proc)
    kill_and_check(proc, expect=1, marker=str(corpus))
    assert _runs(tmp_path / "db.sqlite") == [("running", None)]  # nobody was left to end it (nor to finish it)


def test_a_crash_in_a_targets_runner_names_the_runtime_and_the_file():
    """A runner (local, emulated, over ssh) that dies of a signal while serving a runtime: the error
    names the runtime and the file it opened (the host process, not crashed, exits 1 with it). The
    runner here is a stand-in that reads the request and then dereferences a null pointer."""
    from slmedge.runtimes.remote import RemoteRuntime, RunnerProcess, TargetRuntimeError

    crash = "import sys, ctypes\nsys.stdin.buffer.read(8)\nctypes.string_at(0)\n"
    runner = RunnerProcess([sys.executable, "-c", crash], "target x")
    with pytest.raises(TargetRuntimeError, match=r"^target x: llama.cpp crashed \(SIGSEGV, segmentation fault\) on "
                                                 r"/models/m.gguf in the runner"):
        RemoteRuntime(runner, "llama.cpp", "/models/m.gguf")
