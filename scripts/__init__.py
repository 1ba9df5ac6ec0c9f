"""Developer tooling run from a clone (not shipped in the wheel): ``python scripts/gen_docs.py`` (the docs tables)."""
