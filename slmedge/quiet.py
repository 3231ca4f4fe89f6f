"""What other libraries print on their own, kept out of slmedge's output in one place.

transformers, huggingface_hub, torch, onnx and the rest write notices a person running slmedge
cannot act on ("You are using the default legacy behaviour of the LlamaTokenizerFast...", progress
bars of a download that is a cache hit, deprecation warnings about their own internals) between
the tables slmedge prints. ``quiet_libraries()`` silences them for this process and for the
processes it starts (study workers, memory probes, runners: through the environment):

- transformers' and huggingface_hub's logging at ERROR, their progress bars off;
- Python warnings raised from any module outside slmedge ignored (slmedge's own still show:
  they say something about the user's model or settings);
- the root logger at ERROR, so a library's stray ``logger.warning`` finds no handler to print it;
- torch's own loggers that speak at import time (torch keeps a handler of its own on ``torch`` and
  sets that logger's level when it loads, so each child logger is set instead): torchao, which
  transformers imports whenever it is installed (the executorch extra brings it), registers enums
  with ``torch.utils._pytree`` and torch logs a deprecation line for each, on every command.

``slmedge --debug`` leaves all of it on (``DEBUG_ENV`` tells child processes so).
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

# Set by `slmedge --debug` for this process and its children: nothing is silenced.
DEBUG_ENV = "SLMEDGE_DEBUG"

# Read by the libraries when they are imported (and inherited by child processes).
_LIBRARY_ENV = {"TRANSFORMERS_VERBOSITY": "error", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
                "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}

# torch's loggers that write notices at import (see the module's docstring); levels set before or
# after torch loads both hold, since torch resets only the "torch" logger itself.
_TORCH_LOGGERS = ("torch.utils._pytree",)

# Warnings raised in slmedge's own modules: these are messages for the user.
_OURS = r"slmedge(\.|$)"


def debugging() -> bool:
    return os.environ.get(DEBUG_ENV) == "1"


def set_debug() -> None:
    """``--debug``: every library speaks, here and in the processes started from here."""
    os.environ[DEBUG_ENV] = "1"
    for name in _TORCH_LOGGERS:  # silenced when slmedge was imported (see ``slmedge/__init__.py``)
        logging.getLogger(name).setLevel(logging.NOTSET)


def quiet_torch_loggers() -> None:
    """torch's import-time notices (see the module's docstring) off, unless ``--debug``; also for code
    that imports torchao outside a command (the library API)."""
    if debugging():
        return
    for name in _TORCH_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)


def quiet_libraries(own_warnings: bool = True) -> None:
    """Keep third-party notices out of slmedge's output (see the module's docstring); nothing under
    ``--debug``. ``own_warnings=False`` also drops slmedge's own warnings (a study's worker, whose
    results carry their notes instead). Call it before the libraries are imported where possible;
    transformers' logging is also set on an already imported transformers."""
    if debugging():
        return
    for key, value in _LIBRARY_ENV.items():
        os.environ.setdefault(key, value)
    warnings.filterwarnings("ignore")
    if own_warnings:  # inserted in front of the "ignore": slmedge's own warnings still show
        warnings.filterwarnings("default", module=_OURS)
    logging.getLogger().setLevel(logging.ERROR)
    quiet_torch_loggers()
    if "transformers" in sys.modules:
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()
        transformers_logging.set_verbosity_error()
