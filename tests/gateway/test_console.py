"""The web console over HTTP, on a real `sandhold up`: signing in with a token
gives a strict HttpOnly session that shows that tenant's sandboxes and nothing
else, forms without their CSRF token are refused, and a session ends when it
is signed out, when its token is revoked or when its cookie is tampered with."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time

import httpx
from sandhold.gateway import tokens
from sandhold.gateway.console import SESSION_COOKIE

from tests.gateway.conftest import Gw, running_sandbox

_CSRF = re.compile(r'name="csrf" value="([^"]+)"')


def _browser(gw: Gw) -> httpx.AsyncClient:
    """A client with a cookie jar and no token: what a browser sends."""
    return httpx.AsyncClient(base_url=gw.url, timeout=30)


async def _signed_in(gw: Gw, token: str) -> tuple[httpx.AsyncClient, str]:
    """A browser signed in with `token`, and its session's CSRF token."""
    browser = _browser(gw)
    page = await browser.get("/sign-in")
    assert page.status_code == 200, page.text
    (csrf,) = _CSRF.findall(page.text)
    signed = await browser.post("/sign-in", data={"token": token, "csrf": csrf})
    assert signed.status_code == 303, signed.text
    assert signed.headers["location"] == "/sandboxes"
    listing = await browser.get("/sandboxes")
    assert listing.status_code == 200, listing.text
    (session_csrf,) = set(_CSRF.findall(listing.text))  # one per session, in every form
    return browser, session_csrf


async def test_a_session_is_strict_and_httponly_and_shows_only_its_tenants_sandboxes(
    gw: Gw, acme: httpx.AsyncClient, globex: httpx.AsyncClient
) -> None:
    mine = await running_sandbox(acme)
    theirs = await running_sandbox(globex)

    browser = _browser(gw)
    page = await browser.get("/sign-in")
    assert "frame-ancestors 'none'" in page.headers["content-security-policy"]
    (csrf,) = _CSRF.findall(page.text)
    signed = await browser.post("/sign-in", data={"token": gw.tokens["acme"], "csrf": csrf})
    assert signed.status_code == 303
    cookie = next(
        c for c in signed.headers.get_list("set-cookie") if c.startswith(SESSION_COOKIE + "=")
    )
    assert "httponly" in cookie.lower() and "samesite=strict" in cookie.lower(), cookie
    assert '"' not in cookie  # a value sent as it was set, never quoted
    assert gw.tokens["acme"] not in cookie  # the digest is kept, never the token

    async with contextlib.aclosing(browser):
        listing = await browser.get("/sandboxes")
        assert mine in listing.text and theirs not in listing.text
        assert "tenant acme" in listing.text
        running = await browser.get("/sandboxes", params={"phase": "running"})
        assert mine in running.text

        own = await browser.get(f"/sandboxes/{mine}")
        assert own.status_code == 200 and "running" in own.text
        # Another tenant's sandbox is the same 404 as one that does not exist.
        other = await browser.get(f"/sandboxes/{theirs}")
        missing = await browser.get("/sandboxes/sb-0000000000000000")
        assert (other.status_code, missing.status_code) == (404, 404)
        assert theirs in other.text and "running" not in other.text
        assert (await browser.get("/sandboxes/not-an-id")).status_code == 404


async def test_a_form_without_its_csrf_token_is_refused_and_changes_nothing(gw: Gw) -> None:
    browser = _browser(gw)
    async with contextlib.aclosing(browser):
        await browser.get("/sign-in")  # the sign-in cookie, but not its value in the form
        refused = await browser.post("/sign-in", data={"token": gw.tokens["acme"]})
        assert refused.status_code == 403 and "CSRF" in refused.text
        assert SESSION_COOKIE not in browser.cookies

    browser, csrf = await _signed_in(gw, gw.tokens["acme"])
    async with contextlib.aclosing(browser):
        # Another last character, whatever this one is: a token one place off.
        forged = csrf[:-1] + ("1" if csrf.endswith("0") else "0")
        wrong = await browser.post("/sign-out", data={"csrf": forged})
        assert wrong.status_code == 403
        assert (await browser.get("/sandboxes")).status_code == 200  # still signed in


async def test_signing_out_ends_the_session(gw: Gw) -> None:
    browser, csrf = await _signed_in(gw, gw.tokens["globex"])
    async with contextlib.aclosing(browser):
        out = await browser.post("/sign-out", data={"csrf": csrf})
        assert (out.status_code, out.headers["location"]) == (303, "/sign-in")
        after = await browser.get("/sandboxes")
        assert (after.status_code, after.headers["location"]) == (303, "/sign-in")


async def test_a_revoked_tokens_session_ends_at_its_next_request(gw: Gw) -> None:
    path = gw.up.data_dir / "tokens.json"
    entry, token = tokens.create(path, "acme", name="console-revoked")
    browser, _ = await _signed_in(gw, token)
    async with contextlib.aclosing(browser):
        assert tokens.revoke(path, entry.name)
        after = await browser.get("/sandboxes")
        assert (after.status_code, after.headers["location"]) == (303, "/sign-in")


async def test_a_tampered_or_foreign_session_cookie_counts_as_signed_out(gw: Gw) -> None:
    browser, _ = await _signed_in(gw, gw.tokens["acme"])
    async with contextlib.aclosing(browser):
        value = browser.cookies[SESSION_COOKIE]
        body, _, signature = value.partition(".")
        for forged in (
            body + "." + "0" * len(signature),  # a signature it was not given
            "x" + value,  # a payload that is not the one signed
            "not a session",
            "",
        ):
            browser.cookies.set(SESSION_COOKIE, forged)
            page = await browser.get("/sandboxes")
            assert (page.status_code, page.headers["location"]) == (303, "/sign-in"), forged


async def test_malformed_sign_in_input_and_filters_get_a_clear_error(gw: Gw) -> None:
    browser = _browser(gw)
    async with contextlib.aclosing(browser):
        (csrf,) = _CSRF.findall((await browser.get("/sign-in")).text)
        for token, says in (
            ("", "Enter a token."),
            ("x" * 201, "That is not a token"),
            ("sht_\x07bell", "That is not a token"),
            ("sht_nobody-has-this-one", "No such token"),
        ):
            page = await browser.post("/sign-in", data={"token": token, "csrf": csrf})
            assert page.status_code == 401 and says in page.text, token
            assert SESSION_COOKIE not in browser.cookies

    browser, _ = await _signed_in(gw, gw.tokens["acme"])
    async with contextlib.aclosing(browser):
        bad = await browser.get("/sandboxes", params={"phase": "<script>"})
        assert bad.status_code == 400
        assert "&lt;script&gt;" in bad.text and "<script>" not in bad.text


async def test_pages_need_a_session(gw: Gw) -> None:
    async with _browser(gw) as browser:
        for path in ("/", "/sandboxes", "/sandboxes/sb-0000000000000000"):
            page = await browser.get(path)
            assert (page.status_code, page.headers["location"]) == (303, "/sign-in"), path
        # An API token is not a session: the pages want the cookie.
        page = await browser.get("/sandboxes", headers=gw.headers("acme"))
        assert page.status_code == 303


async def test_the_tasks_and_hosts_pages_show_this_tenants_part(
    gw: Gw, acme: httpx.AsyncClient
) -> None:
    submitted = await acme.post(
        "/api/v1/tasks",
        content=b'name: console-task\nagent:\n  command: ["true"]\n',
        headers={"Content-Type": "application/yaml", "Idempotency-Key": "console-task"},
    )
    assert submitted.status_code == 202, submitted.text
    task_id = submitted.json()["id"]
    mine = await running_sandbox(acme)

    browser, _ = await _signed_in(gw, gw.tokens["acme"])
    async with contextlib.aclosing(browser):
        tasks = await browser.get("/tasks")
        assert tasks.status_code == 200 and task_id in tasks.text and "console-task" in tasks.text
        assert (await browser.get("/tasks", params={"state": "nonsense"})).status_code == 400
        # The page and the API agree (the task's own sandbox may still be moving:
        # compared again until both are read with nothing changing in between).
        deadline = time.monotonic() + 60
        while True:
            listed = (await acme.get("/api/v1/sandboxes", params={"limit": 500})).json()["items"]
            gone = ("stopped", "deleted", "failed")
            on_local = [v["id"] for v in listed if v["host"] == "local" and v["phase"] not in gone]
            assert mine in on_local
            hosts = await browser.get("/hosts")
            assert hosts.status_code == 200
            row = re.search(r"<td>local</td><td>live</td>.*?</tr>", hosts.text)
            assert row is not None, hosts.text
            if f"<td>{len(on_local)} of " in row.group(0):
                break
            assert time.monotonic() < deadline, (on_local, row.group(0))
            await asyncio.sleep(0.2)

    other, _ = await _signed_in(gw, gw.tokens["globex"])
    async with contextlib.aclosing(other):
        assert task_id not in (await other.get("/tasks")).text


async def test_a_sandbox_pages_events_and_status_are_this_tenants_only(
    gw: Gw, acme: httpx.AsyncClient, globex: httpx.AsyncClient
) -> None:
    mine = await running_sandbox(acme)
    theirs = await running_sandbox(globex)
    browser, _ = await _signed_in(gw, gw.tokens["acme"])
    async with contextlib.aclosing(browser):
        page = await browser.get(f"/sandboxes/{mine}")
        assert f'data-events="/sandboxes/{mine}/events"' in page.text
        assert (await browser.get("/console.js")).status_code == 200
        # The page's event stream, read as one JSON page: the whole history, unnamed.
        events = await browser.get(
            f"/sandboxes/{mine}/events", headers={"Accept": "application/json"}
        )
        types = [e["type"] for e in events.json()["events"]]
        assert types[:2] == ["sandbox.created", "sandbox.placed"], types
        # Resumed after the first: the rest, without it.
        rest = await browser.get(
            f"/sandboxes/{mine}/events",
            headers={
                "Accept": "application/json",
                "Last-Event-ID": str(events.json()["events"][0]["seq"]),
            },
        )
        assert [e["type"] for e in rest.json()["events"]] == types[
            1 : 1 + len(rest.json()["events"])
        ]
        async with browser.stream("GET", f"/sandboxes/{mine}/events") as live:
            # What a browser's EventSource insists on, or it drops the connection.
            assert live.headers["content-type"].startswith("text/event-stream")
        fragment = await browser.get(f"/sandboxes/{mine}/status")
        assert fragment.status_code == 200 and fragment.text.startswith("<dl>")
        for path in (f"/sandboxes/{theirs}/events", f"/sandboxes/{theirs}/status"):
            assert (
                await browser.get(path, headers={"Accept": "application/json"})
            ).status_code == 404


async def test_a_revoked_tokens_open_streams_end_too(gw: Gw, acme: httpx.AsyncClient) -> None:
    sandbox_id = await running_sandbox(acme)
    path = gw.up.data_dir / "tokens.json"
    entry, token = tokens.create(path, "acme", name="console-revoked-stream")
    browser, _ = await _signed_in(gw, token)
    urls = [f"/sandboxes/{sandbox_id}/events", "/changes/sandbox"]
    connected = {url: asyncio.Event() for url in urls}

    async def follow(url: str) -> None:
        async with browser.stream("GET", url, timeout=httpx.Timeout(120, connect=10)) as stream:
            assert stream.status_code == 200
            async for _ in stream.aiter_lines():
                connected[url].set()

    async with contextlib.aclosing(browser):
        followers = {url: asyncio.create_task(follow(url)) for url in urls}
        try:
            for url in urls:
                await asyncio.wait_for(connected[url].wait(), 30)
            assert tokens.revoke(path, entry.name)
            # Each closes at its next frame after a check (keep-alives come every
            # few seconds), without the client going away.
            done, _ = await asyncio.wait(followers.values(), timeout=60)
            still = [url for url, task in followers.items() if task not in done]
            assert not still, f"still open after the revocation: {still}"
            for task in done:
                task.result()
        finally:
            for task in followers.values():
                task.cancel()


async def test_a_form_from_another_origin_or_with_strange_input_is_refused_cleanly(
    gw: Gw, acme: httpx.AsyncClient
) -> None:
    sandbox_id = await running_sandbox(acme)
    browser, csrf = await _signed_in(gw, gw.tokens["acme"])
    async with contextlib.aclosing(browser):
        form = {"csrf": csrf, "key": "console-" + "1" * 32, "confirmed": "yes"}
        # A page on another port of this host is the same site, not the same origin.
        other = await browser.post(
            f"/sandboxes/{sandbox_id}/stop", data=form, headers={"Origin": "http://127.0.0.1:1"}
        )
        assert other.status_code == 403 and "Nothing was done" in other.text
        odd = await browser.post(f"/sandboxes/{sandbox_id}/stop", data={**form, "csrf": "é"})
        assert odd.status_code == 403  # not a 500
        (await browser.get("/sign-in"))
        signed_in_odd = await browser.post("/sign-in", data={"token": "x", "csrf": "é"})
        assert signed_in_odd.status_code == 403
        assert (await acme.get(f"/api/v1/sandboxes/{sandbox_id}")).json()["phase"] == "running"
        # An id with a trailing newline is no id: the same 404 as any other.
        for url in (
            f"/sandboxes/{sandbox_id}%0A",
            f"/sandboxes/{sandbox_id}%0A/status",
        ):
            assert (await browser.get(url)).status_code == 404, url
        missing = await acme.get(f"/api/v1/sandboxes/{sandbox_id}%0A")
        assert missing.status_code == 404 and missing.json()["code"] == "sandbox_not_found"


def test_the_status_block_says_nothing_is_at_risk_while_the_files_are_a_saves() -> None:
    """Decision 051: a sandbox unchanged since its last save has RPO 0, in words."""
    from sandhold.domain.views import SandboxView
    from sandhold.gateway.console.sandboxes import _sandbox_status

    base = dict(id="sb-1", tenant="t", phase="running", host="h1", generation=1, created_at=0.0)
    unchanged = SandboxView(**base, rpo_s=0.0, unchanged_since_save="sv-00000000000000a1")
    changed = SandboxView(**base, rpo_s=42.0)
    assert "0 s (unchanged since its last save)" in _sandbox_status(unchanged)
    assert "42 s" in _sandbox_status(changed)
    assert "unchanged" not in _sandbox_status(changed)
