"""The `Tier` ABC: fixed-size block slots on one medium, read and written in batches.

A tier knows bytes, never policies or other tiers. Primitives:
- capacity and slot bookkeeping (here, once for every tier): `allocate`, `free`, `used_blocks`;
  `release`/`settle`: a demoted block's slot is reusable at once, its block kept stored
  until its move ends (persistent tiers override them);
- `write(slots, src)` / `read(slots, dst)`: batched copies of uint8 tensors
  `[len(slots), block_bytes]` (the only abstract methods besides `from_config`);
  `read_to(slots, sink)`: a read that hands the verified blocks to a callback instead,
  straight from the tier's own buffers where it can (`reads_in_place`: NVMe), else through
  a staging tensor;
- `recover()`/`recover_columns()`: what a persistent tier already holds when it opens;
  `open_columns()` the part of it the manager adopts at open, the rest left dormant
  (`find_dormant`, `wake`, `wake_oldest`, `open_keys`: see tiers/dormant.py);
- capability flags: `persistent`, `shared` (between processes), `read_only`; shared tiers
  also `probe` and `present` (what the store holds; `present_unlocked`: asked without the
  cache's lock), `adopt`, `take_gone`, and `open_probe` (a read-only `StoreProbe` for
  another process); `take_evicted`: blocks a shared store removed without this instance (LMDB);
  `offline_store(path, name)`: a persistent kind's store on disk for offline tools;
- `sort_failed(keys, failed)`: the one rule for a read's failed blocks, used by every path
  that reads a tier: gone (a plain miss) or an error;
- `flush()` / `close()`.
"""

from __future__ import annotations

import ctypes
import functools
import os
from abc import ABC, abstractmethod
from array import array
from collections.abc import Callable, Container, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, Self

import numpy as np
import torch

from tiercache.errors import ConfigError, check_count
from tiercache.hashing import KEY_SIZE

if TYPE_CHECKING:
    from tiercache.tiers.dormant import DormantIndex
    from tiercache.tiers.offline import OfflineStore

KEY_BYTES = KEY_SIZE  # a block key: one chained prefix hash


PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")  # the host's memory page


@functools.cache
def libc_madvise() -> Any:
    """libc's madvise(addr, length, advice) -> 0 or -1 (errno kept), through ctypes, which
    releases the GIL for the call."""
    fn = ctypes.CDLL(None, use_errno=True).madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def host_memory_bytes() -> int | None:
    """This host's physical RAM; None where unknown."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


def check_geometry(block_bytes: int, capacity_blocks: int) -> None:
    """Refuse a block size or capacity that is not an int >= 1."""
    check_count("block_bytes", block_bytes)
    check_count("capacity_blocks", capacity_blocks)


def slot_stack(slots: np.ndarray) -> array:
    """A tier's free-slot stack (see `Tier.__init__`) holding `slots` in this order (the
    last is handed out first): unsigned 32-bit entries, 64-bit where a slot needs them."""
    wide = len(slots) and int(slots.max()) >= 1 << 32
    code = "Q" if wide else "I"
    return array(code, slots.astype(np.uint64 if wide else np.uint32, copy=False).tobytes())


def check_blocks(t: object, n: int, block_bytes: int, name: str) -> torch.Tensor:
    """Validate a batch of blocks: a contiguous uint8 tensor of shape [n, block_bytes]."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.uint8:
        raise TypeError(f"{name}: expected dtype torch.uint8, got {t.dtype}")
    if tuple(t.shape) != (n, block_bytes):
        raise ValueError(f"{name}: expected shape ({n}, {block_bytes}), got {tuple(t.shape)}")
    if t.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name}: tensors on device {t.device} are not supported")
    if not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor")
    return t


class StoreProbe(Protocol):
    """Read-only presence checks on a shared store (`Tier.open_probe`), bounded in time by
    the tier's own timeouts. A block is held when the store has it with a well-formed header
    of the namespace (payloads are verified when a tier reads them):
    - `probe(keys)`: how many leading `keys` are held; 0 when the store cannot be reached
      (a lookup's question: the run it could load);
    - `present(keys)`: one flag per key, whether it is held (the same test as `probe`, but
      Redis's reads no header: `RedisTier.present`), every key asked, in one call where the
      store can (one read transaction, one pipeline); None when the store cannot be
      reached, so that nothing is taken as gone (a sweep's question: which of the blocks
      reported held are still there). A store with nothing better asks `probe` per key
      (`present_per_key`)."""

    def probe(self, keys: Sequence[bytes]) -> int: ...

    def present(self, keys: Sequence[bytes]) -> list[bool] | None: ...

    def close(self) -> None: ...


def present_per_key(probe: StoreProbe, keys: Sequence[bytes]) -> list[bool]:
    """`StoreProbe.present` asked of `probe` one key at a time, for a store with nothing
    better. Its `probe` answers 0 alike for a block it lacks and a store it cannot reach, so
    this never answers None."""
    return [probe.probe([k]) == 1 for k in keys]


class Tier(ABC):
    """Fixed-size slots on one medium. Subclasses implement `write` and `read`."""

    kind: ClassVar[str] = ""
    persistent: ClassVar[bool] = False
    shared: ClassVar[bool] = False
    # True for a tier that only serves what others wrote (NVMe siblings): the manager plans
    # no store, demotion, write-through or write-back into it.
    read_only: ClassVar[bool] = False
    # True where `capacity_blocks` bounds the whole store (every process and TP rank that
    # writes to it evicts by it: LMDB), not what this instance indexes (Redis: the server's
    # maxmemory bounds the store).
    store_capacity: ClassVar[bool] = False
    OPTIONS: ClassVar[Mapping[str, type | tuple[type, ...]]] = {}
    # Whether `read_to` hands over the tier's own buffers (no staging copy): see `read_to`.
    reads_in_place: ClassVar[bool] = False
    # True where `present` is a network round trip that keeps the tier's own state consistent
    # itself (Redis): a caller that runs the tier's calls under one lock (the cache's) asks
    # it without that lock, so a slow server never holds up the cache.
    present_unlocked: ClassVar[bool] = False

    def __init__(self, *, name: str, block_bytes: int, capacity_blocks: int) -> None:
        check_geometry(block_bytes, capacity_blocks)
        # Refused before allocating: a host that overcommits memory does not fail so large
        # an allocation, it fills pages until the OOM killer ends the process.
        dtype = np.uint64 if capacity_blocks > 1 << 32 else np.uint32  # free-slot entries
        need, have = 2 * capacity_blocks * np.dtype(dtype).itemsize, host_memory_bytes()
        if have is not None and need > have:
            raise MemoryError(
                f"{name}: {capacity_blocks} slots need {need} bytes of bookkeeping, more than "
                f"the {have} bytes of host memory"
            )
        self._name = name
        self._block_bytes = block_bytes
        self._capacity = capacity_blocks
        # A stack of free slots (an `array`, 4 bytes a slot); popping from the end hands out
        # ascending slots, which keeps fresh batches contiguous (pool tiers copy one run).
        self._free = slot_stack(np.arange(capacity_blocks - 1, -1, -1, dtype=dtype))
        self._closed = False
        # Blocks recovered at open that the manager has not taken over (persistent tiers
        # that recover lazily set it; None: the manager adopts everything at open).
        self._dormant: DormantIndex | None = None

    # -- identity and capacity -------------------------------------------------------------
    @property
    def medium(self) -> str:
        """The name events and stats use for this tier (the config's `name`, default its kind)."""
        return self._name

    @property
    def block_bytes(self) -> int:
        return self._block_bytes

    @property
    def capacity_blocks(self) -> int:
        return self._capacity

    @property
    def slot_count(self) -> int:
        """Slot numbers run from 0 to slot_count - 1: the capacity, or more in a tier that
        keeps another namespace's blocks in slots of its own (NVMe)."""
        return self._capacity

    @property
    def used_blocks(self) -> int:
        return self._capacity - len(self._free)

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    # -- slots -----------------------------------------------------------------------------
    def allocate(self, keys: Sequence[bytes]) -> list[int] | None:
        """Reserve one slot per key (persistent tiers record which key a slot will hold), or
        return None (and reserve nothing) when too few are free."""
        n = len(keys)
        if n > len(self._free):
            return None
        if n == 1:  # a single-key lookup's adoption: no slice
            return [self._free.pop()]
        if n == 0:
            return []
        slots = self._free[-n:].tolist()
        del self._free[-n:]
        slots.reverse()
        return slots

    def free(self, slots: Sequence[int]) -> None:
        """Return slots to the free list (their bytes become garbage)."""
        self._free.extend(reversed(slots))

    def release(self, slots: Sequence[int]) -> None:
        """Return slots whose blocks a move (a demotion) is carrying into another tier: a
        store may be planned into them at once, but each block stays stored, and is what a
        restart recovers, until `settle` or a write of its slot; so the source copy is
        released only after the destination's is durable. A volatile tier: `free`."""
        self.free(slots)

    def settle(self, slots: Sequence[int], keys: Sequence[bytes]) -> None:
        """The moves of the blocks `release`d from `slots` (holding `keys`, pairwise) ended
        (durable at the destination, or failed and dropped): a persistent tier forgets them
        now, except where a slot was written since. A volatile tier: nothing to do."""
        return None

    # -- blocks other processes stored (shared tiers) ------------------------------------------
    def probe(self, keys: Sequence[bytes]) -> int:
        """How many leading `keys` the store holds that another process stored since this one
        opened (headers checked, not payloads); 0 on any I/O error, and in a private tier."""
        return 0

    def present(self, keys: Sequence[bytes]) -> list[bool] | None:
        """Per key, whether the store holds it (`StoreProbe.present`: the test `probe` makes,
        every key asked; None when the store cannot be reached). This version asks `probe`
        one key at a time; a store that can answer in one call overrides it."""
        return present_per_key(self, keys)

    def adopt(self, keys: Sequence[bytes]) -> list[int] | None:
        """Index blocks `probe` found: one slot per key, as `allocate`, but no write follows
        (the bytes are already stored). None, and nothing reserved, when too few are free."""
        return self.allocate(keys)

    @classmethod
    def open_probe(cls, cfg: Any, block_bytes: int, *, namespace: str = "") -> StoreProbe | None:
        """A read-only `StoreProbe` of the shared store a validated `TierConfig` names, for a
        process that does not hold it as a tier (vLLM's scheduler); None for a private tier."""
        return None

    @classmethod
    def offline_store(cls, path: str, name: str) -> OfflineStore:
        """The store at `path` for offline tools (`name`: the tier's, for messages)."""
        raise NotImplementedError(f"{cls.__name__}: no store on disk")

    def take_gone(self, keys: Sequence[bytes]) -> set[bytes]:
        """Of `keys` whose `read` just failed on this thread, those that were plain misses: a
        shared store no longer held them. A private tier: none. Callers use `sort_failed`."""
        return set()

    def take_evicted(self) -> list[bytes]:
        """Keys of blocks a shared store removed without this instance (its own capacity,
        `store_capacity`; another process's writes, where the store logs them) since the
        last call, and not held now: the manager drops them from its index (before each
        store it plans, and in `take_events`) and reports them removed. Other tiers: none."""
        return []

    def sort_failed(
        self, keys: Sequence[bytes], failed: Iterable[int]
    ) -> tuple[list[int], list[int]]:
        """The failed positions of a `read` of `keys` as (gone, errors), each ascending.
        Gone: the store no longer holds the block, a plain miss that counts as no error.
        Errors: everything else (checksum, header, a short or unreadable record): a miss
        counted against the tier. Call it on the thread that read, right after the read."""
        failed = sorted(failed)
        if not failed:
            return [], []
        gone_keys = self.take_gone([keys[i] for i in failed])
        if not gone_keys:
            return [], failed
        gone = [i for i in failed if keys[i] in gone_keys]
        return gone, [i for i in failed if keys[i] not in gone_keys]

    # -- bytes -----------------------------------------------------------------------------
    @abstractmethod
    def write(
        self, slots: Sequence[int], src: torch.Tensor, keys: Sequence[bytes] | None = None
    ) -> None:
        """Copy `src` (uint8 `[len(slots), block_bytes]`) into `slots`; raise OSError on failure.
        `keys[i]` is the block key stored in `slots[i]` (persistent tiers require it)."""

    @abstractmethod
    def read(
        self, slots: Sequence[int], dst: torch.Tensor, keys: Sequence[bytes] | None = None
    ) -> list[int]:
        """Copy `slots` into `dst` (uint8 `[len(slots), block_bytes]`).

        `keys[i]` is the key the caller expects in `slots[i]`; persistent tiers require it and
        treat a slot holding another key as failed. A freed slot keeps its bytes until the
        next write into it (a demotion planned with the eviction reads it first). Returns
        the failed positions (their rows of `dst` are garbage: misses); raises OSError when
        nothing could be read.
        """

    def read_to(
        self,
        slots: Sequence[int],
        sink: Callable[[list[int], torch.Tensor], None],
        keys: Sequence[bytes] | None = None,
        *,
        staging: torch.Tensor | None = None,
    ) -> list[int]:
        """`read`, handing the blocks to `sink(positions, rows)` instead: `rows[j]` (uint8,
        possibly strided, valid only during the call) holds position `positions[j]`'s
        verified bytes. Each good position is handed over exactly once, a failed one never.
        Returns the failed positions, as `read`. An exception the sink raises ends the read
        and propagates (a cancelled load stops reading that way).

        This version reads into `staging` (at least `len(slots)` rows; new when None) and
        hands over its stretches of good rows; a tier that hands over its own buffers
        overrides it (`reads_in_place`).
        """
        n = len(slots)
        if staging is None:
            staging = torch.empty((n, self.block_bytes), dtype=torch.uint8)
        buf = staging[:n]
        bad = set(self.read(slots, buf, keys))
        start = 0
        for i in range(n + 1):  # stretches of good positions, as slices (no copy)
            if i == n or i in bad:
                if i > start:
                    sink(list(range(start, i)), buf[start:i])
                start = i + 1
        return sorted(bad)

    # -- lifecycle -------------------------------------------------------------------------
    def recover(self) -> list[tuple[bytes, int]]:
        """(key, slot) of every block a persistent tier already holds, oldest first."""
        return list(zip(*self.recover_columns(), strict=True))

    def recover_columns(self) -> tuple[list[bytes], list[int]]:
        """`recover()` as two lists, keys and slots (what the manager adopts at open, in
        bulk, with no pair per block): what a persistent tier overrides."""
        return [], []

    def open_columns(self) -> tuple[list[bytes], list[int]]:
        """What the manager adopts at open: everything recovered, or nothing where the
        tier keeps its recovered blocks dormant (the manager wakes them by key or by age)."""
        return ([], []) if self._dormant is not None else self.recover_columns()

    # -- dormant blocks (recovered at open, not yet taken over by the manager) ---------------
    @property
    def dormant_blocks(self) -> int:
        """Recovered blocks the manager has not woken: held (and counted used), not indexed
        by the manager."""
        return self._dormant.n if self._dormant is not None else 0

    def find_dormant(self, keys: Sequence[bytes]) -> list[int]:
        """Per key, the slot holding it dormant, or -1. Changes nothing."""
        d = self._dormant
        return d.find(keys) if d is not None and d.n else [-1] * len(keys)

    def wake(self, slots: Sequence[int]) -> None:
        """The manager takes over these dormant slots (found by `find_dormant`)."""
        if self._dormant is not None:
            self._dormant.wake(slots)

    def wake_oldest(self, n: int) -> tuple[list[bytes], list[int]]:
        """The manager takes over up to `n` of the oldest dormant blocks (keys, slots)."""
        d = self._dormant
        return d.wake_oldest(n) if d is not None and d.n else ([], [])

    def open_keys(self) -> list[bytes]:
        """Every key left dormant at open, oldest first (the open's stored event)."""
        return self._dormant.open_keys() if self._dormant is not None else []

    def flush(self) -> None:  # noqa: B027 - a no-op for volatile tiers, by design
        """Make acknowledged writes durable (persistent tiers)."""

    def close(self) -> None:
        """Release the tier's resources; idempotent."""
        self._closed = True

    @classmethod
    def validate_options(cls, options: Mapping[str, Any], where: str) -> None:
        """Check kind-specific config options against `OPTIONS`; raise ConfigError."""
        for key, value in options.items():
            expected = cls.OPTIONS.get(key)
            if expected is None:
                known = ", ".join(sorted(cls.OPTIONS)) or "none"
                raise ConfigError(
                    f"{where}.{key}",
                    f"unknown option for a {cls.kind!r} tier (its options: {known})",
                )
            types = expected if isinstance(expected, tuple) else (expected,)
            if not isinstance(value, expected) or (isinstance(value, bool) and bool not in types):
                what = getattr(expected, "__name__", expected)
                raise ConfigError(f"{where}.{key}", f"expected {what}, got {type(value).__name__}")

    @classmethod
    @abstractmethod
    def from_config(cls, cfg: Any, block_bytes: int, *, namespace: str = "") -> Tier:
        """Build the tier from a validated `TierConfig`; `namespace` is the cache's (persistent
        tiers stamp it into what they store)."""

    @classmethod
    def from_options(
        cls, cfg: Any, block_bytes: int, fields: Container[str] | None, **kwargs: Any
    ) -> Self:
        """`cls(name=..., block_bytes=..., capacity_blocks=..., **kwargs)` for a validated
        `TierConfig`: `from_config`'s common part. A ConfigError naming one of `fields` (None:
        any field not already under a tier entry) is raised again under the config's entry."""
        try:
            capacity = cfg.capacity_in_blocks(block_bytes)
            return cls(name=cfg.name, block_bytes=block_bytes, capacity_blocks=capacity, **kwargs)
        except ConfigError as exc:
            if not exc.field.startswith("tiers[") if fields is None else exc.field in fields:
                raise ConfigError(f"{cfg.field}.{exc.field}", exc.problem) from None
            raise

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(medium={self.medium!r}, block_bytes={self.block_bytes}, "
            f"used={self.used_blocks}/{self.capacity_blocks})"
        )
