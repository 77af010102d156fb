"""The metrics service: the log folded into Prometheus metrics."""
