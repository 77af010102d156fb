"""A TCP forwarder: `python -m tests.support.forward LISTEN_ADDR PORT...` takes
connections on LISTEN_ADDR:PORT and joins each to 127.0.0.1:PORT.

It stands where a router would between a host in its own network namespace and
the control plane's NATS on loopback (NATS listens on 127.0.0.1 only): cutting
the host's link leaves both ends of a connection open and stalls it, as a real
partition does."""

from __future__ import annotations

import asyncio
import contextlib
import sys


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()


async def _serve(address: str, port: int) -> asyncio.Server:
    async def join(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pipe(reader, upstream_writer), _pipe(upstream_reader, writer))

    return await asyncio.start_server(join, address, port)


async def main(address: str, ports: list[int]) -> None:
    servers = [await _serve(address, port) for port in ports]
    print("forwarding", flush=True)
    await asyncio.gather(*(s.serve_forever() for s in servers))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], [int(p) for p in sys.argv[2:]]))
