"""Detectors: named alerts for the hybrid-parallel failure modes (see ``component.ALL_DETECTORS``)."""

from hpar_agent.detectors.component import ALL_DETECTORS, DetectorsComponent

__all__ = ["ALL_DETECTORS", "DetectorsComponent"]
