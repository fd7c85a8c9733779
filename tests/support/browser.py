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
