"""Helpers shared by the tests and the benchmarks (OTLP receiver, live trainer runs, a real Prometheus
and Alertmanager, free ports). Not part of the product wheel: importable from the repository root, where
pytest (``pythonpath``) and ``python -m benchmarks.<name>`` both run."""
