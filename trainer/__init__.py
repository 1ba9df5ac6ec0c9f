"""Reference hybrid-parallel (DP x TP x PP) GPT trainer with reproducible failure injections."""

from hpar_agent._version import __version__

__all__ = ["__version__"]
