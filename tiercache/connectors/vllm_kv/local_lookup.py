"""The scheduler's lookup in the local placement: verified hits on the shared cache.

When the worker runs in the scheduler's process both roles share one `TierCache`. A lookup
asks the manager, waits briefly for a store of the key it reached (the worker's `_settle`),
applies the cost gate, and reads the blocks held only in persistent tiers before reporting
them (verified, promoted) on a thread per tier: a corrupt block shortens the hit instead of
failing the request (``kv_load_failure_policy="fail"``). A read not done within VERIFY_WAIT_S
makes the lookup answer None (vLLM asks again); one past `load_timeout` is given up and its
tier suspended. Under "recompute" (`direct`) such a hit is not read here: the worker loads it
asynchronously, straight into the engine's blocks, verified there (not promoted).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

from tiercache.connectors.deadlines import warn_late
from tiercache.connectors.stores import SharedStore
from tiercache.connectors.vllm_kv.settings import SETTLE_KEY, VERIFY_WAIT_S, log


@dataclass(frozen=True)
class _Verifying:
    """Scheduler-side (local placement): a lookup's verifying read in flight."""

    keys: tuple[bytes, ...]  # the hit it verifies
    first_disk: int  # keys before this are held in memory tiers (good without a read)
    tier: int  # the persistent tier of keys[first_disk]
    started: float  # time.monotonic() it was submitted
    future: Future[int]


@dataclass(frozen=True)
class LocalHit:
    """A local lookup's answer: `blocks` leading keys are hits; `direct`: some of them are held
    only in persistent tiers and were not read (the worker loads them asynchronously)."""

    blocks: int
    direct: bool = False


class LocalLookup:
    """Verified lookups of `shared` for the scheduler (local placement). `count` adds to its
    counters, `affordable(keys, n)` is its cost gate; `direct`: see the module doc."""

    def __init__(
        self,
        shared: SharedStore,
        block_bytes: int,
        count: Callable[..., None],
        affordable: Callable[[list[bytes], int], int],
        *,
        direct: bool = False,
    ) -> None:
        self._direct = direct
        self._shared = shared
        self._block_bytes = block_bytes
        self._count = count
        self._affordable = affordable
        # One verifying thread per persistent tier, and per request the read in flight.
        self._verify_pools: dict[int, ThreadPoolExecutor] = {}
        self._verifying: dict[str, _Verifying] = {}

    def forget(self, req_id: str) -> None:
        """A finished request's verifying read, if any, is no longer waited for."""
        self._verifying.pop(req_id, None)

    def shutdown(self) -> None:
        for pool in self._verify_pools.values():
            pool.shutdown(wait=False, cancel_futures=True)  # a hung read must not stall exit

    def lookup(self, keys: list[bytes], req_id: str = "") -> LocalHit | None:
        """Leading `keys` the shared cache holds, as far as loading them pays (`_affordable`)
        and their bytes are good (module doc): None while a verifying read runs (vLLM asks
        again next step, and the read goes on)."""
        pending = self._verifying.get(req_id)
        if pending is not None and pending.keys == tuple(keys[: len(pending.keys)]):
            return self._verified(req_id, pending)
        manager = self._shared.cache.manager
        with self._shared.lock:
            # `leaving`: a block being written through is served from its source slot (a copy
            # into that slot waits for the load's pin).
            n, moving = manager.lookup_ready(keys, leaving=True)
            settle = self._shared.state.get(SETTLE_KEY)
            if n < len(keys) and settle is not None and settle(keys[n]):
                # The chain continued with a block the worker was still storing or
                # demoting; it has now finished: look again. Not counted: the first look
                # counted each block once already (as the tiers held it when asked).
                n, moving = manager.lookup_ready(keys, count=False, leaving=True)
            if moving:
                return None
            n = self._affordable(keys, n)
            persistent = [t.persistent for t in self._shared.cache.tiers]
            first_disk = n  # the first hit key held only in persistent tiers
            for i, k in enumerate(keys[:n]):
                if persistent[manager.where(k, leaving=True)[0]]:
                    first_disk = i
                    break
            if first_disk == n:
                return LocalHit(n)
            if self._direct:
                return LocalHit(n, direct=True)
            tier = manager.where(keys[first_disk], leaving=True)[0]
        pool = self._verify_pools.get(tier)
        if pool is None:
            pool = self._verify_pools[tier] = ThreadPoolExecutor(
                1, thread_name_prefix=f"tiercache-verify-{tier}"
            )
        fut = pool.submit(self._verify, keys[:n], first_disk, tier)
        pending = self._verifying[req_id] = _Verifying(
            tuple(keys[:n]), first_disk, tier, time.monotonic(), fut
        )
        return self._verified(req_id, pending)

    def _verified(self, req_id: str, pending: _Verifying) -> LocalHit | None:
        """The hit of a lookup whose verifying read is `pending`: its result once done, None
        while it runs, and the part before it once it is past `load_timeout`."""
        timeout = self._shared.cache.config.deadlines.load_timeout
        try:
            # Never past the deadline: a late read is given up in this very call.
            left = pending.started + timeout - time.monotonic()
            n = pending.future.result(timeout=max(0.0, min(VERIFY_WAIT_S, left)))
        except FutureTimeout:
            if time.monotonic() - pending.started < timeout:
                self._count("verify_waits")
                return None
            del self._verifying[req_id]
            late = len(pending.keys) - pending.first_disk
            with self._shared.lock:
                seconds = self._shared.cache.manager.suspend(pending.tier)
                self._count("verify_deadline_blocks", late)
            warn_late(log, "load", late, pending.tier, "vLLM recomputes them", seconds)
            return LocalHit(pending.first_disk)
        del self._verifying[req_id]
        if n < len(pending.keys):
            with self._shared.lock:
                moving = self._shared.cache.manager.is_moving(pending.keys[n])
            if moving:
                # The read stopped at a block a move started since the lookup is still
                # writing: vLLM asks again, and the next lookup waits for it (`_settle`;
                # bounded: a move into a hung tier is given up at `store_timeout`).
                self._count("verify_moving")
                return None
        return LocalHit(n)

    def _verify(self, keys: list[bytes], first_disk: int, tier: int) -> int:
        """On a verify thread: how many leading `keys` have good bytes. From `first_disk` on
        (held only in persistent `tier`) they are read, checksums verified, and promoted when
        the config promotes (`TierCache.fetch`, without the cache's lock); a block that fails
        is dropped and counted by the cache, and the hit ends before it."""
        cache = self._shared.cache
        with self._shared.lock:
            errors_before = self._tier_errors()
        t0 = time.perf_counter()
        # The manager's lookup counted these blocks already: reading them is not a request.
        got = cache.fetch(keys[first_disk:], count=False)
        seconds = time.perf_counter() - t0
        with self._shared.lock:
            # Here the read is the load (it promotes): its cost, unless it was past
            # load_timeout (given up: a failure, not a cost sample).
            medium = cache.tiers[tier].medium
            if seconds <= cache.config.deadlines.load_timeout:
                cache.load_costs.observe_load(medium, got * self._block_bytes, seconds)
            bad = self._tier_errors() - errors_before
            if bad:
                self._count("verify_errors", bad)
            self._count("verified_blocks", got)
        return first_disk + got

    def _tier_errors(self) -> int:
        return sum(int(s.get("errors", 0)) for s in self._shared.cache.manager.stats().values())
