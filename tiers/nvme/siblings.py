"""`NVMeSiblingsTier`: read-only access to the other instances of an NVMe store path, for a
rank whose blocks another rank's instance holds (head shards after a TP change; see
docs/tp-layout.md).

Primitives:
- `Siblings`: the instances under one path as offline readers (`NVMeStoreReader`), and one
  index key -> every (instance, slot) their journals named when last read (journal entries
  name no namespace: tenants of one path hold equal keys); `find(key)` returns the newest
  place whose header is ours, reading the journals again (at most every `RELOAD_S`) when
  none holds what they said.
- `NVMeSiblingsTier`: a shared, read-only tier over the siblings of this process's own
  instances: `probe` finds keys there, `adopt` indexes them under slots of its own, `read`
  verifies as every NVMe read does. A slot the owner wrote again since its journal was read
  is a plain miss (`take_gone`), never an error. `write` refuses.
- `SiblingsProbe`: the scheduler's read-only `StoreProbe` over every instance of the path.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
import torch

from tiercache.errors import BlockCorruptError, ConfigError
from tiercache.tiers.base import Tier, check_blocks, present_per_key
from tiercache.tiers.format import (
    HEADER_SIZE,
    decode_payload,
    header_check,
    header_of,
    namespace_id,
)
from tiercache.tiers.nvme.layout import META, instance_dirs
from tiercache.tiers.nvme.reader import NVMeStoreReader

RELOAD_S = 1.0  # the journals are read again at most this often (on a stale slot)
_SLOT_BITS = 40  # an index entry packs (instance, slot) as instance << 40 | slot


class _Index:
    """key -> every (instance, slot) named for it, as two numpy columns sorted by key, no
    Python object per block (a same-TP rank indexes its siblings' every block, and asks for
    none of them): 17 bytes of key (the 16 and a 0x01, so numpy's fixed-width bytes keep
    trailing zero bytes) and 8 of place per block. A key may have several places: equal
    keys of two namespaces (another model, another cache salt) in one instance or in two."""

    def __init__(self, keys: list[bytes], places: list[int]) -> None:
        k = np.array([x + b"\x01" for x in keys], dtype="S17")
        # A stable sort keeps each key's entries in the order given (oldest first).
        order = np.argsort(k, kind="stable")
        self._keys, self._places = k[order], np.array(places, dtype=np.int64)[order]
        self._distinct = int(np.count_nonzero(self._keys[1:] != self._keys[:-1])) + bool(len(k))

    def places(self, key: bytes) -> list[tuple[int, int]]:
        """Every (instance, slot) named for `key`, newest first; [] when none."""
        probe = key + b"\x01"
        lo = int(np.searchsorted(self._keys, probe))
        if lo == len(self._keys) or self._keys[lo] != probe:
            return []
        hi = int(np.searchsorted(self._keys, probe, side="right"))
        mask = (1 << _SLOT_BITS) - 1
        return [(p >> _SLOT_BITS, p & mask) for p in self._places[lo:hi][::-1].tolist()]

    def get(self, key: bytes) -> tuple[int, int] | None:
        """The newest (instance, slot) named for `key`, else None."""
        at = self.places(key)
        return at[0] if at else None

    def __len__(self) -> int:
        """Distinct keys."""
        return self._distinct


class Siblings:
    """The NVMe instances under `path` whose blocks are `block_bytes` long, read-only, except
    instance `skip` (the rank's own) or, without one, those process `skip_pid` holds open;
    `find` and `place` are safe from any thread."""

    def __init__(
        self,
        path: str,
        block_bytes: int,
        namespace: str,
        *,
        skip: int | None = None,
        skip_pid: int | None = None,
    ) -> None:
        self.path = os.path.abspath(path)
        self._block_bytes = block_bytes
        self._ns = namespace_id(namespace)
        self._check = header_check(self._ns, block_bytes)
        self._skip, self._skip_pid = skip, skip_pid
        self._lock = threading.Lock()
        self.readers: dict[int, NVMeStoreReader] = {}  # instance -> its reader
        self._index = _Index([], [])  # key -> every (instance, slot)
        self._loaded = float("-inf")
        self.reload(force=True)

    def reload(self, *, force: bool = False) -> bool:
        """Read the journals again (and look for new instances), unless done within
        `RELOAD_S`; whether it did."""
        now = time.monotonic()
        with self._lock:
            if not force and now - self._loaded < RELOAD_S:
                return False
            self._loaded = now
            keys: list[bytes] = []
            places: list[int] = []
            found = [(0, self.path)] if os.path.exists(os.path.join(self.path, META)) else []
            for k, d in found + instance_dirs(self.path):
                if k == self._skip:
                    continue
                r = self.readers.get(k)
                try:
                    if r is None:
                        r = NVMeStoreReader(d)
                        if r.block_bytes != self._block_bytes or (
                            self._skip is None
                            and self._skip_pid is not None
                            and r.holder() == self._skip_pid
                        ):
                            r.close()  # another block size, or this process's own instance
                            continue
                        self.readers[k] = r
                    else:
                        r.reload()
                except (OSError, ConfigError, ValueError):
                    continue  # not (yet) a readable store: none of its blocks
                keys += (e.key for e in r.entries)  # oldest first, then the next instance's
                places += ((k << _SLOT_BITS) | e.slot for e in r.entries)
                r.entries = []  # indexed here: no object per block kept
            self._index = _Index(keys, places)
            return True

    def find(self, key: bytes) -> tuple[int, int] | None:
        """The newest (instance, slot) the journals name for `key` that holds a well-formed
        header of it (our namespace, our length), else None. When some are named but none
        holds ours (stale entries), reads the journals again (rate-limited), retries once."""
        for attempt in (0, 1):
            places = self._index.places(key)
            for at in places:
                if self._holds(at, key):
                    return at
            if attempt or not places or not self.reload():
                return None
        return None

    def place(self, key: bytes) -> tuple[int, int] | None:
        """Where to read `key` that `find` just found: the one place the journals name,
        unchecked (no I/O); among several (namespaces' equal keys), what `find` answers."""
        places = self._index.places(key)
        if len(places) == 1:
            return places[0]
        return self.find(key) if places else None

    def _holds(self, at: tuple[int, int], key: bytes) -> bool:
        r = self.readers.get(at[0])
        try:
            return r is not None and self._check(r.read_slot(at[1], HEADER_SIZE), key)
        except (OSError, ValueError):
            return False

    def probe(self, keys: Sequence[bytes]) -> int:
        """How many leading `keys` some instance holds (headers checked)."""
        return next((i for i, k in enumerate(keys) if self.find(k) is None), len(keys))

    def present(self, keys: Sequence[bytes]) -> list[bool]:
        """Per key, whether some instance holds it: `probe` per key (one header read each,
        no transaction to share; a file that cannot be read is a block not held)."""
        return present_per_key(self, keys)

    def close(self) -> None:
        with self._lock:
            for r in self.readers.values():
                r.close()
            self.readers.clear()
            self._index = _Index([], [])


class SiblingsProbe(Siblings):
    """`StoreProbe` over every instance of an NVMe path (the scheduler's, read-only)."""

    def may_hold(self, key: bytes) -> bool:
        """False when no instance's journal names `key` (from memory, no I/O): the
        scheduler's index then answers a miss without waiting for the probe thread."""
        return self._index.get(key) is not None


class NVMeSiblingsTier(Tier):
    """Blocks other NVMe instances of one path hold, read-only: each adopted slot maps to an
    (instance, slot) there; its capacity is every sibling slot."""

    kind: ClassVar[str] = "nvme-siblings"
    persistent: ClassVar[bool] = True
    shared: ClassVar[bool] = True
    read_only: ClassVar[bool] = True
    # path: the NVMe tier's; instance: the rank's own (not read; without it, the instances
    # this process holds open are not read)
    OPTIONS: ClassVar = {"path": str, "instance": int}

    def __init__(
        self,
        *,
        name: str = "nvme-siblings",
        block_bytes: int,
        path: str,
        namespace: str = "",
        instance: int | None = None,
    ) -> None:
        if not isinstance(path, str) or not path:
            raise ConfigError("path", f"expected a directory path, got {path!r}")
        sib = Siblings(path, block_bytes, namespace, skip=instance, skip_pid=os.getpid())
        slots = sum(r.slots for r in sib.readers.values())
        super().__init__(name=name, block_bytes=block_bytes, capacity_blocks=max(1, slots))
        self._siblings = sib
        self._ns = namespace_id(namespace)
        self._at: dict[int, tuple[int, int]] = {}  # our slot -> (instance, slot)
        self._gone = threading.local()  # keys a read on this thread found gone

    @classmethod
    def from_config(cls, cfg: Any, block_bytes: int, *, namespace: str = "") -> NVMeSiblingsTier:
        if "path" not in cfg.options:
            raise ConfigError(f"{cfg.field}.path", f"an {cls.kind!r} tier needs a directory path")
        o = cfg.options
        return cls(
            name=cfg.name,
            block_bytes=block_bytes,
            path=o["path"],
            namespace=namespace,
            instance=o.get("instance"),
        )

    @classmethod
    def open_probe(cls, cfg: Any, block_bytes: int, *, namespace: str = "") -> SiblingsProbe | None:
        return SiblingsProbe(cfg.options["path"], block_bytes, namespace)

    @property
    def siblings(self) -> list[int]:
        """The instances read, by number."""
        return sorted(self._siblings.readers)

    # -- finding and indexing ----------------------------------------------------------------
    def probe(self, keys: Sequence[bytes]) -> int:
        return self._siblings.probe(keys)

    def adopt(self, keys: Sequence[bytes]) -> list[int] | None:
        at = [self._siblings.place(k) for k in keys]
        if any(a is None for a in at):  # reloaded since the probe: ask again
            return None
        slots = self.allocate(keys)
        if slots is not None:
            for s, a in zip(slots, at, strict=True):
                self._at[s] = a  # type: ignore[assignment]
        return slots

    def free(self, slots: Sequence[int]) -> None:
        for s in slots:
            self._at.pop(s, None)
        super().free(slots)

    def take_gone(self, keys: Sequence[bytes]) -> set[bytes]:
        gone: set[bytes] = getattr(self._gone, "keys", set())
        self._gone.keys = set()
        return gone & set(keys)

    # -- bytes -------------------------------------------------------------------------------
    def write(
        self, slots: Sequence[int], src: torch.Tensor, keys: Sequence[bytes] | None = None
    ) -> None:
        raise OSError(f"{self.medium}: read-only (another rank's NVMe instances)")

    def read(
        self, slots: Sequence[int], dst: torch.Tensor, keys: Sequence[bytes] | None = None
    ) -> list[int]:
        """Verified reads of sibling slots. A slot that no longer holds its key (the owner
        freed and wrote it again since its journal was read) is gone: a plain miss."""
        n = len(slots)
        check_blocks(dst, n, self.block_bytes, "dst")
        if keys is None or len(keys) != n:
            raise ValueError(f"{self.medium}: keys: expected one per slot ({n})")
        host = dst if dst.device.type == "cpu" else torch.empty(dst.shape, dtype=torch.uint8)
        rows = host.numpy()
        failed: list[int] = []
        gone: set[bytes] = set()
        io_errors = 0
        for i, (s, key) in enumerate(zip(slots, keys, strict=True)):
            at = self._at.get(s)
            r = self._siblings.readers.get(at[0]) if at is not None else None
            try:
                if r is None:
                    raise BlockCorruptError("instance no longer read")
                buf = r.read_slot(at[1])  # type: ignore[index]
                header = header_of(buf, key, self._ns, self.block_bytes)
                stored = memoryview(buf)[HEADER_SIZE : HEADER_SIZE + header.stored_len]
                decode_payload(header, stored, rows[i])
            except BlockCorruptError:
                failed.append(i)
                gone.add(key)  # the owner moved on: not ours to call damaged
            except OSError:
                failed.append(i)
                io_errors += 1
        if gone:
            self._siblings.reload()
        self._gone.keys = gone
        if n and io_errors == n:
            raise OSError(f"{self.medium}: no block could be read")
        if host is not dst:
            dst.copy_(host)
        return failed

    def close(self) -> None:
        if not self._closed:
            self._siblings.close()
        super().close()


__all__ = ["NVMeSiblingsTier", "Siblings", "SiblingsProbe"]
