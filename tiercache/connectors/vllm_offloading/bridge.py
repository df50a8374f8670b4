"""The in-process bridge from the worker half of a `TierCacheOffloadingSpec` to its manager
half (one per `TierCache`, in the `SharedStore`'s state): stores and moves that failed or
ended, errors to count per tier, failed loads, and copies vLLM's job stopped waiting for. The
worker reports; the manager drains.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tiercache.connectors.stores import SharedStore
from tiercache.connectors.vllm_offloading.specs import BRIDGE_KEY


@dataclass
class _Reports:
    """What the worker half reported since the manager half last looked (`_Bridge.drain`)."""

    failed: list[tuple[bytes, ...]]  # stores and moves whose blocks did not arrive
    errors: list[tuple[int, int]]  # (tier, errors) to count
    load_failures: int  # blocks that failed to load
    ended: list[tuple[bytes, ...]]  # moves and given-up stores that wrote their blocks
    detached: list[tuple[bytes, ...]]  # stores and moves vLLM's job stopped waiting for


class _Bridge:
    """What the worker half tells the manager half of one cache (module doc); thread-safe. The
    manager completes the copies vLLM's job does not wait for (moves; stores given up at
    their deadline) when the worker reports their end, not when vLLM completes the job."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._new = False  # anything to drain (read unlocked: a stale False waits a call)
        self._r = _Reports([], [], 0, [], [])
        # Set by the worker half: report copies that ended since vLLM last polled it (an idle
        # engine polls nobody).
        self.collect: Callable[[], None] = lambda: None

    def store_failed(self, keys: Sequence[bytes], tier: int, *, errors: int) -> None:
        """Keys of a store or move that did not arrive; `errors` of them count against the
        tier."""
        with self._lock:
            self._r.failed.append(tuple(keys))
            if errors:
                self._r.errors.append((tier, errors))
            self._new = True

    def load_failed(self, tier: int, n: int, *, errors: int) -> None:
        """`n` blocks of a load did not arrive; `errors` of them count against the tier."""
        with self._lock:
            if errors:
                self._r.errors.append((tier, errors))
            self._r.load_failures += n
            self._new = True

    def ended(self, keys: Sequence[bytes]) -> None:
        """A copy vLLM's job did not wait for wrote `keys`: they are ready."""
        with self._lock:
            self._r.ended.append(tuple(keys))
            self._new = True

    def detach(self, keys: Sequence[bytes]) -> None:
        """A store or move past its deadline: vLLM's job ends without it, and its keys are
        misses, never "pending", until `ended` or `store_failed` reports its end."""
        with self._lock:
            self._r.detached.append(tuple(keys))
            self._new = True

    def drain(self) -> _Reports | None:
        """What was reported since the last call; None when nothing was."""
        if not self._new:
            return None
        with self._lock:
            r, self._r, self._new = self._r, _Reports([], [], 0, [], []), False
        return r


def bridge_of(store: SharedStore) -> _Bridge:
    with store.lock:
        return store.state.setdefault(BRIDGE_KEY, _Bridge())
