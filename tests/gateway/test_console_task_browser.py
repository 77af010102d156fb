"""The task page in a real browser (headless Chromium, as test_console_browser.py
drives it): a task whose clone failed once and was retried, and whose agent
step was warned as silent, shows both on its timeline in words; its end
arrives on the open page without a reload; and the history view shows it as
it was before it finished. Screenshots go to `test-artifacts/console/`."""

from __future__ import annotations

from sandhold.domain import task as tk
from selenium import webdriver
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from tests.gateway import test_console_browser as console_browser
from tests.gateway.conftest import Gw, nats_client
from tests.gateway.test_console_browser import WAIT_S, _shot, _sign_in
from tests.orchestrator import conftest as staging
from tests.orchestrator.conftest import GitRepo, ProxyFactory
from tests.orchestrator.test_tasks import manifest, sh

# Fixtures used as they are: the sandbox page's browser, and the staging
# tests' repository, `git daemon` and the proxy that drops connections on purpose.
browser = console_browser.browser
git_repo, git_daemon, flaky_proxy = staging.git_repo, staging.git_daemon, staging.flaky_proxy

# Silent until the test says go: long enough to be warned, and its end comes
# while the page is open.
WAIT_FOR_GO = "while [ ! -e /workspace/go ]; do sleep 0.1; done; echo done"


async def test_a_retried_clone_and_a_hang_warning_show_on_the_timeline_live_and_as_of_before(
    gw: Gw, browser: webdriver.Chrome, git_repo: GitRepo, flaky_proxy: ProxyFactory
) -> None:
    proxy = await flaky_proxy(fail_first=1, how="reset")
    async with nats_client(gw, "acme") as client:
        submitted = await client.submit_task(
            manifest(
                repository={"url": proxy.url_for(git_repo.name)},
                agent=sh(WAIT_FOR_GO),
                hang={"warn_after": "1s", "cancel_after": "120s"},
                retry={"network": 3, "base_delay": "0.5s", "max_delay": "1s"},
            )
        )
        # Waited for here, with the event loop free: the proxy serves the clone on it.
        warned: tk.Task = await client.wait_for_task(
            submitted.id,
            lambda s: s if s.hang_warnings or s.terminal else None,
            timeout=90,
            what="a hang warning",
        )
        assert warned.state == "running", (warned.state, warned.reason, warned.detail)
        assert [(a.operation, a.attempt) for a in warned.attempts] == [("clone", 1)]
        hang_seq = next(
            r.seq
            for r in await client.task_records(submitted.id)
            if r.envelope.type == "task.hang_warned"
        )

    _sign_in(browser, gw, "acme")
    browser.set_window_size(1280, 1600)  # the status and the timeline in one screenshot
    browser.get(f"{gw.url}/tasks/{submitted.id}")
    WebDriverWait(browser, WAIT_S).until(
        lambda d: d.find_element(By.ID, "live").text.startswith("Live")
    )
    timeline = browser.find_element(By.ID, "timeline")
    assert "clone attempt 1 failed: network (network)" in timeline.text, timeline.text
    assert "; retry at " in timeline.text and "(after " in timeline.text
    assert "Hang warning: step agent silent for" in timeline.text
    assert "Entered staging" in timeline.text and "Staged commit" in timeline.text
    status = browser.find_element(By.ID, "status")
    assert "1 hang warning(s)" in status.text and "running" in status.text
    assert "Cancel the task" in status.text

    # The step ends now, while the page is open: its end comes without a reload.
    assert warned.sandbox_id is not None
    gw.up.touch_inside(warned.sandbox_id, "go")
    WebDriverWait(browser, WAIT_S).until(
        lambda d: "completed" in d.find_element(By.ID, "status").text
    )
    assert "Cancel the task" not in browser.find_element(By.ID, "status").text  # ended
    WebDriverWait(browser, WAIT_S).until(
        lambda d: "Completed" in d.find_element(By.ID, "timeline").text
    )
    events = browser.find_element(By.ID, "events")
    WebDriverWait(browser, WAIT_S).until(lambda d: "task.completed" in events.text)
    ledger = browser.find_element(By.ID, "timeline").text
    assert "agent agent 1 finished exit code 0" in ledger, ledger
    _shot(browser, "task")

    # Back to when the step was warned, through the page's own form.
    field = browser.find_element(By.ID, "at")
    field.clear()
    field.send_keys(str(hang_seq))
    field.submit()
    WebDriverWait(browser, WAIT_S).until(lambda d: f"As of seq {hang_seq}" in d.page_source)
    then = browser.find_element(By.ID, "timeline").text
    assert "Hang warning" in then and "Completed" not in then
    assert "running" in browser.find_element(By.ID, "status").text
    assert "dispatched" in then  # the ledger as it was: the step still out
    assert browser.find_element(By.LINK_TEXT, "Back to now")
    assert not browser.find_elements(By.ID, "events")  # history is not live
    _shot(browser, "task-history")
