"""The gateway shell: NATS, the read model, and uvicorn serving the app.

`run()` connects, opens (or rebuilds) the read model, starts following the
log, serves HTTP, and announces itself on `<prefix>.svc.ready` with its port.
`<prefix>.admin.rebuild-read-model` (core request/reply) rebuilds the read
model from the log; `sandhold admin rebuild-read-model` sends it. Every gateway
hears it and rebuilds its own read model (one each), answering with its
instance's name: a caller that wants them all collects every answer.
`<prefix>.api.<tenant>` is the same API over NATS, for tenants' own clients
(natsapi.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Iterator
from pathlib import Path

import msgspec
import uvicorn
from nats.aio.msg import Msg
from sandhold.bus.codec import reflected
from sandhold.bus.names import Names
from sandhold.bus.service import Shell, instance_name
from sandhold.gateway.app import create_app
from sandhold.gateway.natsapi import NatsApi
from sandhold.gateway.readmodel import ReadModel
from sandhold.gateway.tokens import Tokens
from sandhold.gateway.web import Context

log = logging.getLogger("sandhold.gateway")


def rebuild_subject(names: Names) -> str:
    return f"{names.prefix}.admin.rebuild-read-model"


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: the service shell owns signals."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class Gateway:
    name = "gateway"

    def __init__(
        self,
        nats_url: str,
        names: Names,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        fd: int | None = None,
        read_model_path: Path,
        tokens_path: Path,
        keepalive_s: float = 15.0,
    ) -> None:
        self._names = names
        self._shell = Shell(self.name, nats_url, names)
        self._host = host
        self._port = port
        self._fd = fd  # a listening socket handed down by `sandhold up`
        self._read_model_path = read_model_path
        self._tokens_path = tokens_path
        self._keepalive_s = keepalive_s
        self.port: int | None = None

    async def run(self) -> None:
        async with self._shell as shell:
            js = shell.js
            read_model = ReadModel(self._read_model_path, self._names)
            await read_model.open()
            shell.on_close(read_model.close)
            if read_model.position > await read_model.log_end(js):
                # The log is not the one this read model was built from (a new server).
                log.warning("read model is ahead of the log: rebuilding it")
                await read_model.rebuild(js)
            shell.spawn(read_model.follow(js), "read model")

            async def on_rebuild(msg: Msg) -> None:
                if reflected(msg.headers):
                    log.error("a bounced stored message on %s: dropped", msg.subject)
                    return
                instance = instance_name(self.name)
                try:
                    counts = await read_model.rebuild(js)
                    body: dict[str, object] = {"ok": True, "instance": instance, **counts}
                except Exception as err:  # noqa: BLE001 - reported to the caller
                    log.exception("read model rebuild failed")
                    body = {"ok": False, "instance": instance, "error": str(err)}
                await msg.respond(msgspec.json.encode(body))

            await shell.nc.subscribe(rebuild_subject(self._names), cb=on_rebuild)
            ctx = Context(
                shell.nc,
                self._names,
                read_model,
                Tokens(self._tokens_path),
                keepalive_s=self._keepalive_s,
            )
            app = create_app(ctx)
            api = NatsApi(shell.nc, self._names, app)
            await api.start()
            shell.on_close(api.close)
            server = _Server(
                uvicorn.Config(
                    app,
                    host=self._host,
                    port=self._port,
                    log_level="warning",
                    access_log=False,
                    lifespan="off",
                    timeout_graceful_shutdown=2,
                )
            )
            sockets = None if self._fd is None else [socket.socket(fileno=self._fd)]
            serving = asyncio.create_task(server.serve(sockets=sockets))
            try:
                while not server.started:
                    if serving.done():
                        await serving  # raises why it could not start (port in use)
                        raise RuntimeError("the HTTP server stopped before it started")
                    await asyncio.sleep(0.02)
                self.port = server.servers[0].sockets[0].getsockname()[1]
                shell.spawn(_while_serving(serving), "HTTP server")
                log.info("gateway ready on http://%s:%d", self._host, self.port)
                await shell.serve(port=self.port, address=self._host)
            finally:
                server.should_exit = True
                with contextlib.suppress(BaseException):
                    await asyncio.wait_for(serving, 5)

    async def shutdown(self) -> None:
        self._shell.stop()


async def _while_serving(serving: asyncio.Task[None]) -> None:
    """Ends the gateway if its HTTP server stops by itself (it is the gateway)."""
    await asyncio.shield(serving)
    raise RuntimeError("the HTTP server stopped")
