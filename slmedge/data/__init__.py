"""Calibration sets, perplexity corpora and task files: shipped with the package (``files``), a
user's folder laid over them, local files, the Hugging Face Hub."""
