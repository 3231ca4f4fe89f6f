"""Where an evaluation runs: target profiles (``shipped/*.toml``, linked from the repository's
``targets/``), transports (this machine, an emulated arm64 userland, a device over ssh, a CUDA
GPU) registered by name, and the roofline every latency figure is set against.

Importing the package registers the built-in transports. ``runner`` ships to targets that have
only numpy and a runtime, with an empty ``__init__`` in place of this one."""

from . import emulation, transports  # noqa: F401 - registers the built-in transports
