"""slmedge: compress small language models, export them to edge runtimes, measure the result."""

__version__ = "0.1.0"

# torch's import-time deprecation lines (torchao's enums registered with torch.utils._pytree, once
# transformers or executorch imports torchao) are silenced before anything of slmedge imports torch, so
# that no entry point (the CLI, a subprocess, the library API) prints them; `--debug` keeps them.
from .quiet import quiet_torch_loggers as _quiet_torch_loggers  # noqa: E402 - logging only, no torch

_quiet_torch_loggers()
