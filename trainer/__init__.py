"""Reference hybrid-parallel (DP x TP x PP) GPT trainer with reproducible failure injections."""

__all__ = ["__version__"]
__version__ = "0.1.0"
