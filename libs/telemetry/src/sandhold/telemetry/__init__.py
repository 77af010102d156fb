"""Tracing, metrics and structured logs shared by every sandhold service."""
