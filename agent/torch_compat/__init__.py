"""Adapters over torch's private APIs: one module per torch surface, so a torch release that moves a
private name touches exactly one file. Every adapter feature-detects and degrades to "unavailable"
instead of raising into the agent."""
