"""`supervise`: the first heartbeat comes one interval in (starting the attempt stamped it), later beats every
interval, and a beat that says the attempt is no longer ours stops the harness."""

from __future__ import annotations

import threading
import time

from lightning_dagster.runner.execute import supervise


def _harness(seconds: float):
    done = threading.Event()
    threading.Timer(seconds, done.set).start()
    return done


def test_a_harness_done_within_one_interval_never_heartbeats():
    done, beats = _harness(0.05), []
    verdict = supervise(
        done.wait,
        lambda: None,
        timeout_s=10,
        heartbeat_interval_s=1.0,
        heartbeat=lambda: beats.append(1) or True,
    )
    assert verdict is None
    assert beats == []


def test_a_longer_harness_heartbeats_once_per_elapsed_interval():
    done, beats = _harness(0.35), []
    verdict = supervise(
        done.wait,
        lambda: None,
        timeout_s=10,
        heartbeat_interval_s=0.1,
        heartbeat=lambda: beats.append(time.monotonic()) or True,
    )
    assert verdict is None
    assert len(beats) == 3  # at ~0.1, 0.2 and 0.3 s


def test_a_beat_that_finds_the_attempt_taken_stops_the_harness():
    done, stopped = _harness(5.0), []
    verdict = supervise(
        done.wait, lambda: stopped.append(1), timeout_s=10, heartbeat_interval_s=0.05, heartbeat=lambda: False
    )
    assert verdict == "superseded"
    assert stopped == [1]
    done.set()
