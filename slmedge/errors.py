"""Exceptions with messages written for the people who run slmedge.

The CLI prints ``str(error)`` on one line and exits with ``error.exit_code``; library users
catch :class:`SlmedgeError` (or a subclass) and get the same sentence.

Exit codes (README.md, "Exit codes"): 2 for a bad setting (:class:`ConfigError`: an unknown name,
a value out of range, an impossible combination; the command line's own usage errors too), 1 for
a bad or missing input or an output location that cannot be used (every other error here), 130
for an interrupt.
"""

import re

# A library's advice to install something that runs code from models (transformers: "Please install the latest
# version with `pip install -U kernels`"; "pass trust_remote_code=True"): following it would run that code.
_CODE_ADVICE = re.compile(r"[^.;]*(?:pip install[^.;]*\bkernels\b|kernels`? is either not installed|"
                          r"trust_remote_code\s*=\s*True)[^.;]*[.;]?", re.IGNORECASE)


def without_code_advice(text: str) -> str:
    """``text`` without sentences advising to install a package that loads code from models, or to trust it."""
    cleaned = _CODE_ADVICE.sub("", text).strip()
    return cleaned if cleaned else "a library refused the model (its advice left out: it would run code from the model)"


def brief(exc: BaseException, limit: int = 300) -> str:
    """A library's exception as one line for a message: its first line, and where that only announces
    what follows (it ends with ':', as transformers 5's config validation errors do) the next line too;
    without any advice to install a package that runs code from models, or to trust them."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    text = lines[0]
    if text.endswith(":") and len(lines) > 1:
        text = f"{text} {lines[1]}"
    return without_code_advice(text)[:limit]


class SlmedgeError(Exception):
    """Base class: every error slmedge raises on purpose."""

    exit_code = 1


class ConfigError(SlmedgeError):
    """An impossible or unknown setting (bad bit width, sparsity, method name...)."""

    exit_code = 2


class ModelNotFoundError(SlmedgeError):
    """The model source names nothing that can be loaded."""


class ModelLoadError(SlmedgeError):
    """The model source exists but cannot be read (corrupt weights, bad config...)."""


class RemoteCodeError(ModelLoadError):
    """A model file names code to fetch or run (auto_map, a Hub kernel as the attention, trust_remote_code),
    refused before any library reads it unless the user trusts it."""


class UnsupportedArchitectureError(SlmedgeError):
    """The model's architecture has no entry in slmedge's architecture table."""


class CaptureError(SlmedgeError):
    """The calibration capture pass cannot stand in for a model's decoder blocks: the model's own
    loop hands a block something else than its hidden states, or a block's output has a form slmedge
    does not know."""


class GGUFImportMismatchError(SlmedgeError):
    """transformers' import of a GGUF file disagrees with llama.cpp on the same file."""


class DataError(SlmedgeError):
    """Calibration or evaluation data is missing, empty or malformed."""


class UnknownDataError(ConfigError, DataError):
    """A data set, task, corpus or language asked for by a name slmedge does not know: a bad
    setting (exit 2), and a DataError for code that catches those."""


class OutputError(SlmedgeError):
    """The output location cannot be used: it cannot be created or written, it is a file where a
    folder is needed (or the other way round), or it is an input of the same command."""


class OutputExistsError(OutputError):
    """The output location already holds something that may not be replaced (without --overwrite,
    or at all: what slmedge did not write there)."""


class DiskFullError(OutputError):
    """No space left where slmedge writes: the message names the path and about how much the write
    needed (``slmedge.fsutil.no_space``); nothing that looks complete is left there."""

    def __init__(self, message: str, path=None, needed: int | None = None):
        super().__init__(message)
        self.path, self.needed = path, needed


class ArtifactError(SlmedgeError):
    """An artifact directory is incomplete, corrupt, or fails its checksums."""


class RuntimeNotInstalledError(SlmedgeError):
    """An optional runtime (llama.cpp, onnxruntime...) is not installed."""


class CorruptModelError(SlmedgeError):
    """A model file its runtime cannot load."""


class TargetError(SlmedgeError):
    """A target cannot run this evaluation (unreachable, missing runtime, too little RAM...)."""
