"""`Ledger`: block identity for the campaigns. Which acknowledged blocks a store must still
hold after a fault, decided key by key from what the processes reported, never by count.

Processes using a store append lines to one log (`LogWriter`: one `os.write` per call, so a
SIGKILL keeps every line already written and cuts none in half):
- `A <id> ...`: blocks a call acknowledged (a put's held blocks, a connector's completed
  stores);
- `E <medium> <0|1> <id> ...`: an event the cache reported: blocks stored into (`0`) or
  removed from (`1`) the tier named `medium`.

The ledger replays the log in order and keeps, per block, the tiers holding it by those
events. After a fault, a block is *required* when it was acknowledged and a persistent tier
held it by the events logged: volatile tiers are lost with the process by design. Checking
the store then sorts every acknowledged block into exactly one set:
- `present`: read back with exactly the bytes written for its key;
- `evicted`: absent, and the events logged removed it from every tier (an eviction the
  cache reported, matched by key);
- `volatile`: absent, held only by volatile tiers at the fault;
- `lost`: required and absent. A campaign passes only with none;
- `wrong` (any block, acknowledged or not): served with other bytes. Never allowed.

Events of the call a kill interrupts are not logged: its stores are then not required
(nothing is owed for them), and its moves keep the block required where the log last saw
it, which the store must still honour: a demotion is durable before its source goes.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path


class LogWriter:
    """Appends a call's lines to a ledger log in one write (see the module docstring)."""

    def __init__(self, path: str | Path) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    def call(
        self, acked: Iterable[int] = (), events: Iterable[tuple[str, bool, list[int]]] = ()
    ) -> None:
        """One call's events, then the blocks it acknowledged."""
        lines = [
            f"E {m} {int(removed)} {' '.join(map(str, ids))}" for m, removed, ids in events if ids
        ]
        acked = list(acked)
        if acked:
            lines.append("A " + " ".join(map(str, acked)))
        if lines:
            os.write(self._fd, ("\n".join(lines) + "\n").encode())

    def close(self) -> None:
        os.close(self._fd)


@dataclass
class Ledger:
    """Replays ledger logs; `persistent` names the tiers (mediums) that survive a kill."""

    persistent: frozenset[str]
    acked: set[int] = field(default_factory=set)
    holders: dict[int, set[str]] = field(default_factory=dict)
    removed_by_event: set[int] = field(default_factory=set)

    def replay(self, log: str | Path) -> None:
        """Apply a log's complete lines (a torn last line, without its newline, is dropped)."""
        try:
            text = Path(log).read_text()
        except FileNotFoundError:
            return
        for line in text.split("\n")[:-1]:
            tag, *rest = line.split(" ")
            if tag == "A":
                self.acked.update(map(int, rest))
            elif tag == "E":
                medium, removed, ids = rest[0], rest[1] == "1", list(map(int, rest[2:]))
                for i in ids:
                    held = self.holders.setdefault(i, set())
                    if removed:
                        held.discard(medium)
                        if not held:
                            self.removed_by_event.add(i)
                    else:
                        held.add(medium)
                        self.removed_by_event.discard(i)
            else:
                raise AssertionError(f"ledger: unknown line {line!r}")

    def required(self) -> set[int]:
        """Acknowledged blocks a persistent tier holds by the events logged."""
        p = self.persistent
        return {i for i in self.acked if self.holders.get(i, set()) & p}

    def check(self, exact: Iterable[int], wrong: Iterable[int]) -> dict[str, set[int]]:
        """Sort the acknowledged blocks by what a check of the store found (`exact`: read
        back with their bytes; `wrong`: served with other bytes)."""
        exact, wrong = set(exact), set(wrong)
        required = self.required()
        absent = self.acked - exact - wrong
        return {
            "present": self.acked & exact,
            "evicted": absent & self.removed_by_event,
            "volatile": absent - required - self.removed_by_event,
            "lost": absent & required,
            "wrong": wrong,
        }


def summary(sets: Mapping[str, set[int]]) -> dict[str, int]:
    """Sizes of `Ledger.check`'s sets, for a campaign's report."""
    return {name: len(ids) for name, ids in sets.items()}


@dataclass
class StoreLedger:
    """Block identity on a store that logs its own removals (LMDB's removal log, committed
    with each removal): for a store several processes write, where one process's put
    evicts another's blocks and a SIGKILL can cut off the report of what it evicted.

    Each block id is put only by its one writer, which logs with each acknowledged put of
    it (`ack`) the lowest order seq the version it acknowledged can have, and the store's
    next seq before the put. The store's log names each removed block with the seq it was
    stored under and the seq of its record (`removed`). A check sorts every acknowledged
    block into one set:
    - `present`: read back with exactly the bytes written for its key;
    - `evicted`: absent, and the log removed a version at least as new as the one its latest
      acknowledged put left (by the store's capacity or a cache's delete, matched by key);
    - `stale`: absent; the store held no version of it before or after its latest put, and
      the log removed it before that put began: the cache acknowledged it from an index
      another process's eviction had made stale, and stored nothing (a plain miss later);
    - `lost`: absent otherwise. A campaign passes only with none;
    - `wrong` (any block): served with other bytes. Never allowed.
    A version a put stored and that went unlogged within the instant before the writer
    read it back would be taken for `stale`; any later loss is `lost`."""

    acked: dict[int, tuple[int, int]] = field(default_factory=dict)  # id -> (low, next)
    removed_seq: dict[int, int] = field(default_factory=dict)  # id -> newest seq removed
    first_at: dict[int, int] = field(default_factory=dict)  # id -> its first record's seq
    reasons: dict[int, str] = field(default_factory=dict)  # id -> the newest removal's reason
    after: int = -1  # the newest log record read

    def ack(self, entries: Iterable[tuple[int, int, int]]) -> None:
        """(id, low, next) of blocks a put acknowledged, in the order they were put: low is
        the seq of the version the store held right after the put, else right before it
        (which the cache may have kept), else -1 (none held: then the version is new, above
        `next`, the store's next seq before the put, or there was none)."""
        for i, low, nxt in entries:
            self.acked[i] = (low, nxt)

    def removed(self, entries: Iterable[tuple[int, int, int, str]]) -> None:
        """Log entries (id, the seq it was stored under, the record's seq, reason)."""
        for i, seq, at, reason in entries:
            if seq >= self.removed_seq.get(i, -1):
                self.removed_seq[i], self.reasons[i] = seq, reason
            self.first_at[i] = min(at, self.first_at.get(i, at))
            self.after = max(self.after, at)

    def check(self, exact: Iterable[int], wrong: Iterable[int]) -> dict[str, set[int]]:
        exact, wrong = set(exact), set(wrong)
        absent = set(self.acked) - exact - wrong
        evicted, stale = set(), set()
        for i in absent:
            low, nxt = self.acked[i]
            if self.removed_seq.get(i, -1) >= (nxt if low < 0 else low):
                evicted.add(i)
            elif low < 0 and self.first_at.get(i, nxt) < nxt:
                stale.add(i)
        return {
            "present": set(self.acked) & exact,
            "evicted": evicted,
            "stale": stale,
            "lost": absent - evicted - stale,
            "wrong": wrong,
        }
