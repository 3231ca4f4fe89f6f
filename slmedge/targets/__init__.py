"""Where an evaluation runs: target profiles (``targets/*.toml``), transports (this machine, an
emulated arm64 userland, a device over ssh, a CUDA GPU) and the roofline every latency figure is
set against. Kept import-light: ``runner`` ships to targets that have only numpy and a runtime."""
