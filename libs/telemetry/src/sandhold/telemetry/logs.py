"""Structured logs: one JSON object per line when stderr is not a terminal.

Every line names the service, the ids of what is being worked on (from
`context.span(..., sandbox_id=...)`, or `extra={"sandbox_id": ...}`) and the
trace id. `SANDHOLD_LOG` sets levels the way `RUST_LOG` does: a default level
and per-logger overrides, e.g. `info`, `debug` or
`warning,sandhold.scheduler=debug,nats=error`. `SANDHOLD_LOG_FORMAT=json|text`
overrides the terminal check.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import TextIO

import msgspec
from sandhold.telemetry import context

# Ids a caller may pass with `extra=`; they join the line like the context's ids.
ID_FIELDS = ("sandbox_id", "command_id", "task_id", "save_id", "host")

_encoder = msgspec.json.Encoder()


def parse_levels(spec: str) -> tuple[int, dict[str, int]]:
    """`"warning,sandhold.scheduler=debug"` -> (WARNING, {"sandhold.scheduler": DEBUG})."""
    default = logging.INFO
    overrides: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, level = part.rpartition("=")
        number = logging.getLevelName(level.strip().upper())
        if not isinstance(number, int):
            raise ValueError(
                f"SANDHOLD_LOG: {level!r} is not a level (debug, info, warning, error)"
            )
        if name:
            overrides[name.strip()] = number
        else:
            default = number
    return default, overrides


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self._service = service

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, object] = {
            "time": _iso(record.created),
            "level": record.levelname.lower(),
            "service": self._service,
            "logger": record.name,
            "message": record.getMessage(),
        }
        line.update(context.log_fields())
        for field in ID_FIELDS:
            value = record.__dict__.get(field)
            if value is not None:
                line[field] = value
        trace_id = context.trace_id()
        if trace_id:
            line["trace_id"] = trace_id
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return _encoder.encode(line).decode()


class TextFormatter(logging.Formatter):
    """For a terminal: the usual line, with the ids in brackets at the end."""

    def __init__(self, service: str) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")
        self._service = service

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        ids = dict(context.log_fields())
        trace_id = context.trace_id()
        if trace_id:
            ids["trace_id"] = trace_id
        if not ids:
            return text
        return text + " [" + " ".join(f"{k}={v}" for k, v in ids.items()) + "]"


def configure(service: str, *, stream: TextIO | None = None) -> None:
    """Send every log line of this process to `stream` (stderr) as `service`."""
    stream = stream or sys.stderr
    default, overrides = parse_levels(os.environ.get("SANDHOLD_LOG", "info"))
    chosen = os.environ.get("SANDHOLD_LOG_FORMAT", "").strip().lower()
    as_json = chosen == "json" or (chosen != "text" and not stream.isatty())
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter(service) if as_json else TextFormatter(service))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(default)
    for name, level in overrides.items():
        logging.getLogger(name).setLevel(level)


def _iso(created: float) -> str:
    seconds = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created))
    return f"{seconds}.{int(created % 1 * 1000):03d}Z"
