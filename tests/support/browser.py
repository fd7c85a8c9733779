"""Headless Chromium for the UI tests (Debian's `chromium` and `chromedriver`, installed by the test set-up)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

# Chromium's own background traffic (updates, sync, QUIC probes) kept out of a test on a machine with no
# internet access, where it only costs time.
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1400,1000",
)

needs_chromium = pytest.mark.skipif(
    not (shutil.which("chromium") and shutil.which("chromedriver")), reason="needs chromium"
)


@contextmanager
def chromium(profile: Path) -> Iterator:
    """A headless Chromium WebDriver with its profile in `profile`, quit on exit."""
    from selenium import webdriver

    opts = webdriver.ChromeOptions()
    opts.binary_location = shutil.which("chromium")
    for flag in (*FLAGS, f"--user-data-dir={profile}"):
        opts.add_argument(flag)
    driver = webdriver.Chrome(
        options=opts, service=webdriver.ChromeService(executable_path=shutil.which("chromedriver"))
    )
    try:
        yield driver
    finally:
        driver.quit()


def page_shows(driver, texts: list[str], timeout: float = 60) -> str:
    """The page's text once every one of `texts` is on it (the UIs render asynchronously); fails naming the
    texts missing and what the page showed."""
    import time

    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.common.by import By

    deadline = time.time() + timeout
    body = ""
    while time.time() < deadline:
        try:
            body = driver.find_element(By.TAG_NAME, "body").text
        except WebDriverException:
            body = ""
        if all(t in body for t in texts):
            return body
        time.sleep(0.5)
    raise AssertionError(f"{[t for t in texts if t not in body]} not shown at {driver.current_url}:\n{body}")
