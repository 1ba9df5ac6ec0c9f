"""Benchmarks of what the agent costs (README.md says which measures what); not part of the wheel."""
