"""`OfflineStore`: what offline tools (the CLI's inspect, verify, evict and clear) ask of a
persistent store on disk, whatever its kind (`Tier.offline_store` gives the kind's); the records
that cross: `BlockInfo`, `Problem`; and what every kind's description shares: `summarize`,
`namespace_label`."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True, slots=True)
class BlockInfo:
    """One stored block: its key, write sequence, namespace tag and sizes; `slot` for NVMe."""

    key: bytes
    seq: int
    namespace: int
    raw_len: int
    stored_len: int
    slot: int | None = None


@dataclass(frozen=True)
class Problem:
    """Something wrong in a store: where (a slot, a key, or the index) and what."""

    where: str
    what: str
    key: bytes | None = None
    slot: int | None = None
    entry: bytes | None = None  # LMDB: the store key (namespace id + block key) to delete


class OfflineStore(Protocol):
    """A store on disk for offline tools. Reads take no lock a running engine needs and
    write nothing; `repair` and `drop` change the store (`check_free` says whether they can
    now). Each call opens the store and closes it again."""

    def exists(self) -> bool:
        """Whether a store is there yet."""

    def count(self) -> int:
        """Entries `verify` reads (a progress bar's total)."""

    def blocks(self) -> list[BlockInfo]:
        """The good blocks, one copy each."""

    def describe(self, names: Mapping[int, str]) -> dict[str, Any]:
        """The fields `tiercache inspect` shows (`names`: namespace ids it can name);
        "capacity_blocks" is None where the store records none."""

    def verify(self, advance: Callable[[int], None]) -> tuple[int, list[Problem], list[str]]:
        """Every block read and checked, and the index: (entries checked, problems, notes);
        `advance(n)` as n more entries are checked."""

    def repair(self, problems: Iterable[Problem]) -> int:
        """Drop what `verify` found bad; the number of entries dropped."""

    def drop(self, blocks: Iterable[BlockInfo]) -> int:
        """Remove these blocks (as `blocks` listed them); the number removed."""

    def check_free(self) -> None:
        """StoreError when another process holds the store so that it cannot change now."""


def namespace_label(ns: int, names: Mapping[int, str]) -> str:
    """A namespace's name where known, else `id:<16 hex digits>` (as `--namespace` takes it)."""
    return names.get(ns, f"id:{ns:016x}")


def summarize(blocks: list[BlockInfo], names: Mapping[int, str]) -> dict[str, Any]:
    """Blocks, bytes, compression ratio, blocks per namespace and the write sequence range."""
    raw = sum(b.raw_len for b in blocks)
    stored = sum(b.stored_len for b in blocks)
    ns = Counter(namespace_label(b.namespace, names) for b in blocks)
    return {
        "blocks": len(blocks),
        "raw_bytes": raw,
        "stored_bytes": stored,
        "compression_ratio": raw / stored if stored else 1.0,
        "namespaces": dict(ns.most_common()),
        "oldest_seq": min((b.seq for b in blocks), default=None),
        "newest_seq": max((b.seq for b in blocks), default=None),
    }
