"""What a console user does to a sandbox, over HTTP on a real `sandhold up`:
create, run a command, snapshot (and delete it), stop and start, each from a form with its
CSRF token and a key of its own (the same form sent twice acts once), each but
create confirmed on a page first; a command's page and its live output; the
saves timeline; the sandbox as of a point in its history."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time

import httpx

from tests.gateway.conftest import Gw, running_sandbox
from tests.gateway.test_console import _signed_in

_KEY = re.compile(r'name="key" value="([^"]+)"')
_FORM = re.compile(r'<form method="post" action="(/sandboxes[^"]*)"[^>]*>(.*?)</form>', re.S)


def _form_key(html: str, action: str) -> str:
    """The key drawn into the form that posts to `action`."""
    for target, inner in _FORM.findall(html):
        if target == action:
            return _KEY.findall(inner)[0]
    raise AssertionError(f"no form for {action}")


async def _commands(acme: httpx.AsyncClient, sandbox_id: str) -> list[dict]:
    answer = await acme.get(f"/api/v1/sandboxes/{sandbox_id}/commands")
    assert answer.status_code == 200, answer.text
    return answer.json()["items"]


async def _until(check, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while True:
        found = await check()
        if found:
            return found
        assert time.monotonic() < deadline, "not within the deadline"
        await asyncio.sleep(0.2)


async def test_create_then_run_a_command_once_per_click_and_watch_it_end(
    gw: Gw, acme: httpx.AsyncClient
) -> None:
    browser, csrf = await _signed_in(gw, gw.tokens["acme"])
    async with contextlib.aclosing(browser):
        listing = await browser.get("/sandboxes")
        key = _form_key(listing.text, "/sandboxes")
        made = await browser.post("/sandboxes", data={"csrf": csrf, "key": key})
        assert made.status_code == 303, made.text
        sandbox_id = made.headers["location"].rsplit("/", 1)[1]
        again = await browser.post("/sandboxes", data={"csrf": csrf, "key": key})
        assert again.headers["location"] == made.headers["location"]  # one sandbox per click

        async def running() -> bool:
            shown = await acme.get(f"/api/v1/sandboxes/{sandbox_id}")
            return shown.json()["phase"] == "running"

        await _until(running)
        page = await browser.get(f"/sandboxes/{sandbox_id}")
        action = f"/sandboxes/{sandbox_id}/exec"
        form = {"csrf": csrf, "key": _form_key(page.text, action), "line": "echo hi; exit 5"}
        asked = await browser.post(action, data=form)
        assert asked.status_code == 200 and "Yes, run" in asked.text
        assert "echo hi; exit 5" in asked.text
        assert await _commands(acme, sandbox_id) == []  # nothing runs before the confirmation
        confirmed = {**form, "confirmed": "yes"}
        ran = await browser.post(action, data=confirmed)
        assert ran.status_code == 303, ran.text
        command_page = ran.headers["location"]
        assert (await browser.post(action, data=confirmed)).headers["location"] == command_page
        (command,) = await _commands(acme, sandbox_id)  # sent twice, run once
        assert command["argv"] == ["sh", "-c", "echo hi; exit 5"]

        shown = await browser.get(command_page)
        assert shown.status_code == 200 and 'data-output="' in shown.text
        frames = []
        async with browser.stream(
            "GET", command_page + "/output", headers={"Accept": "text/event-stream"}
        ) as stream:
            assert stream.status_code == 200
            async for line in stream.aiter_lines():
                if line.startswith("event:"):
                    frames.append(line.split(":", 1)[1].strip())
                if line.startswith("data:") and frames[-1] == "end":
                    end = json.loads(line[5:])
        assert frames[0] == "output" and frames[-1] == "end"
        assert end["state"] == "exited" and end["exit_code"] == 5
        status = await browser.get(command_page + "/status")
        assert "exit code 5" in status.text
        commands = await browser.get(f"/sandboxes/{sandbox_id}/commands")
        assert command["id"] in commands.text and "exit code 5" in commands.text


async def test_snapshot_stop_and_start_from_the_page_show_on_the_saves_timeline(
    gw: Gw, acme: httpx.AsyncClient
) -> None:
    sandbox_id = await running_sandbox(acme)
    browser, csrf = await _signed_in(gw, gw.tokens["acme"])
    here = f"/sandboxes/{sandbox_id}"

    async def act(action: str, **fields: str) -> httpx.Response:
        page = await browser.get(here)
        key = _form_key(page.text, f"{here}/{action}")
        data = {"csrf": csrf, "key": key, "confirmed": "yes", **fields}
        done = await browser.post(f"{here}/{action}", data=data)
        assert done.status_code == 303 and done.headers["location"] == here, done.text
        return done

    async with contextlib.aclosing(browser):
        await act("snapshot", name="milestone-1")

        async def snapshot_done() -> str | None:
            timeline = (await browser.get(f"{here}/saves")).text
            return timeline if "snapshot “milestone-1”: completed" in timeline else None

        timeline = await _until(snapshot_done)
        assert "recovery point" in timeline and "<svg" in timeline
        await act("stop")

        async def stopped() -> str | None:
            page = (await browser.get(here)).text
            return page if f'action="{here}/start"' in page else None

        await _until(stopped)
        # The page's buttons follow the phase without a reload: the block it fetches.
        offered = (await browser.get(f"{here}/actions")).text
        assert f'action="{here}/start"' in offered and f'action="{here}/stop"' not in offered
        timeline = (await browser.get(f"{here}/saves")).text
        assert "final: completed" in timeline
        await act("start")

        async def running_again() -> bool:
            return (await acme.get(f"/api/v1/sandboxes/{sandbox_id}")).json()["phase"] == "running"

        await _until(running_again)
        # The Snapshot deleted from its own button (decision 069): a save like the others.
        (snap,) = (await acme.get(f"/api/v1/sandboxes/{sandbox_id}/snapshots")).json()["items"]
        page = (await browser.get(here)).text
        assert f'name="save_id" value="{snap["id"]}"' in page
        await act("delete_snapshot", save_id=snap["id"])
        shown = (await acme.get(f"/api/v1/sandboxes/{sandbox_id}/saves/{snap['id']}")).json()
        assert (shown["kind"], shown["name"]) == ("scheduled", None)
        assert (await acme.get(f"/api/v1/sandboxes/{sandbox_id}/snapshots")).json()["items"] == []


async def test_malformed_or_foreign_actions_are_refused_and_change_nothing(
    gw: Gw, acme: httpx.AsyncClient, globex: httpx.AsyncClient
) -> None:
    mine = await running_sandbox(acme)
    theirs = await running_sandbox(globex)
    browser, csrf = await _signed_in(gw, gw.tokens["acme"])
    key = "console-" + "0" * 32
    async with contextlib.aclosing(browser):
        exec_ = f"/sandboxes/{mine}/exec"
        cases = [
            (exec_, {"key": key, "line": "true", "confirmed": "yes"}, 403),  # no CSRF
            (exec_, {"csrf": "0" * 64, "key": key, "line": "true", "confirmed": "yes"}, 403),
            (exec_, {"csrf": csrf, "key": key, "line": "  ", "confirmed": "yes"}, 400),
            (exec_, {"csrf": csrf, "key": "mine", "line": "true", "confirmed": "yes"}, 400),
            (exec_, {"csrf": csrf, "line": "true", "confirmed": "yes"}, 400),  # no key
            (f"/sandboxes/{mine}/snapshot", {"csrf": csrf, "key": key, "name": "../x"}, 422),
            (
                f"/sandboxes/{mine}/delete_snapshot",
                {"csrf": csrf, "key": key, "save_id": "../x", "confirmed": "yes"},
                400,
            ),
            (
                f"/sandboxes/{mine}/delete_snapshot",
                {"csrf": csrf, "key": key, "save_id": "sv-0123456789abcdef", "confirmed": "yes"},
                404,
            ),
            (f"/sandboxes/{mine}/reboot", {"csrf": csrf, "key": key}, 404),
            (f"/sandboxes/{theirs}/stop", {"csrf": csrf, "key": key, "confirmed": "yes"}, 404),
            (f"/sandboxes/{theirs}/exec", {"csrf": csrf, "key": key, "line": "id"}, 200),
        ]
        for path, data, status in cases:
            answer = await browser.post(path, data=data)
            assert answer.status_code == status, (path, data, answer.status_code, answer.text)
        assert await _commands(acme, mine) == []
        async with gw.http("globex") as them:
            assert (await them.get(f"/api/v1/sandboxes/{theirs}")).json()["phase"] == "running"
            answer = await browser.post(
                f"/sandboxes/{theirs}/exec",
                data={"csrf": csrf, "key": key, "line": "id", "confirmed": "yes"},
            )
            assert answer.status_code == 404, answer.text
            assert (await them.get(f"/api/v1/sandboxes/{theirs}/commands")).json()["items"] == []
        # Another tenant's command page, fragments and output: not found.
        for path in (
            f"/sandboxes/{theirs}/commands",
            f"/sandboxes/{theirs}/saves",
            f"/sandboxes/{theirs}/commands/cmd-0000000000000000",
            f"/sandboxes/{theirs}/commands/cmd-0000000000000000/output",
            f"/sandboxes/{mine}/commands/not-a-command",
        ):
            assert (await browser.get(path)).status_code == 404, path


async def test_a_sandbox_as_of_a_point_in_its_history(gw: Gw, acme: httpx.AsyncClient) -> None:
    sandbox_id = await running_sandbox(acme)
    ran = await acme.post(
        f"/api/v1/sandboxes/{sandbox_id}/commands",
        json={"argv": ["true"]},
        headers={"Idempotency-Key": "console-history-1"},
    )
    command_id = ran.json()["id"]
    events = (
        await acme.get(
            f"/api/v1/sandboxes/{sandbox_id}/events", headers={"Accept": "application/json"}
        )
    ).json()["events"]
    started = next(e["seq"] for e in events if e["type"] == "sandbox.started")
    browser, _ = await _signed_in(gw, gw.tokens["acme"])
    here = f"/sandboxes/{sandbox_id}"
    async with contextlib.aclosing(browser):
        then = await browser.get(here, params={"at": str(started)})
        assert then.status_code == 200, then.text
        assert f"As of event {started}" in then.text and "running" in then.text
        assert command_id not in then.text  # queued after that point
        assert "sandbox.started" in then.text and "command.queued" not in then.text
        before = await browser.get(here, params={"at": "2001-01-01T00:00:00Z"})
        assert before.status_code == 404 and "did not exist yet" in before.text
        bad = await browser.get(here, params={"at": "yesterday"})
        assert bad.status_code == 400 and "ISO time" in bad.text


async def test_the_list_changes_stream_names_only_the_tenants_own_sandboxes(
    gw: Gw, acme: httpx.AsyncClient, globex: httpx.AsyncClient
) -> None:
    browser, _ = await _signed_in(gw, gw.tokens["acme"])
    seen: list[str] = []
    async with contextlib.aclosing(browser):
        assert (await browser.get("/changes/nothing")).status_code == 404
        async with browser.stream(
            "GET", "/changes/sandbox", timeout=httpx.Timeout(60, connect=10)
        ) as stream:
            assert stream.status_code == 200
            assert stream.headers["content-type"].startswith("text/event-stream")
            lines = stream.aiter_lines()
            assert await anext(lines) == "retry: 1000"  # the stream is following now
            theirs = (await globex.post("/api/v1/sandboxes")).json()["id"]
            mine = (await acme.post("/api/v1/sandboxes")).json()["id"]
            async for line in lines:
                if line.startswith("data:"):
                    seen.append(line[5:].strip())
                    if seen[-1] == mine:
                        break
    assert theirs not in seen and set(seen) == {mine}, seen
    # The list's table alone, as the page fetches it again.
    listing = await acme.get("/api/v1/sandboxes")
    assert listing.status_code == 200
    browser, _ = await _signed_in(gw, gw.tokens["acme"])
    async with contextlib.aclosing(browser):
        table = await browser.get("/sandboxes", params={"part": "table"})
        assert table.text.startswith("<table>") and mine in table.text and theirs not in table.text
