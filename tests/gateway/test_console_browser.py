"""The web console in a real browser (headless Chromium from Debian's packages,
driven by Selenium): sign in through the form, open a sandbox, and see a
command's end arrive on the page without a reload; another tenant's sandbox
is a "not found" page; the pages fit a phone's width. Each page's screenshot
is written to `test-artifacts/console/` and checked for content.

Chromium and ChromeDriver come from `apt-get install chromium chromium-driver`
(`.ci/run` installs them and sets SANDHOLD_REQUIRE_BROWSER=1, under which a
missing browser fails these tests instead of skipping them).
"""

from __future__ import annotations

import os
import signal
import struct
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.gateway.conftest import Gw, running_sandbox

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "console"
WAIT_S = 60


def _have_browser() -> bool:
    return all(os.access(p, os.X_OK) for p in (CHROMIUM, CHROMEDRIVER))


if not _have_browser():
    if os.environ.get("SANDHOLD_REQUIRE_BROWSER") == "1":
        raise RuntimeError(f"SANDHOLD_REQUIRE_BROWSER=1, but {CHROMIUM} or {CHROMEDRIVER} missing")
    pytest.skip(
        "no Chromium here (apt-get install chromium chromium-driver)", allow_module_level=True
    )

from selenium import webdriver  # noqa: E402 - only with a browser to drive
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[webdriver.Chrome]:
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless=new",
        # Chromium's own renderer sandbox (not sandhold's isolation, which these
        # tests run with): Chromium refuses to start it as root.
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",  # this machine's network is closed
        "--disable-component-update",
        "--disable-sync",
        "--window-size=1280,800",
        f"--user-data-dir={tmp_path / 'profile'}",
    ):
        options.add_argument(flag)
    service = Service(CHROMEDRIVER)
    driver = webdriver.Chrome(options=options, service=service)
    try:
        yield driver
    finally:
        try:
            driver.quit()
        finally:
            service.stop()  # the chromedriver process, by its PID
            assert service.process is None or service.process.poll() is not None


def _shot(driver: webdriver.Chrome, name: str) -> Path:
    """The page's screenshot, kept as an artifact and checked not to be blank."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    png = driver.get_screenshot_as_png()
    path.write_bytes(png)
    assert _distinct_pixels(png) > 8, f"{path} looks blank"
    return path


def _distinct_pixels(png: bytes) -> int:
    """Distinct RGB(A) values on the first rows of a PNG (a blank page has one)."""
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    pos, data, width, channels = 8, b"", 0, 4
    while pos < len(png):
        (length,) = struct.unpack(">I", png[pos : pos + 4])
        kind, body = png[pos + 4 : pos + 8], png[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            width = struct.unpack(">I", body[:4])[0]
            channels = {2: 3, 6: 4}[body[9]]
        elif kind == b"IDAT":
            data += body
        pos += 12 + length
    raw = zlib.decompress(data)
    stride = 1 + width * channels
    seen: set[bytes] = set()
    previous = bytearray(stride - 1)
    for row in range(min(160, len(raw) // stride)):
        line = raw[row * stride : (row + 1) * stride]
        current = _unfilter(line[0], bytearray(line[1:]), previous, channels)
        seen.update(bytes(current[i : i + channels]) for i in range(0, len(current), channels))
        previous = current
    return len(seen)


def _unfilter(kind: int, line: bytearray, prior: bytearray, bpp: int) -> bytearray:
    for i in range(len(line)):
        left = line[i - bpp] if i >= bpp else 0
        up = prior[i]
        corner = prior[i - bpp] if i >= bpp else 0
        if kind == 1:
            line[i] = (line[i] + left) & 0xFF
        elif kind == 2:
            line[i] = (line[i] + up) & 0xFF
        elif kind == 3:
            line[i] = (line[i] + (left + up) // 2) & 0xFF
        elif kind == 4:
            p = left + up - corner
            pa, pb, pc = abs(p - left), abs(p - up), abs(p - corner)
            pred = left if pa <= pb and pa <= pc else up if pb <= pc else corner
            line[i] = (line[i] + pred) & 0xFF
    return line


def _sign_in(driver: webdriver.Chrome, gw: Gw, tenant: str) -> None:
    driver.get(gw.url + "/sign-in")
    driver.find_element(By.ID, "token").send_keys(gw.tokens[tenant])
    driver.find_element(By.CSS_SELECTOR, "form button[type=submit]").click()
    WebDriverWait(driver, WAIT_S).until(lambda d: d.current_url.endswith("/sandboxes"))


async def test_a_command_run_elsewhere_shows_up_on_the_open_sandbox_page(
    gw: Gw, acme: httpx.AsyncClient, browser: webdriver.Chrome
) -> None:
    _sign_in(browser, gw, "acme")
    _wait(browser, lambda d: d.find_element(By.ID, "live").text.startswith("Live"), "list live")
    # Made while the list is open: it appears without a reload.
    sandbox_id = await running_sandbox(acme)
    _wait(browser, lambda d: d.find_elements(By.LINK_TEXT, sandbox_id), "the new row")
    _shot(browser, "sandboxes")
    # Clicked in the page's own script: the live table may be redrawn between a
    # lookup here and a click sent from here.
    browser.execute_script(
        "document.querySelector(`a[href='/sandboxes/${arguments[0]}']`).click()", sandbox_id
    )
    _wait(browser, lambda d: d.current_url.endswith(sandbox_id), "the sandbox's page")
    try:
        WebDriverWait(browser, WAIT_S).until(
            lambda d: d.find_element(By.ID, "live").text.startswith("Live")
        )
    except Exception:
        raise AssertionError(
            f"the page never went live: {browser.find_element(By.ID, 'live').text!r}; "
            f"console: {browser.get_log('browser')}"
        ) from None
    events = browser.find_element(By.ID, "events")
    WebDriverWait(browser, WAIT_S).until(lambda d: "sandbox.started" in events.text)

    ran = await acme.post(
        f"/api/v1/sandboxes/{sandbox_id}/commands",
        json={"argv": ["sh", "-c", "exit 3"]},
        headers={"Idempotency-Key": "console-browser-1"},
    )
    assert ran.status_code in (200, 201, 202), ran.text
    # No reload: the event comes over the page's EventSource, the status follows.
    WebDriverWait(browser, WAIT_S).until(lambda d: "command.ended" in events.text)
    status = browser.find_element(By.ID, "status")
    WebDriverWait(browser, WAIT_S).until(lambda d: "exited 1" in status.text)
    lines = [li.text for li in events.find_elements(By.TAG_NAME, "li")]
    assert len(lines) == len(set(lines)), "an event shown twice"
    _shot(browser, "sandbox")

    # A phone's width: nothing wider than the screen.
    browser.set_window_size(390, 844)
    browser.refresh()
    WebDriverWait(browser, WAIT_S).until(lambda d: "command.ended" in d.page_source)
    assert browser.execute_script(
        "return document.documentElement.scrollWidth <= window.innerWidth"
    )
    _shot(browser, "sandbox-phone")


async def test_another_tenants_sandbox_page_is_not_found(
    gw: Gw, globex: httpx.AsyncClient, browser: webdriver.Chrome
) -> None:
    theirs = await running_sandbox(globex)
    _sign_in(browser, gw, "acme")
    browser.get(f"{gw.url}/sandboxes/{theirs}")
    assert browser.title.startswith("Not found")
    assert "running" not in browser.find_element(By.TAG_NAME, "main").text
    _shot(browser, "not-found")
    # Nor any piece of it that a page fetches.
    for part in ("status", "commands", "saves", "events"):
        browser.get(f"{gw.url}/sandboxes/{theirs}/{part}")
        body = browser.find_element(By.TAG_NAME, "body").text
        assert "running" not in body and "sandbox.created" not in body, (part, body)
        assert "not found" in body.lower() or "No sandbox" in body, (part, body)


def _wait(driver: webdriver.Chrome, check, what: str, timeout: float = WAIT_S):
    """WebDriverWait, failing with what was awaited and the browser's console."""
    try:
        return WebDriverWait(driver, timeout).until(check)
    except Exception:
        raise AssertionError(
            f"not within {timeout}s: {what}; at {driver.current_url}; "
            f"console: {driver.get_log('browser')}"
        ) from None


def _confirm(driver: webdriver.Chrome) -> None:
    _wait(driver, lambda d: d.title.startswith("Confirm"), "the confirmation page")
    _shot(driver, "confirm")
    driver.find_element(By.CSS_SELECTOR, "main form button[type=submit]").click()


async def test_create_a_sandbox_and_run_a_command_from_the_pages(
    gw: Gw, acme: httpx.AsyncClient, browser: webdriver.Chrome
) -> None:
    _sign_in(browser, gw, "acme")
    browser.find_element(By.XPATH, "//button[text()='Create a sandbox']").click()
    _wait(browser, lambda d: "/sandboxes/sb-" in d.current_url, "the new sandbox's page")
    sandbox_id = browser.current_url.rsplit("/", 1)[1]
    status = browser.find_element(By.ID, "status")
    # Placed and started while the page is open: the status follows without a reload.
    _wait(browser, lambda d: "running" in status.text, "the sandbox running")
    if not browser.find_elements(By.ID, "line"):  # drawn while it was still pending
        browser.refresh()
    browser.find_element(By.ID, "line").send_keys("echo made by the console; exit 7")
    browser.find_element(By.XPATH, "//button[text()='Run']").click()
    _confirm(browser)
    _wait(browser, lambda d: "/commands/cmd-" in d.current_url, "the command's page")
    live = browser.find_element(By.ID, "output-live")
    _wait(browser, lambda d: live.text.startswith("Ended"), "the command's end")
    assert live.text == "Ended: exited, exit code 7."
    assert browser.find_element(By.ID, "output").text == "made by the console"
    _wait(browser, lambda d: "exit code 7" in d.find_element(By.ID, "status").text, "status")
    _shot(browser, "command")
    commands = (await acme.get(f"/api/v1/sandboxes/{sandbox_id}/commands")).json()["items"]
    assert [c["exit_code"] for c in commands] == [7]  # one click, one run

    # A snapshot from its button: on the saves timeline once completed, as the recovery point.
    browser.find_element(By.LINK_TEXT, f"Sandbox {sandbox_id}").click()
    browser.find_element(By.XPATH, "//button[text()='Take a snapshot']").click()
    _confirm(browser)
    _wait(browser, lambda d: d.current_url.endswith(sandbox_id), "back on the sandbox's page")
    saves = browser.find_element(By.ID, "saves")
    _wait(browser, lambda d: "snapshot “console”: completed" in saves.text, "the snapshot")
    assert "recovery point" in saves.text
    browser.execute_script("document.getElementById('saves-h').scrollIntoView()")
    _shot(browser, "saves")

    listed = (await acme.get("/api/v1/sandboxes", params={"phase": "running"})).json()["items"]
    browser.get(f"{gw.url}/hosts")
    mine = sum(1 for s in listed if s["host"] == "local")
    assert f"{mine} of" in browser.find_element(By.TAG_NAME, "table").text
    _shot(browser, "hosts")


async def test_output_resumes_without_gap_or_repeat_after_the_gateway_is_killed(
    gw: Gw, acme: httpx.AsyncClient, browser: webdriver.Chrome
) -> None:
    sandbox_id = await running_sandbox(acme)
    lines = 150
    ran = await acme.post(
        f"/api/v1/sandboxes/{sandbox_id}/commands",
        json={"argv": ["sh", "-c", f"for i in $(seq 1 {lines}); do echo line $i; sleep 0.1; done"]},
        headers={"Idempotency-Key": "console-browser-kill"},
    )
    assert ran.status_code == 202, ran.text
    _sign_in(browser, gw, "acme")
    browser.get(f"{gw.url}/sandboxes/{sandbox_id}/commands/{ran.json()['id']}")
    output = browser.find_element(By.ID, "output")
    _wait(browser, lambda d: output.text.count("\n") >= 10, "some output")
    browser.execute_script("window.sandholdMark = 'not reloaded';")

    old = gw.up.service_pid("gateway")
    os.kill(old, signal.SIGKILL)  # `sandhold up` starts it again
    # Killed mid-stream: the command was still writing (else this proves nothing).
    assert not browser.find_element(By.ID, "output-live").text.startswith("Ended")
    live = browser.find_element(By.ID, "output-live")
    _wait(browser, lambda d: live.text.startswith("Ended"), "the end, through the restart")
    assert gw.up.service_pid("gateway") != old
    assert browser.execute_script("return window.sandholdMark") == "not reloaded"
    assert output.text.split("\n") == [f"line {i}" for i in range(1, lines + 1)]
    assert live.text == "Ended: exited, exit code 0."


async def test_a_form_without_its_csrf_token_is_refused_in_the_browser(
    gw: Gw, acme: httpx.AsyncClient, browser: webdriver.Chrome
) -> None:
    sandbox_id = await running_sandbox(acme)
    _sign_in(browser, gw, "acme")
    browser.get(f"{gw.url}/sandboxes/{sandbox_id}")
    _wait(browser, lambda d: d.find_element(By.ID, "live").text.startswith("Live"), "live")
    _shot(browser, "sandbox-actions")
    form = browser.find_element(By.CSS_SELECTOR, f"form[action='/sandboxes/{sandbox_id}/stop']")
    browser.execute_script("arguments[0].querySelector('[name=csrf]').remove();", form)
    form.find_element(By.TAG_NAME, "button").click()
    _wait(browser, lambda d: d.title.startswith("Refused"), "the refusal")
    assert "Nothing was done" in browser.find_element(By.TAG_NAME, "main").text
    _shot(browser, "refused")
    shown = await acme.get(f"/api/v1/sandboxes/{sandbox_id}")
    assert shown.json()["phase"] == "running"

    # The history: the sandbox as of its start, from the page's own form.
    browser.get(f"{gw.url}/sandboxes/{sandbox_id}")
    browser.find_element(By.ID, "at").send_keys(time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    browser.find_element(By.XPATH, "//button[text()='Show']").click()
    _wait(browser, lambda d: "at=" in d.current_url, "the history view")
    notice = browser.find_element(By.CSS_SELECTOR, "main [role=status]").text
    assert notice.startswith("As of event"), notice
    assert "running" in browser.find_element(By.TAG_NAME, "dl").text
    _shot(browser, "history")


async def test_sign_in_and_reach_the_content_by_keyboard_alone(
    gw: Gw, browser: webdriver.Chrome
) -> None:
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.keys import Keys

    browser.get(gw.url + "/sign-in")
    keys = ActionChains(browser)
    # The token field has the focus (`autofocus`: the browser moves it there at
    # a rendering step after the load, not always before `get` returns); Enter
    # sends the form.
    _wait(
        browser,
        lambda d: d.switch_to.active_element.get_attribute("id") == "token",
        "the token field focused",
    )
    keys.send_keys(gw.tokens["acme"], Keys.ENTER).perform()
    _wait(browser, lambda d: d.current_url.endswith("/sandboxes"), "signed in by keyboard")
    # The first Tab reaches the skip link, and following it moves past the header.
    ActionChains(browser).send_keys(Keys.TAB).perform()
    first = browser.switch_to.active_element
    assert first.text == "Skip to the content" and first.is_displayed()
    ActionChains(browser).send_keys(Keys.ENTER, Keys.TAB).perform()
    focused = browser.switch_to.active_element
    assert browser.execute_script("return arguments[0].closest('main') !== null", focused)
