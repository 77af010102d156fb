"""Tracing, metrics and structured logs shared by every sandhold service.

`context` is what the bus calls on every message (cheap when tracing is off);
`tracing`, `metrics` and `logs` are configured once per process by `setup`.
"""

from __future__ import annotations


def setup(service: str, *, metrics_port: int | None = None) -> int | None:
    """Logs, tracing (if the environment asks for it) and, given a port, `/metrics`.

    Returns the port `/metrics` listens on, if any.
    """
    # Imported here, not with the package: `context` alone is on every path,
    # and the CLI's start-up must not pay for metrics and tracing.
    from sandhold.telemetry import logs, metrics, tracing

    logs.configure(service)
    tracing.configure(service)
    if metrics_port is None:
        return None
    return metrics.serve(service, metrics_port)
