"""The Grafana dashboards, written as code (grafana-foundation-sdk) and committed as JSON: ``python -m dashboards.generate``."""
