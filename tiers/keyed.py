"""`KeyedTier`: what the tiers whose store is addressed by block key share (LMDB, Redis).

In such a store slots are only handles: a block lives under its key. Shared here:
- slot ownership by key: `_slot_key` (slot -> key of the blocks this instance stored or found
  at open) and `_own` (the slots of blocks it stored since it opened: the only ones its
  evictions delete; blocks found at open or adopted are only forgotten, since other
  processes may serve them and the store's capacity decides when they go), kept by `_claim`
  and `_release`; `free`/`release` hand the keys to delete to the tier's `_drop`;
- `PendingDeletes`: keys deleted from the store with the next write or at flush, not at free
  (a demotion planned with the eviction still reads them); a probe stops at a pending key
  (`leading_clear`);
- `_note_gone`/`take_gone`: reads that found no block (a plain miss, not an error);
  `_take_found`/`recover`: what the store held at open, as slots 0..n-1;
- the checks and codec of one stored value (`_io_keys`, `_encode`, `_header`,
  `_decode_block`, zstd contexts per thread), the settings checks (`check_codec`,
  `check_seconds`) and the write counters (`add_written`, `compression_ratio`).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Collection, Iterable, MutableMapping, Sequence
from typing import Any, ClassVar

import numpy as np
import torch
import zstandard

from tiercache.errors import BlockCorruptError, ConfigError
from tiercache.tiers.base import Tier, check_blocks
from tiercache.tiers.format import (
    CODEC_RAW,
    BlockHeader,
    decode_payload,
    encode_block,
    header_of,
    verify,
)

COMPRESSIONS = ("none", "zstd")
ZSTD_MIN_LEVEL = -(1 << 17)  # ZSTD_minCLevel(); python-zstandard does not export it
CODEC_OPTIONS = {"compression": str, "level": int, "element_size": int}  # `check_codec`'s
_GONE_MAX = 1 << 16  # take_gone's memory of plain misses nobody asked about


def check_codec(compression: object, level: object, element_size: object, where: str = "") -> None:
    """The compression settings of a keyed store, checked in this order (ConfigError):
    `compression` one of COMPRESSIONS, `level` a zstd level, `element_size` 1 or 2."""
    p = f"{where}." if where else ""
    if compression not in COMPRESSIONS:
        raise ConfigError(f"{p}compression", f"expected one of {COMPRESSIONS}, got {compression!r}")
    top = zstandard.MAX_COMPRESSION_LEVEL
    if isinstance(level, bool) or not isinstance(level, int) or not ZSTD_MIN_LEVEL <= level <= top:
        raise ConfigError(
            f"{p}level", f"expected a zstd level {ZSTD_MIN_LEVEL}..{top}, got {level!r}"
        )
    if isinstance(element_size, bool) or element_size not in (1, 2):
        raise ConfigError(
            f"{p}element_size",
            f"expected 1 (no shuffle) or 2 (byte-plane shuffle, bf16/fp16), got {element_size!r}",
        )


def check_seconds(value: object, field: str, *, allow_zero: bool = False) -> float:
    """A duration option in seconds (ConfigError naming `field`): a finite number > 0 (>= 0
    with `allow_zero`); returned as a float."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(field, f"expected a number of seconds, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(field, f"must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")
    return float(value)


def add_written(counts: MutableMapping[str, int], blocks: int, raw: int, stored: int) -> None:
    """Count a write of `blocks` blocks: `raw` bytes given, `stored` bytes kept."""
    counts["blocks_written"] += blocks
    counts["raw_bytes"] += raw
    counts["stored_bytes"] += stored


def compression_ratio(counts: MutableMapping[str, int] | dict[str, object]) -> float:
    """Raw bytes written over bytes stored (1.0 before any write)."""
    stored = counts["stored_bytes"]
    return counts["raw_bytes"] / stored if stored else 1.0  # type: ignore[operator]


class PendingDeletes:
    """Keys whose blocks this process stored and no longer holds (freed, replaced in their
    slot, or found damaged): deleted from the store with the next write or at flush. A key
    stored again leaves the set (`unpend`): nothing may delete it any more. Each key maps to
    what its delete needs (LMDB: the seq of a malformed entry; else None). Not locked:
    callers hold the lock that guards it (LMDB: the shared environment's; Redis: the tier's)."""

    __slots__ = ("_sending", "entries", "held")

    def __init__(self) -> None:
        self.entries: dict[bytes, int | None] = {}
        # Deletes of blocks a demotion is carrying away (`Tier.release`): they wait for
        # `settle`, so no write deletes a block before its destination copy is durable.
        self.held: set[bytes] = set()
        # Taken and neither sent nor restored yet: a key stored again meanwhile leaves it, so
        # a failed send never restores the delete of a live key.
        self._sending: set[bytes] = set()

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, key: object) -> bool:
        return key in self.entries

    def add(self, keys: Iterable[bytes], value: int | None = None) -> None:
        """Keys to delete (`value`: what each delete needs, see the class docstring)."""
        for k in keys:
            self.entries[k] = value

    def hold(self, keys: Iterable[bytes]) -> None:
        """Deletes that wait for `settle` (their blocks' moves are running)."""
        self.held.update(keys)

    def settle(self, keys: Iterable[bytes]) -> None:
        """Held deletes whose moves ended: pending now (keys stored again since are not)."""
        held = self.held
        for k in keys:
            if k in held:
                held.discard(k)
                self.entries[k] = None

    def unpend(self, keys: Iterable[bytes]) -> None:
        """Keys stored again (live: no pending delete may remove them), or deleted."""
        if self.entries or self._sending or self.held:
            for k in keys:
                self.entries.pop(k, None)
                self._sending.discard(k)
                self.held.discard(k)

    def take(self) -> dict[bytes, int | None]:
        """Every pending delete, to send now; the set is left empty. Then `sent` or
        `restore` them."""
        taken, self.entries = self.entries, {}
        self._sending.update(taken)
        return taken

    def sent(self, taken: Iterable[bytes]) -> None:
        """Deletes `take`n have been sent."""
        self._sending.difference_update(taken)

    def restore(self, taken: Iterable[bytes], stored: Collection[bytes] = ()) -> None:
        """Deletes `take`n and not sent (the call failed) are pending again, except keys
        stored again since the take (`unpend`) or in `stored`: they are live."""
        values = taken if isinstance(taken, dict) else dict.fromkeys(taken)
        for k, v in values.items():
            if k in self._sending and k not in stored:
                self.entries[k] = v
        self._sending.difference_update(values)

    def snapshot(self) -> set[bytes]:
        """The pending keys now (a probe's view, taken under the lock, used outside it)."""
        return set(self.entries)


def leading_clear(keys: Sequence[bytes], pending: Collection[bytes], prefix: bytes = b"") -> int:
    """How many leading `keys` are not pending deletes (`prefix` + key in `pending`): a probe
    stops at a key this process is deleting, whatever the store still holds under it."""
    if not pending:
        return len(keys)
    return next((i for i, k in enumerate(keys) if prefix + k in pending), len(keys))


class KeyedTier(Tier):
    """A tier whose store keeps each block under its key (see the module docstring)."""

    store_label: ClassVar[str] = ""  # "LMDB", "Redis": how errors name the store
    _ns: int  # this tier's namespace id (set by the subclass before it reads)

    def __init__(
        self,
        *,
        name: str,
        block_bytes: int,
        capacity_blocks: int,
        compression: str,
        level: int,
        element_size: int = 2,
    ) -> None:
        super().__init__(name=name, block_bytes=block_bytes, capacity_blocks=capacity_blocks)
        self._compression, self._level = compression, level
        self._element_size = element_size  # 2: zstd over a byte-plane shuffle
        self._tls = threading.local()  # per thread: zstd compressor and decompressor
        self._slot_key: dict[int, bytes] = {}
        self._own: set[int] = set()  # slots of blocks this instance stored (evicting deletes)
        self._recovered: list[bytes] = []  # found at open, slot i holding key i
        # Per thread, keys a read found absent (see take_gone): a read's failures are sorted
        # on the thread that read, so two threads reading one absent key each see it gone.
        self._gone = threading.local()

    # Slots for blocks another process stored: `Tier.allocate`, not the subclass's (they are
    # not recorded as ours, so evicting them later only forgets them). An alias, not a method
    # calling it: a first lookup of one key after a lazy open adopts one block.
    adopt = Tier.allocate

    def _note_gone(self, keys: Sequence[bytes]) -> None:
        """Keys this thread's read found absent from the store (see `take_gone`)."""
        if not keys:
            return
        gone = getattr(self._gone, "keys", None)
        if gone is None or len(gone) > _GONE_MAX:  # nobody asks: keep the set bounded
            gone = self._gone.keys = set()
        gone.update(keys)

    def take_gone(self, keys: Sequence[bytes]) -> set[bytes]:
        gone = getattr(self._gone, "keys", None)
        if not gone:
            return set()
        found = gone.intersection(keys)
        gone.difference_update(found)
        return found

    def _take_found(self, keys: Sequence[bytes]) -> None:
        """Index the blocks found in the store at open (oldest first) as slots 0..n-1; not
        `_own`: evicting them only forgets them. Claimed here, not in recover(): they
        occupy the store either way. Called once, on the fresh free list."""
        assert self.used_blocks == 0, "_take_found runs once, at open"
        self._recovered = list(keys)
        self._slot_key.update(enumerate(self._recovered))
        # The free stack pops ascending slots: 0..n-1 are its last n entries.
        del self._free[len(self._free) - len(self._recovered) :]

    def recover_columns(self) -> tuple[list[bytes], list[int]]:
        """Every block found at open and still held, oldest first."""
        held = list(map(self._slot_key.get, range(len(self._recovered))))
        if held == self._recovered:  # every one still held (C loops: at open, millions)
            return list(self._recovered), list(range(len(held)))
        slots = [s for s, k in enumerate(self._recovered) if held[s] == k]
        return [self._recovered[s] for s in slots], slots

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{self.medium}: the {self.store_label} tier is closed")

    def _io_keys(
        self, slots: Sequence[int], blocks: Any, keys: Sequence[bytes] | None, name: str
    ) -> Sequence[bytes]:
        """What every read and write checks first: `blocks` (the tensor `name`) holds one
        block per slot, one key per slot is given, the tier is open. The keys."""
        n = len(slots)
        check_blocks(blocks, n, self.block_bytes, name)
        if keys is None:
            raise ValueError(
                f"keys: the {self.store_label} tier stores blocks by key; pass one key per slot"
            )
        if len(keys) != n:
            raise ValueError(f"keys: expected {n} keys, got {len(keys)}")
        self._check_open()
        return keys

    def read(
        self, slots: Sequence[int], dst: torch.Tensor, keys: Sequence[bytes] | None = None
    ) -> list[int]:
        """Read blocks by key (slots are handles only) into `dst`, through a host copy of it
        where it is on a device: the store's own `_read_rows`. The failed positions."""
        keys = self._io_keys(slots, dst, keys, "dst")
        if not keys:
            return []
        out = dst if dst.device.type == "cpu" else torch.empty(dst.shape, dtype=torch.uint8)
        failed = self._read_rows(keys, out.numpy())
        if out is not dst:
            dst.copy_(out)
        return failed

    def _read_rows(self, keys: Sequence[bytes], rows: np.ndarray) -> list[int]:
        """Read the blocks of `keys` into `rows` (one per key); the failed positions, sorted.
        Each store's own."""
        raise NotImplementedError

    def _encode(
        self, key: bytes, row: Any, seq: int, zc: zstandard.ZstdCompressor | None
    ) -> tuple[bytes, bytes | memoryview]:
        """Header and stored bytes of one block of this tier (`format.encode_block`)."""
        return encode_block(
            key,
            row,
            namespace=self._ns,
            seq=seq,
            compression=self._compression,
            level=self._level,
            element_size=self._element_size,
            compressor=zc,
        )

    def _compressor(self) -> zstandard.ZstdCompressor | None:
        if self._compression != "zstd":
            return None
        zc = getattr(self._tls, "zc", None)
        if zc is None:
            zc = self._tls.zc = zstandard.ZstdCompressor(level=self._level)
        return zc

    def _decompressor(self) -> zstandard.ZstdDecompressor:
        dz = getattr(self._tls, "dz", None)
        if dz is None:
            dz = self._tls.dz = zstandard.ZstdDecompressor()
        return dz

    # -- ownership of slots by key ---------------------------------------------------------
    def _claim(self, slots: Sequence[int], keys: Sequence[bytes]) -> list[bytes]:
        """Record `keys` as stored by this instance in `slots` (evicting them deletes them);
        the keys of ours these slots held before, under another key: to delete."""
        replaced: list[bytes] = []
        slot_key, own = self._slot_key, self._own
        for s, k in zip(slots, keys, strict=True):
            old = slot_key.get(s)
            if old is not None and old != k and s in own:
                replaced.append(old)
            slot_key[s] = k
        own.update(slots)
        return replaced

    def _release(self, slots: Sequence[int]) -> list[bytes]:
        """Forget `slots`; the keys of the blocks this instance stored there: to delete.
        Blocks found at open or adopted are only forgotten (see the module docstring)."""
        gone: list[bytes] = []
        slot_key, own = self._slot_key, self._own
        for s in slots:
            k = slot_key.pop(s, None)
            if s in own:
                own.discard(s)
                if k is not None:
                    gone.append(k)
        return gone

    def free(self, slots: Sequence[int]) -> None:
        """Return slots; the blocks this instance stored there since it opened are deleted
        with the next write or at flush, others only forgotten (see the module docstring)."""
        self._drop(slots, held=False)
        super().free(slots)

    def release(self, slots: Sequence[int]) -> None:
        """`free`, but the deletes of blocks this instance stored wait for `settle`."""
        self._drop(slots, held=True)
        super().free(slots)

    def _drop(self, slots: Sequence[int], *, held: bool) -> None:
        """Forget `slots` (`_release`); the keys this instance stored there go to the pending
        deletes (`held`: to those waiting for `settle`). Each store's own."""
        raise NotImplementedError

    # -- one stored value --------------------------------------------------------------------
    def _header(self, key: bytes, head: bytes | memoryview, payload_len: int) -> BlockHeader:
        """The header of block `key` of this namespace and block size whose stored payload
        is `payload_len` bytes; BlockCorruptError if `head` is not that."""
        h = header_of(head, key, self._ns, self.block_bytes)
        if payload_len != h.stored_len:
            raise BlockCorruptError("length mismatch")
        return h

    def _decode_block(
        self, key: bytes, head: bytes | memoryview, body: bytes | memoryview, row: np.ndarray
    ) -> bool:
        """Check one stored value (header `head`, payload `body`) and decode it into `row`;
        False if it is not a good block of `key`."""
        try:
            h = self._header(key, head, len(body))
            if h.codec == CODEC_RAW:
                # Copy, then checksum the copy while it is in cache: one pass over memory,
                # and what is verified is exactly what the caller gets.
                np.copyto(row, np.frombuffer(body, dtype=np.uint8))
                verify(h, row)
            else:
                decode_payload(h, body, row, decompressor=self._decompressor())
        except BlockCorruptError:
            return False
        return True
