"""`python -m sandhold.gateway --nats URL --data-dir DIR [--host H] [--port P]`"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from sandhold.bus.names import Names
from sandhold.bus.service import common_arguments, run_service
from sandhold.gateway.service import Gateway


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sandhold run gateway")
    common_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=0, help="port (default: a free one)")
    p.add_argument(
        "--fd",
        type=int,
        help="serve on this inherited listening socket instead of --host/--port",
    )
    p.add_argument(
        "--data-dir",
        default=".sandhold",
        help="where the read model and the token file live (default .sandhold)",
    )
    p.add_argument(
        "--read-model",
        help="the read model's SQLite file (default DATA/gateway/read-model.sqlite, "
        "DATA/gateway/INSTANCE/read-model.sqlite for an --instance): one per gateway",
    )
    p.add_argument("--tokens", help="the token file (default DATA/tokens.json)")
    p.add_argument(
        "--keepalive",
        type=float,
        default=float(os.environ.get("SANDHOLD_SSE_KEEPALIVE", "15")),
        help="seconds between SSE keep-alive comments (default 15, SANDHOLD_SSE_KEEPALIVE)",
    )
    return p


def main(argv: list[str] | None = None) -> None:
    def make(a: argparse.Namespace) -> Gateway:
        data = Path(a.data_dir)
        return Gateway(
            a.nats,
            Names(a.prefix),
            host=a.host,
            port=a.port,
            fd=a.fd,
            read_model_path=(
                Path(a.read_model) if a.read_model else read_model_path(data, a.instance)
            ),
            tokens_path=Path(a.tokens) if a.tokens else tokens_path(data),
            keepalive_s=a.keepalive,
        )

    run_service(make, parser(), argv)


def read_model_path(data_dir: Path, instance: str | None = None) -> Path:
    """Each gateway's own read model: `gateway/read-model.sqlite` for the one
    called `gateway`, `gateway/<instance>/read-model.sqlite` for any other
    (`gateway-2`), so gateways sharing a data dir never share the file."""
    if instance is None or instance == "gateway":
        return data_dir / "gateway" / "read-model.sqlite"
    if not instance or instance.startswith(".") or "/" in instance:
        raise ValueError(f"{instance!r} is not an instance name")
    return data_dir / "gateway" / instance / "read-model.sqlite"


def tokens_path(data_dir: Path) -> Path:
    return data_dir / "tokens.json"


if __name__ == "__main__":
    main()
