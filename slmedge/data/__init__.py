"""Calibration sets, perplexity corpora and task files: shipped with the package (``files``), a
user's folder laid over them, local files, the Hugging Face Hub."""

# The calibration text slmedge compresses with unless told otherwise (``compress``, ``imatrix``, ``run``,
# a study's [calibration]): C4 and the shipped multilingual text, half the windows each, the languages
# taking turns. Measured against C4 alone and the multilingual text alone on the 14 shipped languages
# (benchmarks/calibration.py; docs/benchmarks.md, "Calibration text").
DEFAULT_CALIBRATION = "c4+multilingual"
