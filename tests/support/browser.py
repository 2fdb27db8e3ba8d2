"""A real headless Chromium for UI tests (Debian's ``chromium`` and ``chromium-driver``, driven by
selenium): the ``browser`` fixture, skipped with a message when either is missing, failed under CI
(CI=true), where .ci/run installs both. Chromedriver and every Chromium process it started are
ended by pid at the end, even when a test fails. ``Page`` wraps the few waits the UI tests need.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
from selenium import webdriver
from selenium.common.exceptions import WebDriverException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By

CHROMIUM_CANDIDATES = ("/usr/bin/chromium", "/usr/bin/chromium-browser")
DRIVER_CANDIDATES = ("/usr/bin/chromedriver", "/usr/lib/chromium/chromedriver")
SHOTS_ENV = "DATAGEN_UI_SHOTS"  # a folder: the UI tests save their screenshots there (`make ui-shots`)


def _first(paths: tuple[str, ...], name: str) -> str | None:
    return next((p for p in paths if os.access(p, os.X_OK)), None) or shutil.which(name)


def browser_paths() -> tuple[str, str]:
    """(chromium, chromedriver); skips the test when one is missing, fails it under CI."""
    chromium, driver = _first(CHROMIUM_CANDIDATES, "chromium"), _first(DRIVER_CANDIDATES, "chromedriver")
    if chromium and driver:
        return chromium, driver
    why = ("headless Chromium is not installed (apt-get install -y chromium chromium-driver): "
           "the browser checks of the Prefect UI did not run")
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(why + " (CI runs them; .ci/run installs both)")
    pytest.skip(why)


class Page:
    """The driver plus waits on what a user reads: visible text."""

    def __init__(self, driver: webdriver.Chrome, shots: Path | None) -> None:
        self.driver = driver
        self.shots = shots

    def open(self, url: str) -> None:
        self.driver.get(url)

    def text(self) -> str:
        return str(self.driver.find_element(By.TAG_NAME, "body").text)

    def wait_for(self, ok: Callable[[str], bool], what: str, timeout_s: float = 45.0, scroll: bool = False) -> str:
        """The page text once ``ok(text)`` holds; fails naming ``what`` and showing the text.
        ``scroll``: scroll to the bottom while waiting (the UI loads some lists only when in view)."""
        deadline = time.monotonic() + timeout_s
        text = ""
        while time.monotonic() < deadline:
            if scroll:  # the UI scrolls inside containers, not the window
                self.driver.execute_script(
                    "document.querySelectorAll('*').forEach(e => {"
                    " if (e.scrollHeight > e.clientHeight) e.scrollTop = e.scrollHeight; });")
            try:
                text = self.text()
            except WebDriverException:
                text = ""
            if ok(text):
                return text
            time.sleep(0.3)
        raise AssertionError(f"the page {self.driver.current_url} never showed {what}; it shows:\n{text[:3000]}")

    def wait_text(self, needle: str, timeout_s: float = 45.0, scroll: bool = False) -> str:
        return self.wait_for(lambda t: needle in t, repr(needle), timeout_s, scroll)

    def click_text(self, text: str, timeout_s: float = 30.0) -> None:
        """Click the first visible element whose own text is ``text`` (a tab, a link)."""
        xpath = f"//*[normalize-space(.)={text!r}]"
        deadline = time.monotonic() + timeout_s
        while True:
            for el in reversed(self.driver.find_elements(By.XPATH, xpath)):  # the innermost first
                try:
                    if el.is_displayed():
                        el.click()
                        return
                except WebDriverException:
                    continue
            if time.monotonic() > deadline:
                raise AssertionError(f"no visible {text!r} to click on {self.driver.current_url}; it shows:\n"
                                     f"{self.text()[:3000]}")
            time.sleep(0.3)

    def show(self, text: str) -> None:
        """Scroll the innermost element whose text is ``text`` to the middle of the view."""
        found = self.driver.find_elements(By.XPATH, f"//*[normalize-space(.)={text!r}]")
        if found:
            self.driver.execute_script("arguments[0].scrollIntoView({block: 'center'});", found[-1])

    def shot(self, name: str) -> Path | None:
        """Save a PNG as ``<shots>/<name>.png`` when screenshots were asked for (``$DATAGEN_UI_SHOTS``)."""
        if self.shots is None:
            return None
        self.shots.mkdir(parents=True, exist_ok=True)
        path = self.shots / f"{name}.png"
        assert self.driver.save_screenshot(str(path)), f"screenshot {path} not written"
        return path


def _tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


@pytest.fixture(scope="module")
def browser() -> Iterator[Page]:
    chromium, driver_path = browser_paths()
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1440,900", "--no-first-run", "--disable-extensions"):
        opts.add_argument(arg)
    service = Service(driver_path)
    driver = webdriver.Chrome(options=opts, service=service)
    started = _tree(service.process.pid) if service.process else []
    shots = os.environ.get(SHOTS_ENV)
    try:
        yield Page(driver, Path(shots) if shots else None)
    finally:
        try:
            driver.quit()
        finally:
            # Whatever quit left (a renderer, the driver itself), by the pids seen at start and now.
            left = {p.pid: p for p in [*started, *(_tree(service.process.pid) if service.process else [])]}
            for p in left.values():
                try:
                    p.send_signal(signal.SIGKILL)
                except psutil.NoSuchProcess:
                    continue
            psutil.wait_procs(list(left.values()), timeout=5)
