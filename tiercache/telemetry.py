"""Telemetry of a running `TierCache`, for `tiercache stats` and `tiercache events`.

Off unless the config has a `[telemetry]` table. Then a daemon thread of the cache, every
`interval` seconds (and once more at close):
- replaces `<dir>/stats.json` atomically (`stats.json.tmp`, then rename) with the cache's
  `stats()` per tier, the process id and times;
- appends the events gathered since its last run to `<dir>/events.jsonl`, one JSON object
  per `OffloadingEvent`, stamped with the time the cache call that produced it returned;
  past `max_event_bytes` the file is renamed to `events.jsonl.1` (replacing the previous
  one) and a new one started, so at most twice that stays on disk;
- feeds `prometheus` (`"host:port"`, optional) through `transfer.stats.PrometheusMetrics`.

The cache's calls only hand their events over (a list append); all I/O runs on the thread.

Primitives: `Telemetry` (the writer, fed by the cache's `snapshot` method), `read_stats(dir)`,
`read_events(dir)`, `follow_events(dir, ...)` (the readers the CLI uses). `TelemetryConfig`,
the validated `[telemetry]` table, lives in `config` with the rest of the configuration.

Imports read top-down: config <- telemetry <- cache; this module knows no facade.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from tiercache.config import TelemetryConfig, split_addr
from tiercache.errors import ConfigError
from tiercache.records import OffloadingEvent

__all__ = ["Telemetry", "TelemetryConfig", "follow_events", "read_events", "read_stats"]

log = logging.getLogger(__name__)

TELEMETRY_FORMAT, TELEMETRY_VERSION = "tiercache-telemetry", 1
STATS_FILE, EVENTS_FILE = "stats.json", "events.jsonl"
MAX_BUFFERED_EVENTS = 65536  # events held between two runs of the thread; beyond: dropped


def event_record(event: OffloadingEvent, t: float) -> dict[str, Any]:
    """The JSON object of one event line."""
    return {
        "t": round(t, 6),
        "medium": event.medium,
        "op": "removed" if event.removed else "stored",
        "blocks": len(event.keys),
        "keys": [k.hex() for k in event.keys],
    }


class Telemetry:
    """The writer thread of one cache (see the module docstring)."""

    def __init__(self, cfg: TelemetryConfig, snapshot: Callable[[], Mapping[str, Any]]) -> None:
        """`snapshot` is a bound method of the cache (e.g. `TierCache.snapshot`), held weakly:
        the thread ends once the cache is gone."""
        self.cfg = cfg
        self._dir = Path(cfg.dir).absolute()
        if not self._dir.parent.is_dir():
            raise ConfigError("telemetry.dir", f"{self._dir}: the parent is not a directory")
        try:
            self._dir.mkdir(mode=0o700, exist_ok=True)
        except OSError as exc:
            raise ConfigError("telemetry.dir", f"{self._dir}: cannot create it: {exc}") from None
        if not self._dir.is_dir() or not os.access(self._dir, os.W_OK | os.X_OK):
            raise ConfigError("telemetry.dir", f"{self._dir} is not a writable directory")
        self._snapshot = weakref.WeakMethod(snapshot)  # type: ignore[arg-type]
        self._lock = threading.Lock()  # the event buffer and the files
        self._pending: list[tuple[float, OffloadingEvent]] = []
        self._dropped = 0
        self._written = 0
        self._closed = False
        self._started = time.time()
        self._metrics: Any = None
        self._server: Any = None
        if cfg.prometheus is not None:
            from tiercache.transfer.stats import PrometheusMetrics

            host, port = split_addr(cfg.prometheus, "telemetry.prometheus")
            self._metrics = PrometheusMetrics()
            self._server, _ = self._metrics.start_http_server(port, host)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tiercache-telemetry", daemon=True)
        self._thread.start()

    @property
    def directory(self) -> Path:
        return self._dir

    @property
    def prometheus_port(self) -> int | None:
        """The port actually served (a configured port 0 picks a free one)."""
        return None if self._server is None else int(self._server.server_port)

    def record_events(self, events: list[OffloadingEvent]) -> None:
        """Hand events over (called by the cache under its lock; no I/O here)."""
        if not self.cfg.events or not events:
            return
        now = time.time()
        with self._lock:
            room = MAX_BUFFERED_EVENTS - len(self._pending)
            if room < len(events):
                self._dropped += len(events) - max(room, 0)
                events = events[: max(room, 0)]
            self._pending.extend((now, e) for e in events)

    def close(self, final: Mapping[str, Any]) -> None:
        """Write the last events and a final snapshot (`closed: true`), stop the thread."""
        self._stop.set()
        with self._lock:
            if self._closed:
                return
            self._flush_events()
            self._write_stats(final, closed=True)
            self._closed = True
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    # -- the thread ------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(self.cfg.interval):
            take = self._snapshot()
            if take is None:
                return
            try:
                snapshot = take()
            except Exception:
                log.exception("telemetry: taking a stats snapshot failed")
                continue
            del take
            with self._lock:
                if self._closed:  # the final snapshot of close() must stay the last one
                    return
                try:
                    self._flush_events()
                    self._write_stats(snapshot, closed=False)
                except OSError as exc:
                    log.warning("telemetry: writing to %s failed: %s", self._dir, exc)

    def _write_stats(self, snapshot: Mapping[str, Any], *, closed: bool) -> None:
        doc = {
            "format": TELEMETRY_FORMAT,
            "version": TELEMETRY_VERSION,
            "pid": os.getpid(),
            "started": self._started,
            "updated": time.time(),
            "interval": self.cfg.interval,
            "closed": closed,
            "events_written": self._written,
            "events_dropped": self._dropped,
            "prometheus": self.cfg.prometheus,
            **snapshot,
        }
        if self._metrics is not None:
            self._metrics.observe_tiers(snapshot["tiers"])
            self._metrics.observe_engine(snapshot.get("engine", {}))
        tmp = self._dir / (STATS_FILE + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1)
        os.replace(tmp, self._dir / STATS_FILE)  # readers see the old or the new file, whole

    def _flush_events(self) -> None:
        pending, self._pending = self._pending, []
        if not pending:
            return
        data = "".join(json.dumps(event_record(e, t)) + "\n" for t, e in pending).encode()
        path = self._dir / EVENTS_FILE
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            size = 0
        if size and size + len(data) > self.cfg.max_event_bytes:
            os.replace(path, self._dir / (EVENTS_FILE + ".1"))
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, data)  # one write: a reader sees whole lines or a partial tail
        finally:
            os.close(fd)
        self._written += len(pending)


# -- readers (the CLI) -------------------------------------------------------------------------


def read_stats(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """The last stats.json of a telemetry directory; ValueError when it is missing or bad."""
    p = Path(directory) / STATS_FILE
    try:
        doc = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{p}: no stats yet (is the engine running with [telemetry]?)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{p}: unreadable: {exc}") from None
    if not isinstance(doc, dict) or doc.get("format") != TELEMETRY_FORMAT:
        raise ValueError(f"{p} is not a tiercache telemetry file")
    if doc.get("version") != TELEMETRY_VERSION:
        raise ValueError(
            f"{p}: telemetry version {doc.get('version')!r}, this build reads {TELEMETRY_VERSION}"
        )
    return doc


def _parse_lines(data: bytes) -> Iterator[dict[str, Any]]:
    for line in data.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a torn line of a crashed writer
        if isinstance(rec, dict) and "medium" in rec:
            yield rec


def read_events(directory: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every event kept on disk, oldest first (the rotated file, then the current one)."""
    out: list[dict[str, Any]] = []
    for name in (EVENTS_FILE + ".1", EVENTS_FILE):
        try:
            data = (Path(directory) / name).read_bytes()
        except FileNotFoundError:
            continue
        if not data.endswith(b"\n"):
            data = data[: data.rfind(b"\n") + 1]  # a line still being written
        out.extend(_parse_lines(data))
    return out


def follow_events(
    directory: str | os.PathLike[str],
    *,
    poll: float = 0.2,
    stop: threading.Event | None = None,
    deadline: float | None = None,
) -> Iterator[dict[str, Any]]:
    """Events appended to events.jsonl from now on, across rotations, until `stop` is set or
    `deadline` (time.monotonic()) passes."""
    path = Path(directory) / EVENTS_FILE
    ino, pos, buf = None, 0, b""
    with contextlib.suppress(FileNotFoundError):
        st = path.stat()
        ino, pos = st.st_ino, st.st_size
    while not (stop is not None and stop.is_set()):
        if deadline is not None and time.monotonic() >= deadline:
            return
        try:
            st = path.stat()
        except FileNotFoundError:
            st = None
        if st is not None:
            if st.st_ino != ino:  # rotated (or created): drain the old file's tail, start over
                if ino is not None:
                    old = Path(directory) / (EVENTS_FILE + ".1")
                    with contextlib.suppress(FileNotFoundError):
                        if old.stat().st_ino == ino:
                            with old.open("rb") as f:
                                f.seek(pos)
                                buf += f.read()
                    yield from _parse_lines(buf[: buf.rfind(b"\n") + 1])
                    buf = b""
                ino, pos = st.st_ino, 0
            if st.st_size > pos:
                with path.open("rb") as f:
                    f.seek(pos)
                    chunk = f.read(st.st_size - pos)
                pos += len(chunk)
                buf += chunk
                cut = buf.rfind(b"\n") + 1
                if cut:
                    yield from _parse_lines(buf[:cut])
                    buf = buf[cut:]
                continue
        time.sleep(poll)
