"""The process's shared stores: `acquire_store`, `release_store` and `find_store` keep one
`TierCache` per process and configuration, shared by reference count (a process's
scheduler-role and worker-role adapters must use one cache: one manager, and an LMDB
environment may be opened once per process; an atexit hook closes what is left open), and
`store_snapshots` reports on every open one (tests, benches).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tiercache.cache import TierCache, register_exit_hook
from tiercache.config import CacheConfig

log = logging.getLogger("tiercache.connectors.common")  # the adapters' helpers' one logger
POOL_WAIT_S = 60.0  # the longest an engine's start waits for its memory tiers' pages


@dataclass(eq=False)
class SharedStore:
    """One open `TierCache` shared by the adapters of one process. `lock` (the cache's own)
    serialises every use of the cache by the adapters and the cache's write-through thread;
    `counters` are adapter counters (`store_snapshots`); `state` holds an adapter's
    cross-role bookkeeping."""

    key: tuple[Any, ...]
    cache: TierCache
    lock: threading.RLock = field(init=False)
    refs: int = 0
    counters: dict[str, int] = field(default_factory=dict)
    state: dict[str, Any] = field(default_factory=dict)
    before_close: list[Callable[[], None]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.lock = self.cache.lock

    def close(self) -> None:
        """Run the `before_close` hooks (e.g. a worker finishing its transfers), then close
        the cache (write-back to persistent tiers, flush); idempotent."""
        hooks, self.before_close = self.before_close, []
        for hook in hooks:
            try:
                hook()
            except Exception:  # a failing hook must not keep the tiers from closing
                log.exception("a before-close hook of the shared tiercache store failed")
        # Not under `lock`: close joins the cache's write-through thread, which takes it.
        self.cache.close()

    def count(self, name: str, n: int = 1) -> None:
        """Add `n` to counter `name` (caller holds `lock` or accepts a racy count)."""
        self.counters[name] = self.counters.get(name, 0) + n

    def wait_for_memory(self, timeout_s: float = POOL_WAIT_S) -> None:
        """Before the engine serves: wait (at most `timeout_s` in all) for memory tiers still
        being faulted in on a background thread (`PoolTier.wait_prefaulted`). Measured on a
        2-core CPU engine: with a 4 GiB CPU tier faulting in (~2.4 s of one core) while the
        first requests ran, their p99 TTFT was 12-18 % above the server without a
        connector's; waited for, it was not."""
        start = time.monotonic()
        for tier in self.cache.tiers:
            wait = getattr(tier, "wait_prefaulted", None)
            if wait is None:
                continue
            left = max(0.0, timeout_s - (time.monotonic() - start))
            if not wait(left):
                log.warning(
                    "tier %r: still being faulted in after %.0f s; serving meanwhile",
                    tier.medium,
                    timeout_s,
                )
        waited = time.monotonic() - start
        if waited >= 0.1:
            log.info("waited %.1f s for memory tiers to be faulted in", waited)


_REGISTRY: dict[tuple[Any, ...], SharedStore] = {}
_REGISTRY_LOCK = threading.Lock()


def _store_key(config: CacheConfig) -> tuple[Any, ...]:
    # Two configs with the same namespace and tiers are one store; the tier options are part
    # of the key so that a different path never silently shares a cache.
    tiers = tuple(
        (
            t.kind,
            t.name,
            t.capacity_bytes,
            t.capacity_blocks,
            tuple(sorted(map(repr, t.options.items()))),
        )
        for t in config.tiers
    )
    return (config.namespace, config.block_size, config.promote, tiers)


def acquire_store(config: CacheConfig, block_bytes: int) -> SharedStore:
    """The process's shared store for `config`, opened on first use; call `release_store`
    once per acquire. A second acquire with another `block_bytes` is an error."""
    key = _store_key(config)
    with _REGISTRY_LOCK:
        shared = _REGISTRY.get(key)
        if shared is None:
            shared = SharedStore(key=key, cache=TierCache.open(config, block_bytes=block_bytes))
            _REGISTRY[key] = shared
        elif shared.cache.block_bytes != block_bytes:
            raise ValueError(
                f"block_bytes: the store for namespace {config.namespace!r} is open with "
                f"{shared.cache.block_bytes}-byte blocks, asked for {block_bytes}"
            )
        shared.refs += 1
        return shared


def find_store(config: CacheConfig) -> SharedStore | None:
    """The process's open shared store for `config`, if any (takes no reference)."""
    with _REGISTRY_LOCK:
        return _REGISTRY.get(_store_key(config))


def release_store(shared: SharedStore) -> None:
    """Drop one reference; the last one closes the cache (write-back and flush)."""
    with _REGISTRY_LOCK:
        if shared.refs <= 0:
            return
        shared.refs -= 1
        if shared.refs:
            return
        _REGISTRY.pop(shared.key, None)
    shared.close()


def store_snapshots() -> dict[str, dict[str, Any]]:
    """Per open shared store (by namespace): the cache's `stats()`, the adapter counters and
    the adapters' snapshot sections (`TierCache.sections`, e.g. `kv_groups`)."""
    with _REGISTRY_LOCK:
        stores = list(_REGISTRY.values())
    out: dict[str, dict[str, Any]] = {}
    for s in stores:
        with s.lock:
            out[s.cache.config.namespace] = {
                "stats": s.cache.stats(),
                "counters": dict(s.counters),
                "sections": s.cache.sections(),
                "refs": s.refs,
            }
    return out


def _close_all() -> None:
    """Backstop: close stores whose adapters were never shut down (a clean exit)."""
    with _REGISTRY_LOCK:
        stores = list(_REGISTRY.values())
        _REGISTRY.clear()
    for s in stores:
        try:
            s.close()
        except Exception:  # one failing store must not keep the others from closing
            log.exception("closing the shared tiercache store %r at exit failed", s.key[0])


register_exit_hook(_close_all)  # before concurrent.futures stops taking work
