"""Exporters: Prometheus (pull, per-rank endpoint), OpenTelemetry traces (OTLP or local OTLP-JSON)."""
