"""Tool steps' HTTP: the egress policy, no redirects, and the total deadline,
against real local HTTP servers."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from sandhold.domain.task_manifest import RecordedHttpCall
from sandhold.orchestrator.http_tool import EgressDenied, HttpTool


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - the http.server API
        if self.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", "/target")
            self.end_headers()
        elif self.path == "/drip":
            self.send_response(200)
            self.send_header("Content-Length", "100")
            self.end_headers()
            for _ in range(100):  # a byte now and then: no socket read ever times out
                self.wfile.write(b".")
                self.wfile.flush()
                time.sleep(0.1)
        else:
            self.send_response(200)
            self.end_headers()
            self.wfile.write(f"{self.path} {self.headers['Idempotency-Key']}".encode())

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(10)


def _call(url: str, **kw) -> RecordedHttpCall:
    return RecordedHttpCall(url=url, method="GET", **kw)


async def test_public_egress_refuses_loopback_and_any_allows_it(server: str):
    public, anywhere = HttpTool(egress="public"), HttpTool(egress="any")
    try:
        with pytest.raises(EgressDenied, match="127.0.0.1"):
            await public.perform(_call(f"{server}/hook"), "k1")
        with pytest.raises(EgressDenied, match="169.254.169.254"):
            await public.perform(_call("http://169.254.169.254/latest/meta-data"), "k2")
        assert await anywhere.perform(_call(f"{server}/hook"), "k3") == (200, "/hook k3")
    finally:
        public.close()
        anywhere.close()


async def test_a_redirect_is_the_result_not_followed(server: str):
    tool = HttpTool(egress="any")
    try:
        status, _ = await tool.perform(_call(f"{server}/redirect"), "k")
        assert status == 302
    finally:
        tool.close()


async def test_the_step_limit_bounds_the_whole_call(server: str):
    tool = HttpTool(egress="any")
    try:
        with pytest.raises(TimeoutError):
            # A server dripping its body: urllib's per-read timeout (0.5 s) never
            # fires; the step's limit (+5 s grace) around the whole call does.
            await tool.perform(_call(f"{server}/drip", timeout=0.5), "k")
    finally:
        tool.close()


async def test_the_address_checked_is_the_address_connected_to(
    server: str, monkeypatch: pytest.MonkeyPatch
):
    """DNS rebinding: a name that answers a public address to the egress check and
    loopback to the connect. Resolved once, the request goes where it was checked
    (here nowhere: this machine has no route out), never to the loopback server."""
    port = int(server.rsplit(":", 1)[1])
    public, loopback = ("93.184.215.14", port), ("127.0.0.1", port)
    answers = iter([public, loopback, loopback])
    lookups: list[str] = []

    def rebinding(host: str, *_args: object, **_kwargs: object):
        lookups.append(host)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", next(answers))]

    real_connect = socket.create_connection
    connected: list[str] = []

    def connect(address: tuple[str, int], *args: object, **kwargs: object):
        connected.append(address[0])
        if address[0] == public[0]:
            raise OSError("no route out of this machine")
        return real_connect(address, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(socket, "getaddrinfo", rebinding)
    monkeypatch.setattr(socket, "create_connection", connect)
    tool = HttpTool(egress="public")
    try:
        with pytest.raises(OSError, match="no route out"):
            await tool.perform(_call(f"http://rebinding.example:{port}/hook"), "k")
    finally:
        tool.close()
    assert lookups == ["rebinding.example"] and connected == [public[0]]


async def test_proxy_settings_in_the_environment_are_ignored(
    server: str, monkeypatch: pytest.MonkeyPatch
):
    with socket.socket() as nowhere:
        nowhere.bind(("127.0.0.1", 0))  # a port nothing listens on
        proxy = f"http://127.0.0.1:{nowhere.getsockname()[1]}"
        for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "all_proxy"):
            monkeypatch.setenv(name, proxy)
        tool = HttpTool(egress="any")
        try:
            assert await tool.perform(_call(f"{server}/direct"), "k") == (200, "/direct k")
        finally:
            tool.close()
