"""Exceptions with messages written for the people who run slmedge.

The CLI prints ``str(error)`` on one line and exits with ``error.exit_code``; library users
catch :class:`SlmedgeError` (or a subclass) and get the same sentence.
"""


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


class UnsupportedArchitectureError(SlmedgeError):
    """The model's architecture has no entry in slmedge's architecture table."""


class GGUFImportMismatchError(SlmedgeError):
    """transformers' import of a GGUF file disagrees with llama.cpp on the same file."""


class DataError(SlmedgeError):
    """Calibration or evaluation data is missing, empty or malformed."""


class OutputExistsError(SlmedgeError):
    """The output location already holds something and --overwrite was not given."""


class ArtifactError(SlmedgeError):
    """An artifact directory is incomplete, corrupt, or fails its checksums."""


class RuntimeNotInstalledError(SlmedgeError):
    """An optional runtime (llama.cpp, onnxruntime...) is not installed."""


class CorruptModelError(SlmedgeError):
    """A model file its runtime cannot load."""


class TargetError(SlmedgeError):
    """A target cannot run this evaluation (unreachable, missing runtime, too little RAM...)."""
