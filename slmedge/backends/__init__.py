"""The native engines' Python bindings, loaded the one way slmedge loads them: llama.cpp
(``llamacpp``) and onnxruntime (``ort``). Below runtimes, exporters and model import alike (each
of them runs files in these engines), and free of torch, so they also run on targets."""
