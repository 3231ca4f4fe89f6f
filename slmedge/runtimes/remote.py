"""A runtime on a target: the host side of ``slmedge.targets.runner``.

``RemoteRuntime`` is a ``Runtime`` whose calls are requests to a runner process (local child,
qemu-emulated, or over ssh); the metrics code does not know the difference. Token log-probs and
timings come back; full logits only where a metric needs them (fidelity).
"""

from __future__ import annotations

import subprocess
import threading

import numpy as np

from ..errors import ConfigError, CorruptModelError, RuntimeNotInstalledError, SlmedgeError
from ..procs import child_options
from . import wire
from .base import GenerationTiming, Runtime


class TargetRuntimeError(SlmedgeError):
    """The runner on a target failed or went away."""


_ERRORS = {"RuntimeNotInstalledError": RuntimeNotInstalledError, "CorruptModelError": CorruptModelError,
           "ConfigError": ConfigError}


class RunnerProcess:
    """A started runner: requests on its stdin, replies on its stdout; its stderr is kept (the
    last lines go into error messages)."""

    def __init__(self, argv: list[str], where: str, env: dict | None = None, timeout: float | None = None,
                 describe_exit=None):
        self.where = where
        self.timeout = timeout
        self.describe_exit = describe_exit
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     env=env, **child_options())
        self._err: list[bytes] = []
        self.serving: tuple[str, str] | None = None  # (runtime, file) the runner opened last: what a crash names
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()

    def _drain(self):
        for line in self.proc.stderr:
            self._err.append(line)
            del self._err[:-40]

    def stderr_tail(self, n: int = 6) -> str:
        return b"".join(self._err[-n:]).decode("utf-8", "replace").strip()

    def request(self, header: dict, arrays=None, timeout: float | None = None) -> tuple[dict, list]:
        timer = None
        limit = timeout or self.timeout
        if limit:
            timer = threading.Timer(limit, self.proc.kill)
            timer.start()
        if header.get("op") == "open":
            self.serving = (str(header.get("runtime")), str(header.get("path")))
        try:
            wire.send(self.proc.stdin, header, arrays)
            reply, out = wire.recv(self.proc.stdout)
        except (wire.WireError, BrokenPipeError, OSError) as exc:
            self.proc.wait(timeout=10)
            self._reader.join(timeout=2)
            if timer is not None and not timer.is_alive() and self.proc.returncode in (-9, 137):
                raise TargetRuntimeError(f"{self.where}: no reply to '{header.get('op')}' within {limit:.0f} s") from exc
            code = self.proc.returncode
            if code is not None and code < 0 and self.serving is not None:  # a crash in the runtime it serves
                from ..procs import signal_text

                runtime, path = self.serving
                raise TargetRuntimeError(f"{self.where}: {runtime} crashed ({signal_text(-code)}) on {path} in the "
                                         "runner: the file may be damaged or not what it expects, or it has a bug") \
                    from exc
            msg = self.describe_exit(self.proc.returncode, self.stderr_tail()) if self.describe_exit else None
            raise (msg if isinstance(msg, SlmedgeError) else TargetRuntimeError(
                f"{self.where}: the runner exited ({self.proc.returncode}): {self.stderr_tail() or 'no message'}")) \
                from exc
        finally:
            if timer is not None:
                timer.cancel()
        if not reply.get("ok"):
            cls = _ERRORS.get(reply.get("type"), TargetRuntimeError)
            raise cls(f"{self.where}: {reply.get('error')}")
        return reply, out

    def close(self):
        if self.proc.poll() is None:
            try:
                self.request({"op": "close"}, timeout=30)
            except SlmedgeError:
                pass
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


class RemoteRuntime(Runtime):
    """``runtime`` (llama.cpp or onnxruntime) on a target, through a runner."""

    def __init__(self, runner: RunnerProcess, runtime: str, path: str, threads: int | None = None,
                 n_ctx: int = 2048, n_gpu_layers: int = 0):
        super().__init__(threads)
        self.name = runtime
        self.runner = runner
        self.remote_path = path
        self.n_ctx = n_ctx
        info, _ = runner.request({"op": "open", "runtime": runtime, "path": path, "threads": self.threads,
                                  "n_ctx": n_ctx, "n_gpu_layers": n_gpu_layers})
        self._vocab = int(info["vocab_size"])
        self.metadata = info.get("metadata") or {}
        self.n_params = info.get("n_params")
        self.providers = info.get("providers")
        self.logits_from = info.get("logits_from")  # where its scores come from, when the runtime says
        self.context = info.get("context")  # a program's own positions (ExecuTorch), when the runtime says
        self.local_path: Path | None = None  # the file on this machine the target's copy was made from

    def static_kv_cache(self) -> dict | None:
        """An ExecuTorch program's static cache, as on this machine: its positions from the runner, the
        config from the export folder here (only the program goes to the target)."""
        if self.name != "executorch" or not self.context or self.local_path is None:
            return None
        from ..backends.executorch import program_file, static_kv_cache

        return static_kv_cache(program_file(self.local_path).parent, int(self.context))

    def info(self) -> dict:
        return {**super().info(), **({"logits_from": self.logits_from} if self.logits_from else {})}

    @property
    def vocab_size(self) -> int:
        return self._vocab

    def logits(self, ids):
        _, arrays = self.runner.request({"op": "logits"}, [np.asarray(list(ids), dtype=np.int64)])
        return arrays[0]

    def continuation_scores(self, context, continuations):
        return self.score_groups([(context, continuations)])[0]

    def score_groups(self, groups):
        req = {"op": "score_groups", "groups": [{"context": [int(t) for t in c],
                                                 "continuations": [[int(t) for t in x] for x in conts]}
                                                for c, conts in groups]}
        reply, arrays = self.runner.request(req)
        flat, at, out = arrays[0], 0, []
        for (_, conts), greedy in zip(groups, reply["greedy"]):
            row = []
            for cont, g in zip(conts, greedy):
                row.append((np.array(flat[at : at + len(cont)]), bool(g)))
                at += len(cont)
            out.append(row)
        return out

    def timed_generate(self, prompt, n_gen):
        reply, _ = self.runner.request({"op": "timed_generate", "prompt": [int(t) for t in prompt], "n": int(n_gen)})
        return GenerationTiming(**reply["timing"])

    def _prefill(self, ids):  # generation runs on the target (timed_generate)
        raise NotImplementedError

    def _step(self, token, state, position):
        raise NotImplementedError

    def close(self):
        self.runner.close()
