"""Reading an NVMe tier's slots: `SlotReads`, one read of a list of slots.

Each run of adjacent slots (`io.slot_runs`) is one `preadv` into an aligned run buffer on the
tier's `SlotPipeline` pool; the caller's thread checks every slot of a run (header, the
indexed write, the checksum over header + payload) while the next runs are read. A checked
slot then goes one of two ways:
- `into(rows)`: decoded into the caller's rows (`NVMeTier.read`);
- `to_sink(sink)`: handed over in place (`NVMeTier.read_to`): `sink(positions, rows)` gets
  the verified payloads of a run as a strided view of the run buffer, so the only copy is
  the sink's own (a compressed block or a slot read again alone: from a buffer of its own).
A slot that fails its checks is never handed over. A run that fails or comes back short is
read again slot by slot, so an I/O error fails only the slots it hits. (Not straight into
the destination with O_DIRECT: a payload starts 64 bytes into its slot, not aligned.)
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Callable, Sequence

import numpy as np
import torch

from tiercache.errors import BlockCorruptError
from tiercache.tiers.format import (
    CODEC_RAW,
    HEADER_SIZE,
    BlockHeader,
    decode_payload,
    header_of,
    is_raw_block,
    verify,
)
from tiercache.tiers.nvme.io import AlignedBuffer, Slab, SlotRun, slot_runs

log = logging.getLogger(__package__)  # "tiercache.tiers.nvme", as the tier's

# sink(positions, rows): rows[j] holds the verified bytes of position positions[j] (indices
# into the slots read); a view valid only during the call.
Sink = Callable[[list[int], torch.Tensor], None]


class SlotReads:
    """One read of `slots`, whose slot `slots[i]` should hold `keys[i]` (checked by the
    caller), from `slab`. `seqs` and `index_keys` are the tier's index (per slot: the
    indexed write's seq, 0 for none, and its key); `ns` the namespace id, or None for any."""

    def __init__(
        self,
        slab: Slab,
        *,
        ns: int | None,
        seqs: np.ndarray,
        index_keys: np.ndarray,
        slots: Sequence[int],
        keys: Sequence[bytes],
    ) -> None:
        self._fd, self._sb, self._bb, self._ns = slab.fd, slab.slot_bytes, slab.block_bytes, ns
        self._seqs, self._index_keys = seqs, index_keys
        self._pipeline = slab.pipeline
        self._slots, self.keys = slots, keys
        self._runs = slot_runs(slots, slab.pipeline.run_slots)
        # Per position: None (good), or the error that failed it.
        self.results: list[BaseException | None] = [None] * len(slots)

    # -- checks ----------------------------------------------------------------------------
    def _header(self, i: int, view: memoryview, got: int) -> BlockHeader | BaseException:
        """Position i's header from its slot's bytes (`got` of them arrived), checked against
        the key, the namespace and the index (not the payload); the error, not raised."""
        if got < HEADER_SIZE + self._bb:
            return OSError(errno.EIO, f"short read ({max(got, 0)} bytes)")
        try:
            h = header_of(view[:HEADER_SIZE], self.keys[i], self._ns, None)
        except BlockCorruptError as exc:
            return exc
        # An indexed slot serves exactly the write its entry names: an entry loaded from
        # the image is not checked against the header at open, and a failed rewrite of the
        # same key can leave another write in the slot. (A slot freed since has no entry;
        # its bytes stay readable until rewritten.)
        slot = self._slots[i]
        want = self._seqs.item(slot)
        if want and want != h.seq and self._index_keys[slot].tobytes() == h.key:
            return BlockCorruptError(f"slot holds write {h.seq}, indexed {want}")
        if h.raw_len != self._bb:
            return BlockCorruptError(f"block holds {h.raw_len} bytes, expected {self._bb}")
        return h

    def _plain(self, i: int, view: memoryview, got: int) -> bool:
        """Whether position i's slot holds exactly the raw block its index entry names,
        verified (`is_raw_block`); False: `_header` and `_decode` tell what it holds."""
        seq = self._seqs.item(self._slots[i])
        return (
            seq != 0
            and self._ns is not None
            and got >= HEADER_SIZE + self._bb
            and is_raw_block(view, self.keys[i], self._ns, self._bb, seq)
        )

    def _decode(self, i: int, view: memoryview, got: int, row: np.ndarray) -> BaseException | None:
        """Check position i and decode its payload into `row` (verifies the checksum first)."""
        h = self._header(i, view, got)
        if isinstance(h, BaseException):
            return h
        try:
            decode_payload(h, view[HEADER_SIZE : HEADER_SIZE + h.stored_len], row)
        except BlockCorruptError as exc:
            return exc
        return None

    def _alone(self, i: int) -> tuple[AlignedBuffer, int] | BaseException:
        """Position i's slot read by itself (after its run failed or came back short)."""
        one = AlignedBuffer(self._sb)
        try:
            return one, os.preadv(self._fd, [one.mm], self._slots[i] * self._sb)
        except OSError as exc:
            return exc

    def _get(self, r: int, buf: AlignedBuffer) -> int:
        run = self._runs[r]
        return os.preadv(self._fd, [buf.view[: run.count * self._sb]], run.first * self._sb)

    def _read(self, check: Callable[[SlotRun, AlignedBuffer, int | BaseException], None]) -> None:
        self._pipeline.run(
            len(self._runs),
            self._get,
            lambda r, buf: None,
            lambda r, buf, got: check(self._runs[r], buf, got),
        )

    def _each(
        self,
        run: SlotRun,
        buf: AlignedBuffer,
        got: int | BaseException,
        first: Callable[[int, int, memoryview, int], BaseException | None],
        again: Callable[[int, memoryview, int], BaseException | None],
    ) -> None:
        """The one slot loop of a run: `first(k, i, view, got)` takes position i from the run
        buffer (its k-th slot); a position that failed with an I/O error in a run of several
        is read again alone and taken by `again(i, view, got)`. Records every result."""
        sb = self._sb
        for k, i in run.members:
            if isinstance(got, BaseException):
                res: BaseException | None = got
            else:
                res = first(k, i, buf.view[k * sb : (k + 1) * sb], min(got - k * sb, sb))
            if isinstance(res, OSError) and run.count > 1:
                one = self._alone(i)
                res = one if isinstance(one, BaseException) else again(i, one[0].view, one[1])
            self.results[i] = res

    # -- the two destinations --------------------------------------------------------------
    def into(self, rows: np.ndarray) -> list[BaseException | None]:
        """Decode every good position i into `rows[i]` (uint8 `[n, block_bytes]`)."""

        def first(k: int, i: int, view: memoryview, n: int) -> BaseException | None:
            if self._plain(i, view, n):
                rows[i] = view[HEADER_SIZE : HEADER_SIZE + self._bb]
                return None
            return self._decode(i, view, n, rows[i])

        def again(i: int, view: memoryview, n: int) -> BaseException | None:
            return self._decode(i, view, n, rows[i])

        self._read(lambda run, buf, got: self._each(run, buf, got, first, again))
        return self.results

    def to_sink(self, sink: Sink) -> list[BaseException | None]:
        """Hand every good position to `sink`, verified, without copying it first: a run's
        good raw slots as strided views of the run buffer, one call per stretch of them
        (a slot named twice starts a new stretch); the others one by one."""
        sb, bb = self._sb, self._bb

        def alone(
            i: int, view: memoryview, got: int, to: list[tuple[int, int]] | None = None, k: int = 0
        ) -> BaseException | None:
            """Position i checked: a raw block verified, then added to `to` (the k-th slot of
            a run, handed over in place) or, without one, handed over alone; a compressed one
            decoded into a buffer of its own and handed over."""
            h = self._header(i, view, got)
            if isinstance(h, BaseException):
                return h
            try:
                if h.codec == CODEC_RAW:
                    verify(h, view[HEADER_SIZE : HEADER_SIZE + bb])
                    if to is not None:
                        to.append((k, i))
                        return None
                    row = torch.frombuffer(view[HEADER_SIZE : HEADER_SIZE + bb], dtype=torch.uint8)
                else:
                    out = np.empty(bb, dtype=np.uint8)
                    decode_payload(h, view[HEADER_SIZE : HEADER_SIZE + h.stored_len], out)
                    row = torch.from_numpy(out)
            except BlockCorruptError as exc:
                return exc
            sink([i], row.view(1, bb))
            return None

        def check(run: SlotRun, buf: AlignedBuffer, got: int | BaseException) -> None:
            ready: list[tuple[int, int]] = []  # (k, i) verified in place, in slot order

            def first(k: int, i: int, view: memoryview, n: int) -> BaseException | None:
                if self._plain(i, view, n):
                    ready.append((k, i))
                    return None
                return alone(i, view, n, ready, k)

            self._each(run, buf, got, first, alone)
            if not ready:
                return
            # The run buffer as [slots, slot_bytes]; payloads are columns 64..64+bb.
            t = torch.from_numpy(buf.arr[: run.count * sb]).view(run.count, sb)
            payloads = t[:, HEADER_SIZE : HEADER_SIZE + bb]
            start = 0
            for j in range(1, len(ready) + 1):
                if j == len(ready) or ready[j][0] != ready[j - 1][0] + 1:
                    k0 = ready[start][0]
                    sink([i for _, i in ready[start:j]], payloads[k0 : k0 + j - start])
                    start = j

        self._read(check)
        return self.results

    def failed(self, results: list[BaseException | None], medium: str) -> list[int]:
        """The failed positions of this read's `results` (each logged, `medium` naming the
        tier); raises a bug's exception, and OSError when no block could be read."""
        for r in results:
            if r is not None and not isinstance(r, OSError | BlockCorruptError):
                raise r  # a bug, not a bad block
        failed = [i for i, r in enumerate(results) if r is not None]
        if len(failed) == len(results) and all(isinstance(r, OSError) for r in results):
            raise OSError(
                getattr(results[0], "errno", errno.EIO),
                f"{medium}: no block could be read: {results[0]}",
            )
        slots, keys = self._slots, self.keys
        for i in failed:
            log.warning("%s: slot %d (key %s): %s", medium, slots[i], keys[i].hex(), results[i])
        return failed
