"""The console's task page over HTTP, on a real `sandhold up`: a task's status,
timeline and step ledger (live, or as of a point in its log), its artifacts
downloaded byte for byte, a cancel that needs its CSRF token and its
confirmation and happens once however often its form is sent, and another
tenant's task the same 404 as none, on every route."""

from __future__ import annotations

import contextlib
import html
import re
from datetime import UTC, datetime
from typing import Any

from sandhold.client import Client
from sandhold.domain import asof
from sandhold.domain import task as tk

from tests.gateway.conftest import Gw, nats_client
from tests.gateway.test_console import _signed_in
from tests.orchestrator.test_tasks import ended, manifest, released, sh

_KEY = re.compile(r'name="key" value="([^"]+)"')
REPORT = "mkdir -p out && printf 'report\\n' > out/report.txt && echo done"


async def _submit(client: Client, **fields: Any) -> str:
    return (await client.submit_task(manifest(**fields))).id


async def test_a_completed_tasks_page_shows_its_status_timeline_ledger_and_artifacts(
    gw: Gw,
) -> None:
    async with nats_client(gw, "acme") as client:
        task_id = await _submit(client, agent=sh(REPORT), artifacts=["out/*.txt"])
        task = await ended(client, task_id)
        assert task.state == "completed", (task.reason, task.detail)
        await released(client, task_id)
        records = await client.task_records(task_id)
    browser, csrf = await _signed_in(gw, gw.tokens["acme"])
    async with contextlib.aclosing(browser):
        here = f"/tasks/{task_id}"
        page = await browser.get(here)
        assert page.status_code == 200, page.text
        for block in ("status", "timeline"):
            assert f'data-refresh="{here}/{block}"' in page.text
        assert f'data-events="{here}/events"' in page.text
        assert f'action="{here}/cancel"' not in page.text  # ended: nothing to cancel
        form = {"csrf": csrf, "confirmed": "yes", "key": "console-" + "2" * 32}
        late = await browser.post(f"{here}/cancel", data=form)
        assert late.status_code == 409 and "already ended" in late.text

        status = await browser.get(f"{here}/status")
        assert status.status_code == 200 and status.text.startswith("<dl>")
        assert "completed" in status.text and "out/report.txt" in status.text
        assert "7 bytes" in status.text

        timeline = html.unescape((await browser.get(f"{here}/timeline")).text)
        assert timeline.index("Submitted") < timeline.index("Entered running")
        assert timeline.index("Entered running") < timeline.index("Completed")
        assert timeline.index("Completed") < timeline.index("Released: nothing more is done for it")
        assert "Step agent attempt 1 finished, exit code 0" in timeline
        assert "1 artifact(s) collected" in timeline
        assert "Step ledger" in timeline and "<td>finished</td>" in timeline
        assert f'href="{here}?at={records[0].seq}"' in timeline
        for record in records:  # every event, with who wrote it
            assert f"<td>{record.envelope.actor}</td>" in timeline, record

        # The page's event stream, read as one JSON page: the whole history.
        events = await browser.get(f"{here}/events", headers={"Accept": "application/json"})
        assert [e["seq"] for e in events.json()["events"]] == [r.seq for r in records]

        download = await browser.get(f"{here}/artifacts", params={"path": "out/report.txt"})
        assert download.status_code == 200 and download.content == b"report\n"
        assert download.headers["content-type"] == "application/octet-stream"
        assert download.headers["x-content-type-options"] == "nosniff"
        assert download.headers["content-disposition"].startswith("attachment;")
        for unknown in ("out/none.txt", "notes.md", ""):
            missing = await browser.get(f"{here}/artifacts", params={"path": unknown})
            assert missing.status_code == 404, unknown


async def test_the_history_view_shows_the_task_as_of_a_point_in_its_log(gw: Gw) -> None:
    async with nats_client(gw, "acme") as client:
        task_id = await _submit(client, agent=sh("true"))
        await ended(client, task_id)
        records = await client.task_records(task_id)
    running = next(r for r in records if getattr(r.envelope.event, "stage", None) == "running")
    browser, _ = await _signed_in(gw, gw.tokens["acme"])
    async with contextlib.aclosing(browser):
        here = f"/tasks/{task_id}"
        then = await browser.get(here, params={"at": str(running.seq)})
        assert then.status_code == 200, then.text
        text = html.unescape(then.text)
        assert f"As of seq {running.seq}" in text and f'href="{here}">Back to now' in text
        assert "<dd>running</dd>" in text and "Completed" not in text
        # History is not live, and offers no cancel: it is not the task now.
        assert "data-refresh" not in then.text and "data-events" not in then.text
        assert "/cancel" not in then.text
        # By time too, as `replay --at` reads one (the domain's fold is the oracle).
        iso = datetime.fromtimestamp(running.envelope.time, UTC).isoformat()
        found = asof.state_at(tk.evolve, records, *asof.parse_point(iso))
        assert found is not None
        state, as_of = found
        by_time = await browser.get(here, params={"at": iso})
        assert by_time.status_code == 200, by_time.text
        assert (
            f"<dd>{state.state}</dd>" in by_time.text and f"As of seq {as_of.seq}" in by_time.text
        )

        for bad in ("yesterday", "12x", "-3"):
            refused = await browser.get(here, params={"at": bad})
            said = html.unescape(refused.text)
            assert refused.status_code == 400 and "sequence number or an ISO time" in said, bad
        before = await browser.get(here, params={"at": "2000-01-01T00:00:00Z"})
        assert before.status_code == 404 and "at that point" in before.text


async def test_another_tenants_task_is_not_found_on_every_route(gw: Gw) -> None:
    async with nats_client(gw, "acme") as client:
        task_id = await _submit(client, agent=sh(REPORT), artifacts=["out/*.txt"])
        await ended(client, task_id)
    other, csrf = await _signed_in(gw, gw.tokens["globex"])
    async with contextlib.aclosing(other):
        missing = "tk-0000000000000000"
        for tid in (task_id, missing, "not-a-task"):
            for path in ("", "/status", "/timeline", "/events", "/artifacts?path=out/report.txt"):
                got = await other.get(f"/tasks/{tid}{path}", headers={"Accept": "text/html"})
                assert got.status_code == 404, (tid, path, got.text)
                assert "report" not in got.text and "completed" not in got.text
                assert got.headers["content-type"].startswith("text/html")
            form = {"csrf": csrf, "confirmed": "yes", "key": "console-" + "0" * 32}
            cancelled = await other.post(f"/tasks/{tid}/cancel", data=form)
            assert cancelled.status_code == 404, cancelled.text


async def test_a_cancel_needs_its_csrf_token_and_confirmation_and_happens_once(gw: Gw) -> None:
    async with nats_client(gw, "acme") as client:
        task_id = await _submit(client, agent=sh("exec sleep 60"))
        browser, csrf = await _signed_in(gw, gw.tokens["acme"])
        async with contextlib.aclosing(browser):
            here = f"/tasks/{task_id}"
            page = (await browser.get(here)).text
            assert f'action="{here}/cancel"' in page
            (key,) = _KEY.findall(page)

            async def cancel_requests() -> int:
                types = [r.envelope.type for r in await client.task_records(task_id)]
                return types.count("task.cancel_requested")

            refused = await browser.post(f"{here}/cancel", data={"key": key, "confirmed": "yes"})
            assert refused.status_code == 403 and "CSRF" in refused.text
            # The button leads to a confirmation, a form of its own with the same key.
            asked = await browser.post(f"{here}/cancel", data={"csrf": csrf, "key": key})
            assert asked.status_code == 200 and "Yes, cancel it" in asked.text
            assert _KEY.findall(asked.text) == [key] and 'name="confirmed"' in asked.text
            assert await cancel_requests() == 0

            form = {"csrf": csrf, "key": key, "confirmed": "yes"}
            for _ in range(2):  # a double click: the same form twice
                sent = await browser.post(f"{here}/cancel", data=form)
                assert (sent.status_code, sent.headers["location"]) == (303, here), sent.text
            task = await ended(client, task_id)
            assert task.state == "cancelled"
            assert await cancel_requests() == 1
            assert f'action="{here}/cancel"' not in (await browser.get(here)).text
            # Cancelled is final: another form's cancel changes nothing either.
            later = await browser.post(
                f"{here}/cancel", data={**form, "key": "console-" + "1" * 32}
            )
            assert later.status_code == 303
            assert await cancel_requests() == 1
            bad_key = await browser.post(f"{here}/cancel", data={**form, "key": "mine"})
            assert bad_key.status_code == 400
