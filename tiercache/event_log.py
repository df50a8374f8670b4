"""`EventLog`: the manager's queue of `OffloadingEvent`s, bounded when nobody drains it.

- `append(event)`: queue one event; past `limit` keys queued, the oldest events are dropped
  (a quarter of the limit at once, so dropping costs O(1) per append on average) and
  counted in `dropped_events` / `dropped_keys`.
- `log[i] = event`: replace the event at position `i` counted since the last `take()`
  (`len(log)` is the position the next append takes): the manager fills a placeholder in
  place (a tier's open event). A position already dropped is ignored.
- `take()`: every queued event, oldest first, and an empty log.

A consumer that finds `dropped_events` grown since it last looked has missed events and
rebuilds its view from the holder's state (the manager's `holds`, `where`), not from the log.
"""

from __future__ import annotations

from tiercache.records import OffloadingEvent

__all__ = ["DEFAULT_EVENT_LIMIT", "EventLog"]

# Keys queued before the oldest events are dropped (a key is ~100 bytes in the queue).
DEFAULT_EVENT_LIMIT = 1 << 20


class EventLog:
    """A bounded FIFO of events, limited by the keys they carry (an event counts at least 1)."""

    __slots__ = ("_items", "_keys", "_skipped", "dropped_events", "dropped_keys", "limit")

    def __init__(self, limit: int = DEFAULT_EVENT_LIMIT) -> None:
        if limit < 1:
            raise ValueError(f"event limit must be at least 1 key, got {limit}")
        self.limit = limit
        self._items: list[OffloadingEvent] = []
        self._keys = 0  # keys queued (each event at least 1)
        self._skipped = 0  # events dropped since the last take (positions shift by this)
        self.dropped_events = 0
        self.dropped_keys = 0

    def __len__(self) -> int:
        return self._skipped + len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)

    def append(self, event: OffloadingEvent) -> None:
        self._items.append(event)
        self._keys += len(event.keys) or 1
        if self._keys > self.limit:
            self._trim()

    def __setitem__(self, position: int, event: OffloadingEvent) -> None:
        at = position - self._skipped
        if at < 0:
            return  # dropped already
        old = self._items[at]
        self._items[at] = event
        self._keys += (len(event.keys) or 1) - (len(old.keys) or 1)
        if self._keys > self.limit:
            self._trim()

    def _trim(self) -> None:
        """Drop the oldest events until the queue holds at most 3/4 of the limit (the newest
        event is kept even when it alone is over the limit)."""
        target = self.limit - self.limit // 4
        items, n, keys = self._items, 0, self._keys
        while keys > target and n < len(items) - 1:
            gone = len(items[n].keys)
            keys -= gone or 1
            self.dropped_keys += gone
            n += 1
        if n:
            del items[:n]
            self._keys = keys
            self._skipped += n
            self.dropped_events += n

    def take(self) -> list[OffloadingEvent]:
        events, self._items = self._items, []
        self._keys = self._skipped = 0
        return events
