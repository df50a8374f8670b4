"""`KeyedTier`: what the tiers whose store is addressed by block key share (LMDB, Redis).

In such a store slots are only handles: a block lives under its key. Shared here:
- `_slot_key`: slot -> key of the blocks this instance stored or found at open (evicting
  one deletes its key; blocks adopted later from another process are not in it);
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
        self._recovered: list[tuple[bytes, int]] = []

    def _take_found(self, keys: Sequence[bytes]) -> None:
        """Index the blocks found in the store at open (oldest first) as slots 0..n-1, owned
        by this instance. Claimed here, not in recover(): they occupy the store either way."""
        self._recovered = [(k, s) for s, k in enumerate(keys)]
        self._slot_key.update((s, k) for k, s in self._recovered)
        self._claim(range(len(keys)))

    def recover(self) -> list[tuple[bytes, int]]:
        """(key, slot) of every block found at open and still held, oldest first."""
        return [(k, s) for k, s in self._recovered if self._slot_key.get(s) == k]

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
