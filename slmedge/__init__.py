"""slmedge: compress small language models, export them to edge runtimes, measure the result."""

__version__ = "0.1.0"
