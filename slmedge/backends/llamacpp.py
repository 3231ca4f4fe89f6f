"""llama.cpp's Python binding, loaded without torch (this module also runs on targets)."""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import sys

from ..errors import CorruptModelError, RuntimeNotInstalledError


def require_llama_cpp():
    try:
        import llama_cpp  # noqa: F401
    except ImportError as exc:
        raise RuntimeNotInstalledError(
            "llama.cpp's Python binding is not installed: pip install llama-cpp-python"
        ) from exc
    _close_bindings_null_files_at_exit()
    return llama_cpp


@functools.cache
def _close_bindings_null_files_at_exit() -> None:
    """llama-cpp-python opens two os.devnull files at import and never closes them, so every
    command that used it ended with two "ResourceWarning: unclosed file" lines; close them at exit."""
    utils = sys.modules.get("llama_cpp._utils")
    files = [getattr(utils, name, None) for name in ("outnull_file", "errnull_file")]
    atexit.register(lambda: [f.close() for f in files if f is not None and not f.closed])


@contextlib.contextmanager
def quiet_native_stderr():
    """Silence what llama.cpp's C code prints on fd 2 even with verbose=False."""
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # no real stderr (e.g. captured by a test runner)
        yield
        return
    saved = os.dup(fd)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), fd)
            yield
    finally:
        os.dup2(saved, fd)
        os.close(saved)


@contextlib.contextmanager
def vocab_only(gguf_path):
    """llama.cpp's vocabulary and metadata of a GGUF file, without its weights; closed afterwards.
    A file llama.cpp cannot read raises ValueError on entry."""
    llama_cpp = require_llama_cpp()
    with quiet_native_stderr():
        llm = llama_cpp.Llama(model_path=str(gguf_path), vocab_only=True, verbose=False)
    try:
        yield llm
    finally:
        llm.close()


def gguf_metadata(path) -> dict:
    """A GGUF file's key/values through llama.cpp's reader (vocabulary only: fast, unlike a full
    Python parse of the tokenizer arrays)."""
    try:
        with vocab_only(path) as llm:
            return dict(llm.metadata)
    except ValueError as exc:
        raise CorruptModelError(f"llama.cpp cannot read {path}: not a valid GGUF model") from exc
