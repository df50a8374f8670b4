"""The manager's event queue is bounded when nobody drains it (issue 51): the oldest events
go first, counted; a placeholder filled in place after drops lands where it belongs or, if
dropped, nowhere; a facade whose events nobody takes keeps a bounded queue."""

from __future__ import annotations

import torch

from tiercache import TierCache
from tiercache.event_log import EventLog
from tiercache.records import OffloadingEvent


def _ev(*keys: bytes, removed: bool = False) -> OffloadingEvent:
    return OffloadingEvent(tuple(keys), "cpu", removed)


def test_the_oldest_events_are_dropped_and_counted() -> None:
    log = EventLog(limit=8)
    for i in range(20):
        log.append(_ev(bytes([i]) * 16))
    assert log.dropped_events > 0 and log.dropped_keys == log.dropped_events
    events = log.take()
    # What is left is the newest run, in order, within the limit.
    got = [e.keys[0][0] for e in events]
    assert got == list(range(20 - len(got), 20)) and len(got) <= 8
    assert log.dropped_events + len(got) == 20
    assert log.take() == [] and len(log) == 0


def test_events_count_by_their_keys() -> None:
    log = EventLog(limit=10)
    log.append(_ev(*[bytes([i]) * 16 for i in range(6)]))
    log.append(_ev(*[bytes([i]) * 16 for i in range(6, 12)]))  # 12 keys: the first goes
    assert (log.dropped_events, log.dropped_keys) == (1, 6)
    (only,) = log.take()
    assert len(only.keys) == 6


def test_a_placeholder_is_filled_in_its_place_or_nowhere_once_dropped() -> None:
    log = EventLog(limit=4)
    at = len(log)
    log.append(_ev())  # a placeholder (an open event, listed when taken)
    log.append(_ev(b"a" * 16))
    log[at] = _ev(b"o" * 16)
    assert [e.keys for e in log.take()] == [(b"o" * 16,), (b"a" * 16,)]
    at = len(log)
    log.append(_ev())
    for i in range(6):
        log.append(_ev(bytes([i]) * 16))  # the placeholder is dropped
    assert len(log) == 7  # positions count from the last take, dropped ones included
    log[at] = _ev(b"o" * 16)  # ignored
    assert all(e.keys != (b"o" * 16,) for e in log.take())


def test_a_facade_nobody_drains_keeps_a_bounded_queue() -> None:
    cache = TierCache.open(
        {"block_size": 4, "tiers": [{"kind": "cpu", "blocks": 4}]}, block_bytes=64
    )
    try:
        cache._manager_events.limit = 16  # test probe: a small bound
        for i in range(40):  # every put evicts one block: a stored and a removed event
            keys = cache.hash_tokens([i] * 4)
            cache.put(keys, torch.full((1, 64), i, dtype=torch.uint8))
        assert cache.events_dropped > 0
        events = cache.take_events()
        assert 0 < sum(len(e.keys) for e in events) <= 16
        # The newest event survives: the last put's block stored.
        assert events[-1].keys == tuple(cache.hash_tokens([39] * 4)) and not events[-1].removed
    finally:
        cache.close()
