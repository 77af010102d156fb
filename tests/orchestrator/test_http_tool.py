"""Tool steps' HTTP: the egress policy, no redirects, and the total deadline,
against real local HTTP servers."""

from __future__ import annotations

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
