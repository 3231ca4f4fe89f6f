"""Calibration sets and evaluation corpora: local files, ../shared/data, the Hugging Face Hub."""
