"""The scheduler's view of the workers' keys in the remote placement, and its probes.

`RemoteIndex`: the keys each rank's worker holds per medium (from the handshake, then the
worker metadata's events), and, where the index ends, read-only probes of each rank's shared
tiers on a thread of their own (a slow store never stalls a step); the mediums the workers'
circuit breakers suspended, and the keys a worker found damaged (never offered again). With
head shards a shard key counts where the rank that owns it holds it.
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from tiercache.backoff import Backoff
from tiercache.config import DeadlineConfig
from tiercache.connectors.probes import probe_chain
from tiercache.connectors.vllm_kv.settings import BAD_KEYS_MAX, PROBE_WAIT_S
from tiercache.tiers.base import StoreProbe
from tiercache.transfer.head_shards import HeadShards


class RemoteIndex:
    """The index and probes of the module doc; `probes[rank]`: (medium, probe), fastest first."""

    def __init__(
        self,
        tp_size: int,
        count: Callable[..., None],
        probes: list[list[tuple[str, StoreProbe]]] | None = None,
        deadlines: DeadlineConfig | None = None,
        shards: HeadShards | None = None,
    ) -> None:
        self._tp_size = tp_size
        # Head shards: a shard counts only where its owner (the rank that loads it) holds it:
        # another rank's private tier may hold it too (written at another TP size), but
        # offered from there it would be a load that fails on every lookup.
        self._shards = shards
        self._deadlines = deadlines or DeadlineConfig()
        self._count = count  # the scheduler's counters
        self._probes = list(probes) if probes and any(probes) else []
        self._probe_pool = (
            ThreadPoolExecutor(1, thread_name_prefix="tiercache-probe") if self._probes else None
        )
        self._shared_mediums = frozenset(m for rank in self._probes for m, _ in rank)
        # Where every probe can tell from memory that it lacks a key (`may_hold`: NVMe
        # siblings), a miss none may hold is answered here, without the probe thread.
        probes = [p for rank in self._probes for _, p in rank]
        self._may_hold = (
            [p.may_hold for p in probes]  # type: ignore[attr-defined]
            if probes and all(hasattr(p, "may_hold") for p in probes)
            else None
        )
        self._probing: dict[str, tuple[tuple[Any, ...], Future[list[int]]]] = {}
        # key -> rank -> mediums holding it
        self._index: dict[bytes, dict[int, set[str]]] = {}
        # medium -> its suspension by a worker's circuit breaker (a `Backoff` holding its end)
        self._off: dict[str, Backoff] = {}
        # keys a worker found damaged (bounded, oldest first out)
        self._bad_keys: dict[bytes, None] = {}

    def has_fn(self) -> Callable[[bytes], bool]:
        """Hybrid lookups: "is this key worth asking for" (the index, or any key not known
        damaged when shared tiers can be probed)."""
        if self._probe_pool is not None:
            return lambda k: self.held_by_all(k) or k not in self._bad_keys
        return self.held_by_all

    def knows(self, key: bytes) -> bool:
        """Some rank holds `key`, by the index."""
        return key in self._index

    def ranks(self, key: bytes) -> dict[int, set[str]]:
        """Per rank, the mediums holding `key` (empty: none)."""
        return self._index.get(key, {})

    def forget(self, req_id: str) -> None:
        """A finished request's probe, if any, is no longer waited for."""
        self._probing.pop(req_id, None)

    def suspend(self, suspended: dict[str, float]) -> None:
        """The workers' circuit breakers suspended these mediums for these seconds."""
        now = time.monotonic()
        d = self._deadlines
        for medium, seconds in suspended.items():
            off = self._off.get(medium)
            if off is None:
                off = self._off[medium] = Backoff(d.backoff, d.backoff_max)
            off.hold(now + seconds)

    def damaged(self, keys: list[bytes]) -> None:
        """A worker found these keys damaged: the probes never offer them again."""
        for k in keys:
            self._bad_keys[k] = None
            if len(self._bad_keys) > BAD_KEYS_MAX:
                del self._bad_keys[next(iter(self._bad_keys))]

    def lookup(self, keys: list[bytes], req_id: str = "") -> int | None:
        """Leading `keys` every rank holds: in the index, or else in a shared tier as the
        probes find them (`probe_chain`, once per rank); None while the probes run longer
        than PROBE_WAIT_S (vLLM asks again). With probes the index is trusted only for
        private tiers: another engine may have evicted a block from a shared tier since."""
        suspended = self._suspended_mediums()
        off = suspended | self._shared_mediums  # the index is not enough for these
        if self._shards is not None:  # `keys` are every rank's shards, block-major
            n = sum(1 for _ in itertools.takewhile(bool, self._owners_hold(keys, 0, off)))
        else:
            held = self.held_by_all if not off else functools.partial(self.held_by_all, off=off)
            n = sum(1 for _ in itertools.takewhile(held, keys))
        if n == len(keys) or self._probe_pool is None:
            return n
        if self._may_hold is not None and not any(f(keys[n]) for f in self._may_hold):
            return n  # no probe can find the first key missing: no thread to wait for
        # Per rank, which keys from n on a private tier holds, taken here: the probe thread
        # never reads the index while this thread changes it.
        if self._shards is not None:  # the ranks share their shared tiers: one set of probes
            private = [tuple(self._owners_hold(keys[n:], n, off))]
        else:
            private = [
                tuple(self._rank_holds(k, r, off) for k in keys[n:])
                for r in range(len(self._probes))
            ]
        ask = (keys[n], len(keys), tuple(private), suspended)
        pending = self._probing.get(req_id)
        if pending is None or pending[0] != ask:
            fut = self._probe_pool.submit(self._probe_ranks, keys, n, private, suspended)
            pending = self._probing[req_id] = (ask, fut)
        try:
            ends = pending[1].result(timeout=PROBE_WAIT_S)
        except FutureTimeout:
            self._count("probe_waits")
            return None
        del self._probing[req_id]
        found = min(ends)
        if found > n:
            self._count("probe_hit_blocks", found - n)
        return found

    def _probe_ranks(
        self,
        keys: list[bytes],
        n: int,
        private: list[tuple[bool, ...]],
        off: frozenset[str],
    ) -> list[int]:
        """On the probe thread: per rank, where its run of keys from `n` ends, walking keys a
        private tier holds (`private`) and runs its shared tiers hold."""
        bad = self._bad_keys
        ends = []
        for probes, mine in zip(self._probes, private, strict=True):
            j = n
            while j < len(keys):
                if mine[j - n]:
                    j += 1
                elif keys[j] not in bad and (got := probe_chain(probes, keys[j:], off)):
                    # Never past a key a worker found damaged: the store may still hold it,
                    # its header well-formed, and offering it again would fail again.
                    j += next((i for i in range(got) if keys[j + i] in bad), got)
                else:
                    break
            ends.append(j)
        return ends

    def _suspended_mediums(self) -> frozenset[str]:
        """Mediums the workers' circuit breakers suspended, for now: their blocks are no hits
        (a load from them would fail again at once)."""
        if not self._off:
            return frozenset()
        now = time.monotonic()
        self._off = {m: off for m, off in self._off.items() if not off.ready(now)}
        return frozenset(self._off)

    def _owners_hold(
        self,
        keys: list[bytes],
        start: int,
        off: frozenset[str],
        within: frozenset[str] | None = None,
    ) -> Iterator[bool]:
        """Head shards: for each of `keys` (block-major, the first at position `start`),
        whether the rank owning that shard holds it in a tier not in `off` (and in `within`)."""
        owner = self._shards.owner  # type: ignore[union-attr]
        for i, k in enumerate(keys, start):
            yield self._rank_holds(k, owner(i), off, within)

    def _rank_holds(
        self, key: bytes, rank: int, off: frozenset[str], within: frozenset[str] | None = None
    ) -> bool:
        """The index says `rank` holds `key` in a tier not in `off` (and, given, in `within`)."""
        ms = self._index.get(key, {}).get(rank)
        if ms and within is not None:
            ms = ms & within
        return bool(ms) and not (off and ms <= off)

    def held_in(self, keys: list[bytes], mediums: frozenset[str]) -> bool:
        """The index says the rank that loads each of `keys` (every rank; head shards: the
        shard's owner, `keys` block-major from a block's first shard) holds it in one of
        `mediums` that no worker suspended."""
        off = self._suspended_mediums()
        if self._shards is not None:
            return all(self._owners_hold(keys, 0, off, mediums))
        ranks = range(self._tp_size)
        return all(self._rank_holds(k, r, off, mediums) for k in keys for r in ranks)

    def held_by_all(self, key: bytes, off: frozenset[str] = frozenset()) -> bool:
        """Remote placement: every rank holds `key` (in some tier of its own not in `off`)."""
        ranks = self._index.get(key, ())
        if len(ranks) != self._tp_size:
            return False
        return not off or all(not ms <= off for ms in ranks.values())

    def apply(
        self, rank: int, keys: tuple[bytes, ...], medium: str, removed: bool
    ) -> tuple[bytes, ...]:
        """`rank` now holds (or no longer holds) `keys` in `medium`. Returns the keys every
        rank now holds there, or no longer all do (what vLLM hears of with TP > 1)."""
        full = self._tp_size
        changed: list[bytes] = []
        for k in keys:
            ranks = self._index.setdefault(k, {})
            before = sum(1 for ms in ranks.values() if medium in ms) == full
            where = ranks.setdefault(rank, set())
            if removed:
                where.discard(medium)
                if not where:
                    del ranks[rank]
                    if not ranks:
                        del self._index[k]
            else:
                where.add(medium)
            after = sum(1 for ms in ranks.values() if medium in ms) == full
            if before != after:
                changed.append(k)
        return tuple(changed)

    def shutdown(self) -> None:
        """Stop probing and close the probes (a probe in flight ends within its timeout)."""
        probes, self._probes = self._probes, []
        if self._probe_pool is not None:
            self._probe_pool.shutdown(wait=True)
        for _, p in (p for rank in probes for p in rank):
            p.close()
