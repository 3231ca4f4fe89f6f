"""Evaluation metrics. The first one: perplexity and bits per byte over a corpus."""

from .perplexity import PerplexityResult, perplexity

__all__ = ["PerplexityResult", "perplexity"]
