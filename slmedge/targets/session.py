"""Opening an evaluation's model on a target: the profile decides where (here, a GPU, qemu, a
device over ssh), the runtime, the threads; the model is checked against the target's RAM before
anything is copied."""

from __future__ import annotations

from pathlib import Path

from ..errors import ConfigError
from .profiles import Profile, TargetError
from .transports import Transport, transport_for


class TooLargeForTargetError(TargetError):
    """The model (and its KV cache) would not fit the target's RAM."""


def model_bytes(path: Path) -> int:
    p = Path(path)
    if p.is_dir():
        return sum(q.stat().st_size for q in p.iterdir() if q.is_file())
    if p.suffix == ".onnx":
        return sum(q.stat().st_size for q in p.parent.iterdir() if q.is_file() and q.name.startswith(p.name))
    return p.stat().st_size


def check_fits(profile: Profile, path: Path, kv_bytes: int | None = None) -> None:
    if not profile.ram_gb:
        return
    need = model_bytes(path) + (kv_bytes or 0)
    have = profile.ram_gb * (1 << 30)
    # The runtime, Python and the OS need room too: refuse above 90% of the RAM.
    if need > 0.9 * have:
        raise TooLargeForTargetError(
            f"{Path(path).name} needs {need / (1 << 30):.2f} GiB ({model_bytes(path) / (1 << 30):.2f} GiB of weights"
            + (f" + {kv_bytes / (1 << 30):.2f} GiB of KV cache" if kv_bytes else "")
            + f"), more than 90% of target '{profile.name}''s {profile.ram_gb:g} GiB RAM; nothing was copied")


class TargetSession:
    """Opens runtimes for ``open_subject`` on a remote or emulated target."""

    def __init__(self, profile: Profile, transport: Transport | None = None):
        self.profile = profile
        self.transport = transport or transport_for(profile)
        self._versions: dict | None = None

    @property
    def versions(self) -> dict:
        if self._versions is None:
            self._versions = self.transport.versions()
        return self._versions

    def factory(self, runtime: str, path, threads, n_ctx: int):
        from ..runtimes.remote import RemoteRuntime

        if runtime not in self.profile.runtimes:
            raise ConfigError(f"target '{self.profile.name}' offers {', '.join(self.profile.runtimes)}, not {runtime}")
        check_fits(self.profile, Path(path))
        self.transport.require_runtime(runtime, self.versions)
        remote = self.transport.put(Path(path))
        rt = RemoteRuntime(self.transport.start(), runtime, remote, threads or self.profile.threads or None, n_ctx,
                           target=self.profile.name, emulated=self.transport.emulated)
        rt.transport = self.transport
        rt.target_versions = self.versions
        return rt


def gpu_factory(profile: Profile):
    """Runtimes on this machine's GPU: onnxruntime's CUDA provider, llama.cpp with layers offloaded."""
    from ..runtimes import LlamaCppRuntime, OnnxRuntime

    def factory(runtime, path, threads, n_ctx):
        if runtime == "llama.cpp":
            return LlamaCppRuntime(path, threads, n_ctx=n_ctx, n_gpu_layers=profile.gpu_layers)
        return OnnxRuntime(path, threads, providers=["CUDAExecutionProvider", "CPUExecutionProvider"])

    return factory


def open_on_target(spec, runtime: str | None, threads: int | None, n_ctx: int, profile: Profile):
    """``open_subject`` where the profile says; returns the Subject."""
    from ..evaluate.subject import open_subject
    from ..runtimes import check_runtime_name, runtime_for_path

    threads = threads or profile.threads or None
    if runtime:
        runtime = check_runtime_name(runtime)
    if profile.transport == "local":
        return open_subject(spec, runtime, threads, n_ctx=n_ctx)
    if profile.transport == "cuda":
        return open_subject(spec, runtime, threads, n_ctx=n_ctx, device="cuda", factory=gpu_factory(profile))
    implied = runtime_for_path(Path(spec)) if spec and Path(spec).exists() else "torch"
    if runtime is None:
        runtime = implied if implied != "torch" else (profile.default_runtime or profile.runtimes[0])
    if runtime == "torch":
        raise ConfigError(f"target '{profile.name}' runs llama.cpp or onnxruntime; a torch model is exported for "
                          f"them: pass --runtime {' or --runtime '.join(profile.runtimes)}")
    session = TargetSession(profile)
    return open_subject(spec, runtime, threads, n_ctx=n_ctx, factory=session.factory)
