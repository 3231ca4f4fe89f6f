"""The compression methods, registered by name at their definition."""

from . import awq, gptq, magnitude, rtn, sparsegpt, wanda  # noqa: F401  (registration)
from .base import METHODS, LinearResult, Method, get_method, register_method

__all__ = ["METHODS", "LinearResult", "Method", "get_method", "register_method"]
