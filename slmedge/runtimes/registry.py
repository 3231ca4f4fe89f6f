"""The runtimes slmedge can score and time a model in, registered where they are defined.

``@register_runtime("llama.cpp", ...)`` on a :class:`~slmedge.runtimes.base.Runtime` subclass
records what the rest of slmedge asks about a runtime: the files it runs (suffixes, or a test),
the export format a model source is turned into for it, how to open a file in it here, the
package that provides it (for versions and the install hint), and the bytes per KV-cache value.
Nothing else compares runtime names.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..errors import ConfigError
from ..registry import Registry


@dataclass(frozen=True)
class RuntimeSpec:
    name: str
    cls: type
    export_format: str | None = None  # what a model source is exported to for this runtime; None: runs sources
    suffixes: tuple[str, ...] = ()  # files it runs, by suffix
    recognizes: Callable[[Path], bool] | None = None  # files it runs, by a look (e.g. an export folder)
    module: str | None = None  # the import name of its engine (version on a target)
    package: str | None = None  # the pip distribution that provides it
    install: str = ""  # how to install it
    aliases: tuple[str, ...] = ()
    kv_bytes_per_value: int = 4  # its KV cache's element size (llama.cpp: f16)
    integer_kernels: bool = True  # quantized files run integer kernels (the roofline's compute peak)
    # It allocates its KV cache and every position's logits for the whole context when a file opens
    # (llama.cpp's n_ctx with logits_all): the memory an evaluation needs counts the context, not
    # only the longest sequence it runs (``evaluate.bounds``).
    holds_context: bool = False
    # How the emulated arm64 target gets it: "wheel" (its package's aarch64 wheel, in this machine's
    # version), "build" (cross-compiled by the emulation's builder for it), "" (not there).
    arm64: str = ""

    @property
    def runs_files(self) -> bool:
        return self.export_format is not None

    def runs(self, path: Path) -> bool:
        return (path.suffix.lower() in self.suffixes) or bool(self.recognizes and self.recognizes(path))

    def open_file(self, path, threads: int | None = None, n_ctx: int = 2048, gpu: bool = False, gpu_layers: int = -1):
        """The file opened in this runtime, in this process (on the GPU with ``gpu``)."""
        return self.cls.open_file(path, threads, n_ctx=n_ctx, gpu=gpu, gpu_layers=gpu_layers)


RUNTIMES: Registry = Registry("runtime")  # name -> RuntimeSpec


def register_runtime(name: str, **facts):
    """Class decorator: register a Runtime subclass under ``name`` (a duplicate name is refused)."""

    def wrap(cls):
        taken = {a for s in RUNTIMES.values() for a in (s.name, *s.aliases)}
        for alias in facts.get("aliases", ()):  # an alias may not shadow another runtime's name
            if alias in taken:
                raise ValueError(f"runtime '{alias}' registered twice ({cls.__qualname__})")
        RUNTIMES.add(name, RuntimeSpec(name=name, cls=cls, **facts), cls.__qualname__, taken)
        cls.name = name
        return cls

    return wrap


def unregister_runtime(name: str) -> None:
    """Remove a registration (for plug-ins registered by tests)."""
    RUNTIMES.remove(name)


def runtime_names() -> list[str]:
    return list(RUNTIMES)


def get_runtime(name: str) -> RuntimeSpec:
    """The runtime called ``name`` or one of its aliases; unknown: a ConfigError listing the choices."""
    key = name.lower()
    for spec in RUNTIMES.values():
        if key == spec.name.lower() or key in spec.aliases:
            return spec
    raise ConfigError(f"unknown runtime '{name}'; choose {', '.join(RUNTIMES)}")


def check_runtime_name(name: str) -> str:
    return get_runtime(name).name


def file_runtime(path) -> RuntimeSpec | None:
    """The runtime a file (or export folder) is in, or None for a model source (torch's)."""
    p = Path(path)
    for spec in RUNTIMES.values():
        if spec.runs_files and spec.runs(p):
            return spec
    return None


def source_runtime() -> RuntimeSpec:
    """The runtime that runs model sources in process (torch)."""
    for spec in RUNTIMES.values():
        if not spec.runs_files:
            return spec
    raise ConfigError("no runtime that runs model sources is registered")


def runtime_for_path(path) -> str:
    """The runtime a file implies: .gguf -> llama.cpp, .onnx or an ONNX folder -> onnxruntime, else torch."""
    spec = file_runtime(path)
    return spec.name if spec is not None else source_runtime().name
