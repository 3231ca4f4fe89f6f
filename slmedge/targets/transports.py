"""How an evaluation reaches a target, one registered transport per kind of profile: this machine
in process (``local``, ``cuda``), or a runner elsewhere: a child process here, an aarch64 Python
under qemu user mode (``emulation``), a device's Python over ssh. A runner transport starts
``slmedge.targets.runner`` (shipped as one zip file), places model files where the runner can
read them, and checks what the target has; every transport opens a runtime there
(``open_runtime``).

No shell string is built from user input: local and emulated runners are started from argument
lists; over ssh the remote command is fixed words plus paths that must match a strict pattern
and are quoted besides. Host keys are checked (``StrictHostKeyChecking=yes``).
"""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import ConfigError, RuntimeNotInstalledError, TargetError
from ..procs import child_options
from ..runtimes.memprobe import open_file_runtime
from ..runtimes.registry import get_runtime, runtime_names
from ..runtimes.remote import RemoteRuntime, RunnerProcess, TargetRuntimeError
from .registry import register_transport, transport_for  # noqa: F401 - transport_for: imported from here too
from .session import check_fits

if TYPE_CHECKING:
    from ..runtimes.base import Runtime
    from .profiles import Profile

# What the runner needs on a target: every runtime and engine binding (numpy and one engine, no
# torch) and the wire protocol. The targets package's own __init__ registers host-side
# transports: an empty one there.
_BUNDLE = ["__init__.py", "errors.py", "fsutil.py", "procs.py", "quiet.py", "registry.py", "targets/runner.py"]
_BUNDLE_PACKAGES = ["backends", "runtimes"]
_STUBS = {"slmedge/targets/__init__.py": b'"""The runner side of slmedge.targets."""\n'}
_MAIN = "import sys\nfrom slmedge.targets.runner import main\nsys.exit(main())\n"


def runner_bundle() -> Path:
    """The runner as one zip file Python can run (``python runner.pyz``), built into the cache."""
    from ..paths import cache_dir

    pkg = Path(__file__).resolve().parents[1]
    files = _BUNDLE + [p.relative_to(pkg).as_posix() for d in _BUNDLE_PACKAGES for p in sorted((pkg / d).glob("*.py"))]
    blobs = {f"slmedge/{rel}": (pkg / rel).read_bytes() for rel in files} | _STUBS
    digest = hashlib.sha256(b"".join(k.encode() + v for k, v in sorted(blobs.items())) + _MAIN.encode()).hexdigest()
    out = cache_dir() / "targets" / f"runner-{digest[:16]}.pyz"
    if not out.is_file():
        from ..fsutil import output_lock, temp_name

        with output_lock(out, wait=True):
            if not out.is_file():
                tmp = temp_name(out, "file")
                try:
                    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as z:
                        z.writestr("__main__.py", _MAIN)
                        for name, data in sorted(blobs.items()):
                            z.writestr(name, data)
                    os.replace(tmp, out)
                finally:
                    tmp.unlink(missing_ok=True)
    return out


@dataclass
class Check:
    what: str
    ok: bool
    detail: str = ""
    hint: str = ""


class Transport:
    """A way to reach a target. The base class is a runner transport: runtimes open in a runner
    process that ``runner_argv`` starts; in-process transports override ``open_runtime``."""

    kind = ""  # set by @register_transport
    emulated = False  # its timings are not the device's
    in_process = False  # runtimes (torch too) run in this process
    torch_device = "cpu"

    def __init__(self, profile: Profile):
        self.profile = profile
        self._versions: dict | None = None

    @classmethod
    def check_profile(cls, data: dict, where: str) -> None:
        """Refuse a profile of this transport that cannot work (raises ConfigError); fill defaults."""
        torch = [r for r in data.get("runtimes", []) if not get_runtime(r).runs_files]
        if not cls.in_process and torch:
            raise ConfigError(f"{where}: the runner on {cls.kind} targets runs model files "
                              f"({', '.join(n for n in runtime_names() if get_runtime(n).runs_files)}), not {torch[0]}")
        if not cls.in_process:
            data.setdefault("runtimes", [n for n in runtime_names() if get_runtime(n).runs_files])

    @classmethod
    def runtime_refusal(cls, profile: Profile, runtime: str) -> str | None:
        """Why ``profile`` cannot run ``runtime`` (one line), or None where it can. Asked before anything
        is copied or started, and by a study file's check for each target and export format. This machine's
        CPU runs whatever runtime is installed (a plugin's too); an accelerator in this process refuses a
        runtime its profile does not list (ExecuTorch's bindings, onnxruntime-genai's CPU build on the cuda
        target), which would run on the CPU under the target's name."""
        if runtime in profile.runtimes or (cls.in_process and cls.torch_device == "cpu"):
            return None
        return f"target '{profile.name}' offers {', '.join(profile.runtimes)}, not {runtime}"

    def detect(self) -> None:
        """Fill a ``detect = true`` profile from the machine it describes (cores, RAM, bandwidth)."""

    @classmethod
    def memory_available(cls, profile: Profile) -> int | None:
        """The bytes a run on this target may allocate now: this machine's (its runtimes, a runner
        or qemu run here); None where it is not known."""
        from ..fsutil import memory_available

        return memory_available()

    @classmethod
    def cpu_count(cls, profile: Profile) -> int | None:
        """The cores a run's threads share on this target: this machine's (emulated threads run on them too)."""
        from ..limits import usable_cpus

        return usable_cpus()

    def is_set_up(self) -> bool:
        """Whether the environment ``setup`` builds is there and current."""
        raise self._no_setup()

    def setup(self, log=print, rebuild: bool = False, llama_cpp: bool = True) -> dict:
        """Build what this target needs once (an emulated userland); most transports need nothing."""
        raise self._no_setup()

    def _no_setup(self) -> ConfigError:
        return ConfigError(f"target '{self.profile.name}' ({self.kind}) needs no setup; `slmedge targets check "
                           f"{self.profile.name}` says what it has")

    @property
    def target_versions(self) -> dict:
        """What the runner reports about the target (asked once)."""
        if self._versions is None:
            self._versions = self.versions()
        return self._versions

    def open_runtime(self, runtime: str, path, threads: int | None, n_ctx: int) -> "Runtime":
        """``runtime`` with the model file ``path`` opened on the target: checked against the
        target's RAM before anything is copied, then placed there and served by a runner."""
        why = self.runtime_refusal(self.profile, runtime)
        if why:
            raise ConfigError(why)
        check_fits(self.profile, Path(path))
        self.require_runtime(runtime, self.target_versions)
        remote = self.put(Path(path))
        rt = RemoteRuntime(self.start(), runtime, remote, threads or self.profile.threads or None, n_ctx)
        rt.local_path = Path(path)
        return rt.placed(self, self.target_versions)

    @property
    def where(self) -> str:
        return f"target '{self.profile.name}'"

    def runner_argv(self, args: list[str]) -> list[str]:
        raise NotImplementedError

    def runner_env(self) -> dict | None:
        return None

    def put(self, path: Path) -> str:
        """Make a model file readable by the runner; its path there."""
        return str(Path(path).resolve())

    def start(self) -> RunnerProcess:
        return RunnerProcess(self.runner_argv([]), self.where, env=self.runner_env(), timeout=self.timeout,
                             describe_exit=self.describe_exit)

    timeout: float | None = None

    def describe_exit(self, code, stderr: str):
        return None

    def versions(self) -> dict:
        """Python, numpy and runtime versions the runner sees on the target."""
        import json

        try:
            proc = subprocess.run(self.runner_argv(["versions"]), capture_output=True, text=True,
                                  env=self.runner_env(), timeout=self.timeout or 600, **child_options())
        except subprocess.TimeoutExpired as exc:
            raise TargetError(f"{self.where}: the runner did not answer within {self.timeout or 600:.0f} s") from exc
        except OSError as exc:
            raise TargetError(f"{self.where}: cannot start the runner: {exc}") from exc
        if proc.returncode != 0:
            err = self.describe_exit(proc.returncode, proc.stderr.strip())
            if err is not None:
                raise err
            raise TargetError(f"{self.where}: the runner failed: {proc.stderr.strip()[-400:] or proc.returncode}")
        return json.loads(proc.stdout.strip().splitlines()[-1])

    def memprobe(self, runtime: str, path: str, threads: int, tokens: int = 128) -> dict:
        import json

        proc = subprocess.run(self.runner_argv(["memprobe", runtime, path, str(threads), str(tokens)]),
                              capture_output=True, text=True, env=self.runner_env(), timeout=self.timeout or 3600,
                              **child_options())
        if proc.returncode != 0:
            raise TargetRuntimeError(f"{self.where}: the memory probe failed: {proc.stderr.strip()[-300:]}")
        return json.loads(proc.stdout.strip().splitlines()[-1])

    def checks(self) -> list[Check]:
        out = []
        try:
            v = self.versions()
        except (TargetError, TargetRuntimeError) as exc:
            return [Check("runner starts", False, str(exc), self.start_hint())]
        out.append(Check("runner starts", True, f"Python {v.get('python')} on {v.get('machine')}, numpy {v.get('numpy')}"))
        for rt in self.profile.runtimes:
            if not get_runtime(rt).runs_files:
                continue
            have = v.get(rt)
            out.append(Check(f"runtime {rt}", bool(have), f"version {have}" if have else "not importable",
                             "" if have else self.runtime_hint(rt)))
        return out

    def start_hint(self) -> str:
        return ""

    def runtime_hint(self, runtime: str) -> str:
        return f"pip install {get_runtime(runtime).package} (in the Python the target runs)"

    def require_runtime(self, runtime: str, versions: dict) -> None:
        if not versions.get(runtime):
            raise RuntimeNotInstalledError(f"{self.where} has no {runtime}: {self.runtime_hint(runtime)}")


class LocalChild(Transport):
    """This machine, the runner in a child process (the reference the other transports are
    compared with; ``targets check cpu`` asks it what this machine's Python has)."""

    def runner_argv(self, args):
        return [sys.executable, str(runner_bundle()), *args]

    def runner_env(self):
        env = dict(os.environ)
        env.pop("PYTHONPATH", None)
        return env


@register_transport("local")
class LocalTransport(LocalChild):
    """This machine, every runtime in this process."""

    in_process = True

    def detect(self) -> None:
        from .roofline import detect_this_machine

        detect_this_machine(self.profile)

    def open_runtime(self, runtime, path, threads, n_ctx):
        return open_file_runtime(runtime, path, threads, n_ctx=n_ctx)


# --- ssh --------------------------------------------------------------------------------------

# A leading "-" would read as an option to ssh, scp or the remote command: never allowed.
_SAFE = re.compile(r"^[A-Za-z0-9_./~+][A-Za-z0-9_./~+@:-]*$")


def _safe(value: str, what: str) -> str:
    if not _SAFE.match(value or "") or ".." in value.split("/"):
        raise ConfigError(f"{what} {value!r} has characters slmedge does not pass to a remote command "
                          "(letters, digits and _ . / ~ + - only, not starting with -)")
    return value


# Dot-folders under the home that are shared program data (XDG's), where a dedicated folder of the
# runner's may go (the default is .cache/slmedge-runner); every other dot-folder is some program's
# own (.ssh, .gnupg, .config...) and never the runner's.
_SHARED_DOT_FOLDERS = (".cache", ".local")


def check_workdir(value: str, where: str = "") -> str:
    """An ssh target's ``workdir`` must be a folder of slmedge's own, where the runner copies models
    and replaces files: under the user's home (a relative path, or ``~/...``) or under ``/tmp``; never
    ``/``, the home itself, ``/tmp`` itself, another user's home (``~root``), a path with ``..``, nor
    a dot-folder (``.ssh``) or anything inside one but the shared ``.cache`` and ``.local``."""
    prefix = f"{where}: " if where else ""
    text = value.strip()
    parts = [p for p in text.split("/") if p not in ("", ".")]

    def refuse(why: str):
        raise ConfigError(f"{prefix}[ssh] workdir {value!r} {why}: give a folder of its own under the remote "
                          "home (such as .cache/slmedge-runner) or under /tmp (such as /tmp/slmedge-runner)")

    if text.startswith("~") and not (text == "~" or text.startswith("~/")):
        refuse("is in another user's home")
    if text.startswith("~"):
        parts = parts[1:]
    elif text.startswith("/"):
        if parts[:1] != ["tmp"]:
            refuse("is outside the remote home and /tmp")
        parts = parts[1:]
    if ".." in parts:
        refuse("goes up with '..'")
    if not parts:
        refuse("is not a folder of its own")
    dots = [p for p in parts if p.startswith(".")]
    if parts[-1].startswith(".") or any(p not in _SHARED_DOT_FOLDERS for p in dots) or \
            (not text.startswith("/") and len(parts) == 1 and parts[0] in _SHARED_DOT_FOLDERS):
        refuse("is (or is inside) a dot-folder another program keeps")
    return value


@register_transport("ssh")
class SshTransport(Transport):
    """A device over ssh: the runner and the model file are copied to ``[ssh] workdir`` (unless the
    same bytes are there) and serve requests over the ssh connection; keys only, host keys checked."""

    @classmethod
    def check_profile(cls, data, where):
        if data.get("ssh") is None:
            raise ConfigError(f"{where}: an ssh target needs an [ssh] table with host = ...")
        ssh = data["ssh"]
        for key, what in (("host", "ssh host"), ("user", "ssh user"), ("python", "remote python"),
                          ("workdir", "remote workdir")):
            value = ssh.get(key) if isinstance(ssh, dict) else getattr(ssh, key, None)
            if isinstance(value, str) and value:  # refused when the profile is read, not first when it connects
                try:
                    _safe(value, what)
                except ConfigError as exc:
                    raise ConfigError(f"{where}: {exc}") from None
        workdir = ssh.get("workdir") if isinstance(ssh, dict) else getattr(ssh, "workdir", None)
        if workdir is not None:
            check_workdir(workdir, where)
        super().check_profile(data, where)

    @classmethod
    def memory_available(cls, profile: Profile) -> int | None:
        """The device's RAM from its profile, less the tenth the runtime, Python and the OS keep (as
        ``session.check_fits``); None where the profile does not say."""
        return int(0.9 * profile.ram_gb * (1 << 30)) if profile.ram_gb else None

    @classmethod
    def cpu_count(cls, profile: Profile) -> int | None:
        return profile.cores or None

    def __init__(self, profile: Profile):
        super().__init__(profile)
        s = profile.ssh
        self.s = s
        if not s.host:
            raise ConfigError(f"target '{profile.name}' has no [ssh] host: copy {profile.file} to "
                              f"~/.config/slmedge/targets/ (or $SLMEDGE_TARGETS) and set host, user and key")
        _safe(s.host, "ssh host")
        if s.user:
            _safe(s.user, "ssh user")
        _safe(s.python, "remote python")
        _safe(s.workdir, "remote workdir")
        check_workdir(s.workdir)
        self.timeout = s.command_timeout_s

    @property
    def where(self) -> str:
        return f"target '{self.profile.name}' ({self.dest})"

    @property
    def dest(self) -> str:
        return f"{self.s.user}@{self.s.host}" if self.s.user else self.s.host

    def _opts(self) -> list[str]:
        s = self.s
        known = s.known_hosts or str(Path.home() / ".ssh" / "known_hosts")
        opts = ["-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes", "-o", f"UserKnownHostsFile={known}",
                "-o", f"ConnectTimeout={max(1, int(s.connect_timeout_s))}", "-o", "ServerAliveInterval=15",
                "-o", "ServerAliveCountMax=4", "-o", "LogLevel=ERROR"]
        if s.key:
            opts += ["-i", str(Path(s.key).expanduser()), "-o", "IdentitiesOnly=yes"]
        return opts

    def _ssh(self, words: list[str]) -> list[str]:
        remote = " ".join(shlex.quote(w) for w in words)
        return ["ssh", *self._opts(), "-p", str(self.s.port), "--", self.dest, remote]

    def _run(self, words: list[str], timeout: float | None = None, stdin: bytes | None = None):
        try:
            proc = subprocess.run(self._ssh(words), input=stdin, capture_output=True,
                                  timeout=timeout or self.s.connect_timeout_s + 60, **child_options())
        except subprocess.TimeoutExpired as exc:
            raise TargetError(f"{self.where}: no answer within {timeout or self.s.connect_timeout_s + 60:.0f} s") from exc
        if proc.returncode == 255:
            raise self.describe_exit(255, proc.stderr.decode("utf-8", "replace"))
        return proc

    def describe_exit(self, code, stderr: str):
        if code != 255:
            return None
        text = stderr.strip().splitlines()[-1] if stderr.strip() else "ssh failed"
        low = stderr.lower()
        if "host key verification failed" in low or "no matching host key" in low:
            return TargetError(f"{self.where}: host key verification failed — add the host's key to "
                               f"{self.s.known_hosts or '~/.ssh/known_hosts'} (ssh-keyscan, checked by hand)")
        if "permission denied" in low or "too many authentication failures" in low:
            return TargetError(f"{self.where}: authentication failed ({text}); check [ssh] user and key")
        if "timed out" in low or "refused" in low or "no route" in low or "could not resolve" in low \
                or "unreachable" in low or "closed by remote host" in low:
            return TargetError(f"{self.where}: unreachable ({text})")
        return TargetError(f"{self.where}: ssh failed: {text}")

    def _remote(self, name: str) -> str:
        # Remote commands run in the home folder and their words are quoted (a "~" would not expand):
        # "~/x" is the relative "x".
        return f"{self.s.workdir.removeprefix('~/').rstrip('/')}/{name}"

    def _ensure(self, local: Path, name: str) -> str:
        """Copy ``local`` to the work folder unless the same bytes are there (checked by sha256)."""
        from ..fsutil import sha256_file

        remote = self._remote(name)
        want = sha256_file(local)
        proc = self._run(["sha256sum", remote])
        if proc.returncode == 0 and proc.stdout.split()[:1] == [want.encode()]:
            return remote
        self._run(["mkdir", "-p", remote.rsplit("/", 1)[0]])
        tmp = f"{remote}.part"
        dst = f"{self.dest}:{tmp}"
        scp = ["scp", "-q", *self._opts(), "-P", str(self.s.port), "--", str(local), dst]
        try:
            proc = subprocess.run(scp, capture_output=True, timeout=self.s.command_timeout_s, **child_options())
        except subprocess.TimeoutExpired as exc:
            raise TargetError(f"{self.where}: copying {local.name} did not finish in {self.s.command_timeout_s:.0f} s") \
                from exc
        if proc.returncode != 0:
            raise self.describe_exit(255, proc.stderr.decode("utf-8", "replace")) or \
                TargetError(f"{self.where}: copying {local.name} failed")
        self._run(["mv", "-f", tmp, remote])
        return remote

    def runner_argv(self, args):
        remote = self._ensure(runner_bundle(), "runner.pyz")
        return self._ssh([self.s.python, remote, *args])

    def put(self, path: Path) -> str:
        """The model file (an ONNX file with its external-data files beside it) in a folder of the
        work folder named after its local path; files already there with the same bytes are kept."""
        path = Path(path).resolve()
        folder = f"models/{path.parent.name}-{hashlib.sha256(str(path).encode()).hexdigest()[:10]}"
        from ..export.formats import format_for_path, get_format

        fmt = format_for_path(path)
        files = [path] + [p for p in (get_format(fmt).model_files(path) if fmt else []) if p != path]
        for f in files:
            _safe(f.name, "model file name")
            self._ensure(f, f"{folder}/{f.name}")
        return self._remote(f"{folder}/{path.name}")

    def start_hint(self):
        return f"ssh {self.dest} -p {self.s.port} must work without a password (key in [ssh] key, host key known)"


# --- cuda -------------------------------------------------------------------------------------


@register_transport("cuda")
class CudaTransport(LocalTransport):
    """The GPU back ends of this machine's runtimes, in process: torch on CUDA, onnxruntime's
    CUDA provider, llama.cpp with the profile's layers offloaded."""

    torch_device = "cuda"

    def detect(self) -> None:
        from .roofline import detect_cuda

        detect_cuda(self.profile)

    def open_runtime(self, runtime, path, threads, n_ctx):
        return open_file_runtime(runtime, path, threads, n_ctx=n_ctx, gpu=True, gpu_layers=self.profile.gpu_layers)

    def checks(self) -> list[Check]:
        out = []
        try:
            import torch

            ok = torch.cuda.is_available()
            out.append(Check("torch CUDA", ok, torch.cuda.get_device_name(0) if ok else f"torch {torch.__version__}: "
                             "no CUDA device", "" if ok else "a CUDA build of torch and an NVIDIA driver"))
        except ImportError:
            out.append(Check("torch CUDA", False, "torch missing", "pip install torch"))
        try:
            import onnxruntime as ort

            ok = "CUDAExecutionProvider" in ort.get_available_providers()
            out.append(Check("onnxruntime CUDA provider", ok, ", ".join(ort.get_available_providers()),
                             "" if ok else "pip install onnxruntime-gpu (instead of onnxruntime)"))
        except ImportError:
            out.append(Check("onnxruntime CUDA provider", False, "onnxruntime missing", "pip install onnxruntime-gpu"))
        try:
            from ..backends.llamacpp import require_llama_cpp

            lc = require_llama_cpp()
            ok = bool(lc.llama_supports_gpu_offload())
            out.append(Check("llama.cpp GPU offload", ok, f"llama-cpp-python {lc.__version__}",
                             "" if ok else "CMAKE_ARGS=-DGGML_CUDA=on pip install --force-reinstall --no-cache-dir "
                             "llama-cpp-python"))
        except RuntimeNotInstalledError:
            out.append(Check("llama.cpp GPU offload", False, "llama-cpp-python missing",
                             "CMAKE_ARGS=-DGGML_CUDA=on pip install llama-cpp-python"))
        return out
