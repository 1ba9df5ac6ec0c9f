"""The one place the version is written: pyproject.toml reads it, the package and its exporters import it."""

__version__ = "0.2.0"
