"""`TierCache`: the synchronous facade over the manager and its tiers (the public API).

Primitives: `open`, `hash_tokens`, `put`, `lookup`, `get`, `take_events`, `stats`, `close`,
and `manager` for connectors. It runs the manager's plans itself, in order: demotions first
(write-back before a slot is reused), then the store. One lock makes it thread-safe.

Who calls what, in which order (the seams other code relies on):
- A request is `lookup` then `get` (or `get` alone): its blocks count once as hits or
  misses. `get` touches what it returns (a use); `put` touches what was already held, before
  it stores (vLLM's scheduler order: touch, then store), so a block just stored is not "used
  twice" and ARC keeps it in its recency list.
- A `put` (or a `get`'s promotion) whose plan moves blocks down runs it without the lock:
  the blocks it demotes stay readable from their source slots until their moves end
  (`tiercache.manager.leaving`), so a slow or hung lower tier stalls that call alone.
- Every plan the manager hands out (`prepare_store`, `prepare_promote`) is completed here,
  whatever is raised while it runs (`PlanRunner.run_plan`): no slot leaks and no key stays
  "moving".
- Write-through tiers (`write_policy`) get their copies from a thread of this cache, off the
  callers' path (`tiercache.write_through`). `put` wakes it; adapters that complete stores on
  the manager themselves call `wake_write_through()` (otherwise it finds the work within
  `THROUGH_POLL_S`).
- Connectors call `manager` directly under their own lock and run their plans through the
  transfer worker; they use this facade for `get`/`put` of whole blocks.
"""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from tiercache.config import CacheConfig
from tiercache.costs import LoadCosts
from tiercache.errors import IO_ERRORS, ConfigError, check_count
from tiercache.event_log import EventLog
from tiercache.hashing import prefix_hashes
from tiercache.manager import OffloadingManager
from tiercache.manager.breaker import CircuitBreaker
from tiercache.memory import return_freed_heap
from tiercache.plan_runner import PlanRunner, host_runs
from tiercache.policies import get_policy_class
from tiercache.records import OffloadingEvent, PrepareStoreOutput
from tiercache.telemetry import Telemetry
from tiercache.tiers import Tier, build_tier, check_blocks
from tiercache.tiers.base import KEY_BYTES
from tiercache.tiers.pool import PoolTier
from tiercache.write_through import THROUGH_BATCH, WriteThroughCopier

log = logging.getLogger(__name__)


_OPEN: weakref.WeakSet[TierCache] = weakref.WeakSet()


def register_exit_hook(fn: Callable[[], None]) -> None:
    """Run `fn` at a clean interpreter exit while thread pools still take work: plain atexit
    hooks run after `concurrent.futures` stopped accepting work (a write-back to a disk tier
    would fail there); threading's exit hooks run earlier, in reverse order of registration,
    so concurrent.futures.thread's is registered first. atexit stays as the fallback (closing
    twice is a no-op)."""
    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        import concurrent.futures.thread  # noqa: F401 - its hook first, so ours runs first

        register(fn)
    atexit.register(fn)


def _close_open_caches() -> None:
    """A clean interpreter exit closes caches still open (writing volatile blocks back to
    persistent tiers and flushing them)."""
    for cache in list(_OPEN):
        try:
            cache.close()
        except Exception:
            log.exception("closing a TierCache at exit failed")


register_exit_hook(_close_open_caches)


def check_keys(keys: object, name: str = "keys") -> list[bytes]:
    """Validate a chain of block keys: a non-empty sequence of distinct 16-byte `bytes`."""
    if type(keys) is list and len(keys) == 1:  # one key (a probe, a prompt's first block)
        k = keys[0]
        if type(k) is bytes and len(k) == KEY_BYTES:
            return [k]  # what the checks below return for it, without their loop
    if isinstance(keys, bytes | str) or not isinstance(keys, Sequence):
        raise TypeError(
            f"{name}: expected a sequence of {KEY_BYTES}-byte keys, got {type(keys).__name__}"
        )
    out = list(keys)
    if not out:
        raise ValueError(f"{name}: is empty")
    for i, k in enumerate(out):
        if not isinstance(k, bytes):
            raise TypeError(f"{name}[{i}]: expected bytes, got {type(k).__name__}")
        if len(k) != KEY_BYTES:
            raise ValueError(f"{name}[{i}]: expected a {KEY_BYTES}-byte key, got {len(k)} bytes")
    if len(set(out)) != len(out):
        raise ValueError(f"{name}: contains duplicate keys")
    return out


class TierCache:
    """A tiered block cache: put/get whole KV blocks keyed by prefix hashes."""

    def __init__(self, config: CacheConfig, tiers: Sequence[Tier], *, block_bytes: int) -> None:
        self._config = config
        self._tiers = list(tiers)
        self._block_bytes = block_bytes
        policies = [
            get_policy_class(tc.policy)(t.capacity_blocks)
            for tc, t in zip(config.tiers, self._tiers, strict=True)
        ]
        self._manager_events = EventLog()  # bounded when nobody takes them
        self._manager = OffloadingManager(
            self._tiers,
            policies,
            promote=config.promote,
            write_through=config.write_through,
            write_through_queue=config.write_through_queue,
            admit_on_reuse=config.admit_on_reuse,
            breaker=CircuitBreaker(
                len(self._tiers),
                backoff=config.deadlines.backoff,
                backoff_max=config.deadlines.backoff_max,
            ),
            events=self._manager_events,
        )
        self._lock = threading.RLock()
        # Notified when a read of a leaving block (one a put or the write-through batch is
        # moving down, read from its source slot) ends: the write into that slot waits.
        self._reads_done = threading.Condition(self._lock)
        self._closed = False
        # Per put running its plan without the lock (see put): the tiers the plan touches.
        self._storing: list[frozenset[int]] = []
        self._runner = PlanRunner(self._manager, self._tiers, block_bytes, self._reads_done)
        # Moving load and forward costs, fed by adapters (`tiercache.costs`), shown in stats.
        self.load_costs = LoadCosts()
        # Sections adapters add to `snapshot()` (e.g. the KV connector's per-group bytes).
        self._sections: dict[str, Callable[[], Mapping[str, Any]]] = {}
        # The write-through copies (tiercache.write_through): its thread when some tier is
        # written through. Lock order: its `io` before _lock, never the other way round.
        self._through = WriteThroughCopier(
            self._manager,
            self._runner,
            self._lock,
            first_capacity=self._tiers[0].capacity_blocks,
            block_bytes=block_bytes,
            tap_events=self._tap_events,
            closed=lambda: self._closed,
            thread=any(config.write_through),
        )
        # Per thread, the chain its last call was a `lookup` of: a `get` of that chain right
        # after is the same request, and its blocks were counted by the lookup.
        self._asked = threading.local()
        # With [telemetry]: events pass through _tap_events() into this buffer for
        # take_events(), and a copy goes to the telemetry thread.
        self._events_buf = EventLog()  # bounded like the manager's (tiercache.event_log)
        self._telemetry = Telemetry(config.telemetry, self.snapshot) if config.telemetry else None
        self._tap_events()
        if any(t.persistent for t in self._tiers):
            return_freed_heap()  # what the stores' opens read in bulk (tiercache.memory)
        _OPEN.add(self)

    @classmethod
    def open(
        cls, config: CacheConfig | Mapping[str, Any] | str | Path, *, block_bytes: int
    ) -> TierCache:
        """Validate `config`, build its tiers (all or none), and return the cache."""
        cfg = CacheConfig.load(config)
        check_count("block_bytes", block_bytes)
        for tc in cfg.tiers:  # capacity errors surface before any tier allocates memory
            tc.capacity_in_blocks(block_bytes)
        built: list[Tier] = []
        try:
            for tc in cfg.tiers:
                try:
                    built.append(build_tier(tc, block_bytes, namespace=cfg.namespace))
                except (MemoryError, RuntimeError) as exc:
                    if not isinstance(exc, MemoryError) and "memory" not in str(exc).lower():
                        raise
                    # An absurd capacity must name the field, not surface as a bare MemoryError.
                    n = tc.capacity_in_blocks(block_bytes)
                    raise ConfigError(
                        f"{tc.field}.capacity",
                        f"{n} blocks of {block_bytes} bytes do not fit in memory",
                    ) from None
            return cls(cfg, built, block_bytes=block_bytes)
        except BaseException:
            # Nothing is half-built: close what was opened before the failure.
            for t in reversed(built):
                t.close()
            raise

    # -- properties ------------------------------------------------------------------------
    @property
    def config(self) -> CacheConfig:
        return self._config

    @property
    def block_bytes(self) -> int:
        return self._block_bytes

    @property
    def manager(self) -> OffloadingManager:
        return self._manager

    @property
    def tiers(self) -> list[Tier]:
        return list(self._tiers)

    @property
    def lock(self) -> threading.RLock:
        """The lock every use of `manager` holds (the facade's calls take it themselves);
        adapters that drive the manager directly take it too."""
        return self._lock

    def wake_write_through(self) -> None:
        """Start the write-through copies now (an adapter completed stores on `manager`
        itself): the sooner a block is on disk, the less a killed process loses. Cheap (an
        event set); a no-op without write-through tiers."""
        self._through.wake()

    # -- API -------------------------------------------------------------------------------
    def hash_tokens(self, token_ids: Any, extra_keys: Any = None) -> list[bytes]:
        """Prefix keys of the full blocks of `token_ids`, with the config's block size and
        namespace."""
        return prefix_hashes(
            token_ids,
            self._config.block_size,
            namespace=self._config.namespace,
            extra_keys=extra_keys,
        )

    def put(self, keys: Sequence[bytes], blocks: torch.Tensor) -> int:
        """Store the blocks of `keys` not held yet; returns how many of `keys` are now held.

        Blocks already held count as used (touched, before the store makes room, as vLLM's
        scheduler orders it); the new ones enter the policies once, when their store
        completes, so a store alone is not a use."""
        keys = check_keys(keys)
        check_blocks(blocks, len(keys), self._block_bytes, "blocks")
        with self._lock:
            self._check_open()
            self._asked.chain = None
            self._manager.touch(keys)  # policies ignore the keys they do not hold
            plan = self._manager.prepare_store(keys, leaving=True)
            if plan is None:
                log.debug("put: no room in any tier (pinned blocks, stores in flight)")
            elif not plan.moves and (plan.keys_to_store or plan.around):
                self._runner.run_plan(plan, blocks, keys)
                self._through.wake()
            if plan is None or not plan.moves:
                self._tap_events()
                return self._manager.count_ready(keys)
            touched = self._storing_plan(plan)
        self._run_unlocked(plan, blocks, keys, touched)
        with self._lock:
            self._through.wake()
            self._tap_events()
            return self._manager.count_ready(keys)

    def lookup(self, keys: Sequence[bytes], *, count: bool = True) -> int:
        """Leading blocks of `keys` held in any tier. `count=False` leaves the hit and miss
        counters alone (a caller checking blocks it asked for already)."""
        keys = check_keys(keys)
        with self._lock:
            if self._closed:  # `_check_open`, called only to raise: a lookup is hot
                self._check_open()
            n = self._manager.lookup_ready(keys, count=count, leaving=True)[0]
            self._asked.chain = tuple(keys) if count else None
            return n

    def get(
        self, keys: Sequence[bytes], *, out: torch.Tensor | None = None, count: bool = True
    ) -> torch.Tensor:
        """uint8 `[k, block_bytes]` for the k leading blocks held; counts as a use.

        `out`, if given, is a uint8 `[len(keys), block_bytes]` tensor to read into; the result
        is then its first k rows. A block that fails verification ends the result there (a
        miss), is dropped from its tier and counted as an error. So does a block moving
        between tiers: the blocks before it are read.

        Hits and misses are counted here, unless this thread's previous call was a `lookup`
        of a chain that starts with `keys` (one request, counted by the lookup). `count=False`
        never counts.
        """
        keys = check_keys(keys)
        with self._lock:
            n = self._ready_to_read(keys, count)
            if out is None:
                out = torch.empty((n, self._block_bytes), dtype=torch.uint8)
            else:
                check_blocks(out, len(keys), self._block_bytes, "out")
                out = out[:n]
            if n == 0:
                return out
            chain = keys[:n]
            spec = self._manager.prepare_load(chain, leaving=True)
        # The reads run without the lock: the blocks are pinned (no store or eviction reuses
        # their slots before complete_load), and a slow or hung tier then stalls this call
        # alone, not every other user of the cache (an engine's scheduler, its transfers).
        bad: dict[int, list[bytes]] = {}
        down: set[int] = set()  # tiers whose read failed as a whole (unreachable, I/O error)
        try:
            for g in spec.groups():
                gkeys = [chain[p] for p in g.positions]
                failed = self._runner.read_group(
                    self._tiers[g.tier], g.slots, g.positions, gkeys, out, down
                )
                if failed:
                    bad[g.tier] = [chain[p] for p in failed]
        except BaseException:
            with self._lock:
                self._runner.complete_load(chain)
            raise
        with self._lock:
            k = self._runner.end_load(chain, bad, down)
            out = out[:k]
            plan = None
            if k:
                self._manager.touch(chain[:k])
                plan = self._manager.prepare_promote(chain[:k], leaving=True)
                if plan is not None and not plan.moves:
                    self._runner.run_plan(plan, out, chain[:k])
                    plan = None
            if plan is None:
                self._tap_events()
                return out
            touched = self._storing_plan(plan)
        self._run_unlocked(plan, out, chain[:k], touched)  # a promotion that demotes: as put
        with self._lock:
            self._tap_events()
        return out

    def fetch(self, keys: Sequence[bytes], *, count: bool = True) -> int:
        """Read the leading held blocks of `keys`, verify them and make them ready in the
        first tier (promotion), without returning their bytes: how many leading blocks are
        good. For a caller that loads the blocks from the first tier later.

        Blocks held only in lower tiers are read straight into the first-tier slots reserved
        for them when those are one run of host memory. Failures and counting as in `get`
        (a failed block's reserved slot is freed).
        """
        keys = check_keys(keys)
        with self._lock:
            n = self._ready_to_read(keys, count)
            if n == 0:
                return 0
            chain = keys[:n]
            spec = self._manager.prepare_load(chain, leaving=True)
            plan = self._manager.prepare_promote(chain)
            try:
                if plan is not None:
                    # Demotions of the first tier's victims run first: their slots are
                    # reused for the promoted blocks read below.
                    for move in plan.moves:
                        self._runner.move(move)
            except BaseException:
                self._fail_fetch(chain, plan)
                raise
        first = self._tiers[0]
        to = dict(zip(plan.keys_to_store, plan.store_spec.slots, strict=True)) if plan else {}
        bad: dict[int, list[bytes]] = {}
        down: set[int] = set()
        promoted: list[bytes] = []
        write_errors = 0
        try:
            for g in spec.groups():
                if g.tier == 0 and isinstance(first, PoolTier):
                    continue  # ready in memory: no checksum to check, nothing to promote
                gkeys = [chain[p] for p in g.positions]
                dst = [to.get(k) for k in gkeys]
                runs = host_runs(first, dst) if None not in dst else None
                direct = runs is not None and len(runs) == 1
                if direct:  # straight into the reserved slots, one run of host memory
                    s0 = dst[0]
                    rows = first.pool[s0 : s0 + len(dst)]  # type: ignore[attr-defined]
                else:
                    rows = torch.empty((len(gkeys), self._block_bytes), dtype=torch.uint8)
                failed = self._runner.read_group(
                    self._tiers[g.tier], g.slots, range(len(gkeys)), gkeys, rows, down
                )
                if failed:
                    bad[g.tier] = [gkeys[i] for i in failed]
                no = set(failed)
                good = [i for i in range(len(gkeys)) if i not in no and dst[i] is not None]
                if good and not direct:
                    # Only rows that read back verified reach the first tier.
                    idx = good if len(good) < len(gkeys) else slice(None)
                    try:
                        first.write([dst[i] for i in good], rows[idx], [gkeys[i] for i in good])
                    except IO_ERRORS as exc:
                        log.warning("promotion of %d blocks failed: %s", len(good), exc)
                        write_errors += 1
                        continue
                promoted += [gkeys[i] for i in good]
        except BaseException:
            with self._lock:
                self._fail_fetch(chain, plan)
            raise
        with self._lock:
            k = self._runner.end_load(chain, bad, down)
            if write_errors:
                self._manager.record_error(0, write_errors)
            if plan is not None:
                self._manager.complete_store(promoted, success=True)
                # What failed or was not read (an I/O error of the first tier's write
                # included) goes back; complete_store skips the keys completed above.
                self._manager.complete_store(plan.keys_to_store, success=False)
            if k:
                self._manager.touch(chain[:k])
            self._tap_events()
            return k

    def _ready_to_read(self, keys: list[bytes], count: bool) -> int:
        """Leading `keys` ready to read (lock held), counted unless `count` is False or
        this thread's previous call was a `lookup` of a chain starting with `keys`."""
        self._check_open()
        asked, self._asked.chain = getattr(self._asked, "chain", None), None
        counted = not count or (asked is not None and tuple(keys) == asked[: len(keys)])
        return self._manager.lookup_ready(keys, count=not counted, leaving=True)[0]

    def _fail_fetch(self, chain: list[bytes], plan: PrepareStoreOutput | None) -> None:
        """Undo a `fetch` that raised (lock held): its load unpinned, its promotion's slots
        freed and its moves completed as failed (complete_store skips completed keys)."""
        self._runner.complete_load(chain)
        if plan is not None:
            for move in plan.moves:
                self._manager.complete_store(move.keys, success=False)
            self._manager.complete_store(plan.keys_to_store, success=False)

    def take_events(self) -> list[OffloadingEvent]:
        """Stored/removed events per tier since the last call."""
        with self._lock:
            self._tap_events()
            return self._events_buf.take() + self._manager.take_events()

    @property
    def events_dropped(self) -> int:
        """Events dropped because nobody took them (`tiercache.event_log`): a consumer that
        sees this grow has missed events and rebuilds its view (`manager.holds`, `where`)."""
        return self._manager_events.dropped_events + self._events_buf.dropped_events

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per tier (by medium name): capacity_blocks, used_blocks, hits, misses, evictions,
        errors, and more counters; once an engine loaded from it, load_latency_ms,
        load_mb_per_s and load_jobs (`LoadCosts.tier_stats`)."""
        costs = self.load_costs.tier_stats()
        with self._lock:
            out: dict[str, dict[str, Any]] = self._manager.stats()
            for t in self._tiers:
                out[t.medium] = {
                    "kind": t.kind,
                    "block_bytes": t.block_bytes,
                    **out[t.medium],
                    **costs.get(t.medium, {}),
                }
            return out

    def snapshot(self) -> dict[str, Any]:
        """What telemetry's stats.json holds besides its header: namespace, block size, and
        per tier `stats()` plus the tier's path and its own counters where it has them."""
        with self._lock:
            stats = self.stats()
            for t in self._tiers:
                path = getattr(t, "path", None)
                if path is not None:
                    stats[t.medium]["path"] = str(path)
                extra = getattr(t, "stats", None)
                if callable(extra):
                    stats[t.medium]["tier"] = extra()
        namespace, block_bytes = self._config.namespace, self._block_bytes
        out = {"namespace": namespace, "block_bytes": block_bytes, "tiers": stats}
        engine = self.load_costs.engine_stats()
        if engine:  # an engine ran forwards beside this cache: its recompute rate
            out["engine"] = engine
        out.update(self.sections())
        return out

    def sections(self) -> dict[str, dict[str, Any]]:
        """The sections adapters added (`add_snapshot_section`), as they are now; one that
        fails is logged and left out."""
        out: dict[str, dict[str, Any]] = {}
        for name, section in list(self._sections.items()):
            try:
                out[name] = dict(section())
            except Exception:  # a failing section must not cost the tiers' stats
                log.exception("snapshot section %r failed", name)
        return out

    def add_snapshot_section(self, name: str, section: Callable[[], Mapping[str, Any]]) -> None:
        """Have `snapshot()` (telemetry's stats.json) carry `name`: `section()`, called on the
        telemetry thread. For adapters' facts the cache does not know (KV cache groups)."""
        if name in {"namespace", "block_bytes", "tiers", "engine"}:
            raise ValueError(f"name: {name!r} is a section of the cache's own")
        self._sections[name] = section

    def flush(self) -> None:
        """Run the write-through copies still queued (after the copier's batch in flight),
        then make every acknowledged block of persistent tiers durable."""
        with self._lock:
            self._check_open()
        while self._through.run(THROUGH_BATCH):
            pass
        with self._lock:
            self._tap_events()
            for t in self._tiers:
                t.flush()

    def close(self) -> None:
        """Run the queued write-through copies, write volatile-only blocks down to persistent
        tiers' free slots, then flush and close every tier; idempotent. Call it without
        holding `lock`: it waits for the write-through thread, which takes that lock."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        hung: set[int] = set()
        with self._reads_done:  # puts whose moves run without the lock finish first
            # Bounded, as the write-through thread below: the tiers a put still running
            # touches are suspended and left as they are (a flush or close would hang too,
            # or pull a tier from under its I/O).
            if not self._reads_done.wait_for(
                lambda: not self._storing, self._config.deadlines.store_timeout
            ):
                hung.update(*self._storing)
                for t in hung:
                    self._manager.suspend(t)
                log.warning(
                    "tiercache: a store into %s hung at close; those tiers are left as they are",
                    ", ".join(self._tiers[t].medium for t in sorted(hung)),
                )
        thread = self._through.thread
        if thread is not None:  # it finishes the batch it is copying
            self._through.wake_event.set()
            # Bounded: a copy into a hung tier must not keep the process from exiting. That
            # tier is then suspended: nothing more is written back into it, and it is left
            # as it is (no flush, no close: those would hang too).
            thread.join(self._config.deadlines.store_timeout)
            if thread.is_alive() and (t := self.check_through(0.0)) is not None:
                hung.add(t)
                log.warning(
                    "tiercache: a write-through copy into %s hung at close; that tier is "
                    "left as it is, and the copies still queued are dropped",
                    self._tiers[t].medium,
                )
        try:
            while not hung and self._through.run(THROUGH_BATCH):  # what is queued, in order
                pass
        except Exception:  # closing must still release every tier
            log.exception("write-through at close failed")
        with self._lock:
            try:
                for move in self._manager.plan_writeback():
                    self._runner.move(move)
            except Exception:  # closing must still release every tier
                log.exception("write-back at close failed")
            if self._telemetry is not None:
                self._tap_events()
                try:
                    self._telemetry.close(self.snapshot())
                except Exception:  # telemetry must never keep the tiers from closing
                    log.exception("final telemetry snapshot failed")
            for i, t in enumerate(self._tiers):
                if i in hung:
                    continue
                try:
                    t.flush()
                finally:
                    t.close()

    def __enter__(self) -> TierCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("TierCache is closed")

    def _tap_events(self) -> None:
        """With telemetry, move the manager's new events to the buffer and the telemetry
        thread (lock held); without, a no-op and events stay in the manager."""
        if self._telemetry is not None:
            events = self._manager.take_events()
            if events:
                for e in events:
                    self._events_buf.append(e)
                self._telemetry.record_events(events)

    def _storing_plan(self, plan: PrepareStoreOutput) -> frozenset[int]:
        """Record a plan about to run without the lock (lock held): the tiers it touches,
        which `close` waits for (bounded) and leaves alone if it hangs."""
        touched = frozenset(
            [m.src.tier for m in plan.moves]
            + [m.dst.tier for m in plan.moves]
            + [w.spec.tier for w in plan.writes()]
        )
        self._storing.append(touched)
        return touched

    def _run_unlocked(
        self,
        plan: PrepareStoreOutput,
        blocks: torch.Tensor,
        keys: Sequence[bytes],
        touched: frozenset[int],
    ) -> None:
        """Run a store or promotion plan whose moves demote leaving blocks (tiercache.leaving)
        without the lock (recorded by `_storing_plan`): reads go on, of those blocks too (from
        their source slots), while a lower tier is slow or hung; the runner writes their
        slots once their moves and reads have ended."""
        try:
            self._runner.run_plan(plan, blocks, keys)
        finally:
            with self._reads_done:
                self._storing.remove(touched)
                self._reads_done.notify_all()  # close waits for the plans in flight

    def check_through(self, timeout: float) -> int | None:
        """The destination tier of a write-through copy running `timeout` seconds or more,
        now suspended (`WriteThroughCopier.check`), else None. Cheap: called every step."""
        return self._through.check(timeout)
