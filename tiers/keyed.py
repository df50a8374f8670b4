"""`KeyedTier`: what the tiers whose store is addressed by block key share (LMDB, Redis).

In such a store slots are only handles: a block lives under its key. Shared here:
- `_slot_key`: slot -> key of the blocks this instance stored or found at open (blocks
  adopted later from another process are not in it);
- `_own`: the slots of blocks this instance stored since it opened: the only ones its
  evictions delete. Blocks found at open or adopted (`adopt`) are only forgotten: other
  processes may be serving them, and the store's capacity decides when they go;
- `_note_gone(keys)` / `take_gone(keys)`: reads that found no block at all (another process
  or the store's own capacity evicted it): plain misses, not errors;
- `_take_found(keys)` / `recover()`: what the store held at open, as slots 0..n-1;
- `_check_open()`, `_check_keys(keys, n)`: errors naming the store;
- `_compressor()`, `_decompressor()`: zstd contexts per thread (they are not thread-safe).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import ClassVar

import zstandard

from tiercache.tiers.base import Tier

_GONE_MAX = 1 << 16  # take_gone's memory of plain misses nobody asked about


class KeyedTier(Tier):
    """A tier whose store keeps each block under its key (see the module docstring)."""

    store_label: ClassVar[str] = ""  # "LMDB", "Redis": how errors name the store

    def __init__(
        self, *, name: str, block_bytes: int, capacity_blocks: int, compression: str, level: int
    ) -> None:
        super().__init__(name=name, block_bytes=block_bytes, capacity_blocks=capacity_blocks)
        self._compression, self._level = compression, level
        self._tls = threading.local()  # per thread: zstd compressor and decompressor
        self._slot_key: dict[int, bytes] = {}
        self._own: set[int] = set()  # slots of blocks this instance stored (evicting deletes)
        self._recovered: list[bytes] = []  # found at open, slot i holding key i
        # Per thread, keys a read found absent (see take_gone): a read's failures are sorted
        # on the thread that read, so two threads reading one absent key each see it gone.
        self._gone = threading.local()

    def adopt(self, keys: Sequence[bytes]) -> list[int] | None:
        """Slots for blocks another process stored: not recorded as ours, so evicting them
        later only forgets them."""
        return Tier.allocate(self, keys)

    def _note_gone(self, keys: Sequence[bytes]) -> None:
        """Keys this thread's read found absent from the store (see `take_gone`)."""
        if not keys:
            return
        gone = getattr(self._gone, "keys", None)
        if gone is None or len(gone) > _GONE_MAX:  # nobody asks: keep the set bounded
            gone = self._gone.keys = set()
        gone.update(keys)

    def take_gone(self, keys: Sequence[bytes]) -> set[bytes]:
        """Of `keys` whose read on this thread failed, those that were plain misses: the
        store no longer held them (another process deleted them, or the store's capacity
        evicted them)."""
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

    def recover(self) -> list[tuple[bytes, int]]:
        """(key, slot) of every block found at open and still held, oldest first."""
        return list(zip(*self.recover_columns(), strict=True))

    def recover_columns(self) -> tuple[list[bytes], list[int]]:
        held = list(map(self._slot_key.get, range(len(self._recovered))))
        if held == self._recovered:  # every one still held (C loops: at open, millions)
            return list(self._recovered), list(range(len(held)))
        slots = [s for s, k in enumerate(self._recovered) if held[s] == k]
        if len(slots) == len(self._recovered):
            return list(self._recovered), slots
        return [self._recovered[s] for s in slots], slots

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{self.medium}: the {self.store_label} tier is closed")

    def _check_keys(self, keys: Sequence[bytes] | None, n: int) -> Sequence[bytes]:
        if keys is None:
            raise ValueError(
                f"keys: the {self.store_label} tier stores blocks by key; pass one key per slot"
            )
        if len(keys) != n:
            raise ValueError(f"keys: expected {n} keys, got {len(keys)}")
        return keys

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
