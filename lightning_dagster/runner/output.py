"""A harness subprocess's stdout and stderr, bounded per stream: `Capture` keeps the first and the last
half of `max_bytes` (a marker between) and never stops reading, so a harness never blocks on a pipe."""

from __future__ import annotations

import collections
import logging
import os
import selectors
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import IO

log = logging.getLogger(__name__)
DEFAULT_MAX_OUTPUT_BYTES = 4 * 1024 * 1024  # per attempt and stream (the project file's default too)
READ_BYTES = 1 << 16
# How long to wait for the pipes' end once the harness's process tree is gone (only a process that left it
# on purpose can still hold a pipe open; its output is then no longer read).
DRAIN_S = 2.0


def marker(name: str, dropped: int, max_bytes: int) -> bytes:
    """The line put where a stream's middle was dropped."""
    return (
        f"\n[lightning-dagster: {dropped:,} bytes of {name} dropped here: "
        f"kept the first and last {max_bytes // 2:,} of max_output_bytes {max_bytes:,}]\n"
    ).encode()


@dataclass
class Kept:
    """What happened to one stream: `total` bytes printed, `dropped` of them not kept."""

    name: str
    total: int = 0
    dropped: int = 0

    def notice(self) -> str:
        return (
            f"{self.name} truncated: {self.total:,} bytes printed, {self.dropped:,} dropped from the middle"
        )


class _Stream:
    def __init__(self, name: str, path: Path, max_bytes: int) -> None:
        self.kept = Kept(name)
        self.max_bytes = max_bytes
        self.file = path.open("wb", buffering=0)
        self.head_left = max_bytes // 2
        self.tail_max = max_bytes - self.head_left
        self.tail: collections.deque[bytes] = collections.deque()
        self.tail_len = 0

    def feed(self, data: bytes) -> None:
        self.kept.total += len(data)
        if self.head_left:
            head = data[: self.head_left]
            self.file.write(head)
            self.head_left -= len(head)
            data = data[len(head) :]
        if data:
            self.tail.append(data)
            self.tail_len += len(data)
            while self.tail_len - len(self.tail[0]) >= self.tail_max:
                self.tail_len -= len(self.tail.popleft())

    def close(self) -> None:
        tail = b"".join(self.tail)[-self.tail_max :] if self.tail else b""
        self.kept.dropped = self.kept.total - (self.max_bytes // 2 - self.head_left) - len(tail)
        if self.kept.dropped:
            self.file.write(marker(self.kept.name, self.kept.dropped, self.max_bytes))
        self.file.write(tail)
        self.file.close()


class Capture:
    """Drains `pipes` (name -> read end) into `workdir/<name>`; `close()` returns what each stream kept."""

    def __init__(self, pipes: dict[str, IO[bytes]], workdir: Path, max_bytes: int) -> None:
        self._pipes = pipes
        self._streams = {name: _Stream(name, workdir / name, max_bytes) for name in pipes}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._drain, name="harness-output", daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        with selectors.DefaultSelector() as selector:
            for name, pipe in self._pipes.items():
                selector.register(pipe.fileno(), selectors.EVENT_READ, self._streams[name])
            while selector.get_map() and not self._stop.is_set():
                for key, _ in selector.select(timeout=0.2):
                    data = os.read(key.fd, READ_BYTES)
                    if not data:  # every writer closed it
                        selector.unregister(key.fd)
                        continue
                    try:
                        key.data.feed(data)
                    except OSError:  # the file cannot grow (a full disk): keep draining all the same
                        log.warning("cannot keep the harness's %s", key.data.kept.name, exc_info=True)

    def close(self) -> list[Kept]:
        self._thread.join(DRAIN_S)
        self._stop.set()
        self._thread.join()
        for pipe in self._pipes.values():
            pipe.close()
        for stream in self._streams.values():
            stream.close()
        return [stream.kept for stream in self._streams.values()]


def notices(kept: list[Kept]) -> str:
    """One line per truncated stream, or "" when every stream was kept whole."""
    return "\n".join(k.notice() for k in kept if k.dropped)
