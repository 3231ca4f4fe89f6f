"""Compression: quantization grid, methods, the sequential engine and the artifact."""
