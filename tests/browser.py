"""Headless Chromium driven through chromedriver's W3C WebDriver protocol with httpx: a few commands, no
selenium. The browser reaches 127.0.0.1 only: every other host goes to a dead proxy and resolves to nothing."""

from __future__ import annotations

import base64
import contextlib
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.service.conftest import HOST, free_port, stop_process, wait_until

ELEMENT = "element-6066-11e4-a52e-4f735466cecf"  # the W3C key of an element reference
OFFLINE_ARGS = ("--proxy-server=127.0.0.1:9", "--proxy-bypass-list=127.0.0.1",
                "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1")


class WebDriverError(RuntimeError):
    pass


def binaries() -> tuple[str, str]:
    """(chromium, chromedriver), or skip the test when either is missing."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if browser is None or driver is None:
        pytest.skip("chromium and chromedriver are not installed (Debian packages chromium and chromium-driver; "
                    "`make system-deps`)")
    return browser, driver


class Browser:
    """One WebDriver session."""

    def __init__(self, client: httpx.Client, session: str) -> None:
        self.client, self.session = client, session

    def _cmd(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        r = self.client.request(method, f"/session/{self.session}{path}", json=body)
        value = r.json()["value"]
        if r.status_code >= 400:
            raise WebDriverError(f"{value.get('error')}: {value.get('message', '')[:500]}")
        return value

    def get(self, url: str) -> None:
        self._cmd("POST", "/url", {"url": url})

    def element(self, css: str) -> str:
        return str(self._cmd("POST", "/element", {"using": "css selector", "value": css})[ELEMENT])

    def text(self, css: str) -> str:
        return str(self._cmd("GET", f"/element/{self.element(css)}/text"))

    def type(self, css: str, text: str) -> None:
        el = self.element(css)
        self._cmd("POST", f"/element/{el}/clear", {})
        self._cmd("POST", f"/element/{el}/value", {"text": text})

    def click(self, css: str) -> None:
        self._cmd("POST", f"/element/{self.element(css)}/click", {})

    def run(self, script: str, *args: Any) -> Any:
        """Run a function body in the page (``arguments[i]`` are ``args``) and return its result."""
        return self._cmd("POST", "/execute/sync", {"script": script, "args": list(args)})

    def wait(self, check: Callable[[], Any], what: str, timeout_s: float = 20) -> Any:
        """Poll ``check`` until it returns something truthy; its last error or value is in the failure."""
        deadline, last = time.monotonic() + timeout_s, None
        while time.monotonic() < deadline:
            try:
                if value := check():
                    return value
                last = value
            except WebDriverError as e:
                last = e
            time.sleep(0.2)
        raise AssertionError(f"{what}: not after {timeout_s} s (last: {last!r})")

    def screenshot(self, path: Path) -> None:
        path.write_bytes(base64.b64decode(self._cmd("GET", "/screenshot")))


@contextlib.contextmanager
def chromium(tmp: Path, width: int = 1280, height: int = 900) -> Iterator[Browser]:
    """chromedriver and a headless Chromium with no network beyond loopback, both stopped when the block ends."""
    browser, driver = binaries()
    tmp.mkdir(parents=True, exist_ok=True)
    port, log = free_port(), tmp / "chromedriver.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen([driver, f"--port={port}", f"--allowed-ips={HOST}"], stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        with httpx.Client(base_url=f"http://{HOST}:{port}", timeout=60) as client:
            wait_until(lambda: client.get("/status").json()["value"]["ready"], 20, "chromedriver", proc, log)
            args = ["--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--no-first-run",
                    "--disable-background-networking", "--disable-component-update", "--disable-sync",
                    f"--user-data-dir={tmp / 'profile'}", f"--window-size={width},{height}", *OFFLINE_ARGS]
            caps = {"capabilities": {"alwaysMatch": {
                "browserName": "chrome", "goog:chromeOptions": {"binary": browser, "args": args}}}}
            r = client.post("/session", json=caps)
            if r.status_code != 200:
                raise WebDriverError(f"no session: {r.text[:1000]}\n{log.read_text()[-2000:]}")
            session = Browser(client, r.json()["value"]["sessionId"])
            try:
                yield session
            finally:
                with contextlib.suppress(httpx.HTTPError):
                    client.delete(f"/session/{session.session}")
    finally:
        stop_process(proc, timeout_s=10)
