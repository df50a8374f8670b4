"""The engine's paged KV buffer as the transfer engine sees it (row copies: `rows.py`).

Primitives:
- `KVLayout(kv_caches, num_blocks, block_size_factor=1, kv_first=None)`: the engine buffer
  (layer name -> tensor, blocks first `[num_blocks, ...]` or K/V first `[2, num_blocks, ...]`)
  reduced to its distinct allocations ("segments"): layers that are views of one allocation
  are copied together, once. `block_bytes` is the size of one offloaded block.
- `KVLayout.copy_to_pool(block_ids, pool, slots)` / `copy_from_pool(pool, slots, block_ids)`
  (`pool_copy(..., store=)`: either): engine blocks <-> rows of a pool tier's tensor; direct
  on one device, staged through a contiguous buffer on the engine's device otherwise (one
  host<->device copy per slot run).
- `KVLayout.gather(block_ids, out)` / `scatter(block_ids, src)`: engine blocks <-> a
  contiguous uint8 `[n, block_bytes]` buffer (the disk handler's staging buffer).
- `KVLayout.copy_mode`: how a CUDA engine's blocks move (`COPY_MODES`): "direct", one kernel
  launch per job over every layer, straight into the pool or buffer (pinned host memory
  included, `tiercache.transfer.batched`); "staged", that kernel into a contiguous buffer on
  the device, then one DMA per run of slots; "layers", one gather or scatter per segment;
  "auto" picks (`AUTO_STAGED_MIN_BYTES`). On the CPU, "direct" and "staged" run the kernel's
  CPU twin (the same copy list, one memmove each: the tests' check of its plan); "auto" is
  "layers" there, which reaches memcpy speed.

The bytes of one offloaded block (what tiers store): `block_size_factor` engine-block records
back to back. An engine-block record holds each segment's bytes for that engine block, in
segment order (order of first registration), and within a segment its chunks (K then V, or
one layer after another in a shared allocation) in address order. Pages are opaque bytes.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import numpy as np
import torch

from tiercache.errors import check_count
from tiercache.transfer import batched
from tiercache.transfer.rows import (
    FEW_RUNS,
    LOOP_MIN_BYTES,
    RowPlan,
    check_runs,
    copy_rows,
    paired_runs,
)

COPY_MODES = ("auto", "direct", "staged", "layers")
# "auto" on CUDA: jobs of at least this many bytes go through a device staging buffer and the
# copy engine (DMA), smaller ones straight into the pool with the kernel (None: never staged).
AUTO_STAGED_MIN_BYTES: int | None = 128 << 20


@dataclass(frozen=True)
class Segment:
    """One distinct allocation's share of an engine block: `chunks` x `chunk_bytes` bytes.

    `rows` is a view `[num_blocks, chunks, chunk_bytes]` (or `[num_blocks, chunk_bytes]` for
    one chunk) of the allocation, in the layout's element unit; `offset` is where the segment
    starts inside an engine-block record (bytes).
    """

    rows: torch.Tensor
    offset: int
    chunks: int
    chunk_bytes: int
    layers: tuple[str, ...]

    @property
    def nbytes(self) -> int:
        return self.chunks * self.chunk_bytes


@dataclass
class _Chunk:
    start: int  # byte offset of block 0's chunk in the storage
    size: int  # bytes
    block_stride: int  # bytes between consecutive engine blocks
    layers: list[str]  # the layer and any aliases of the same bytes


def _layer_chunks(
    name: str, t: torch.Tensor, num_blocks: int, kv_first: bool | None
) -> list[_Chunk]:
    es = t.element_size()
    shape = tuple(t.shape)
    blocks_first = len(shape) >= 1 and shape[0] == num_blocks
    kv = len(shape) >= 2 and shape[0] == 2 and shape[1] == num_blocks
    if kv_first is None:
        if blocks_first and kv:
            raise ValueError(
                f"kv_caches[{name!r}]: shape {shape} is ambiguous with num_blocks="
                f"{num_blocks}; pass kv_first=True or False"
            )
        kv_first = kv
    if not (kv if kv_first else blocks_first):
        want = "[2, num_blocks, ...]" if kv_first else "[num_blocks, ...] or [2, num_blocks, ...]"
        raise ValueError(
            f"kv_caches[{name!r}]: shape {shape} is not {want} with num_blocks={num_blocks}"
        )
    page = t[0, 0] if kv_first else t[0]
    if not page.is_contiguous():
        raise ValueError(
            f"kv_caches[{name!r}]: the page of one block is not contiguous "
            f"(strides {t.stride()}); pages are copied as opaque bytes"
        )
    size = page.numel() * es
    base = t.storage_offset() * es
    if kv_first:
        bs = t.stride(1) * es
        return [_Chunk(base + k * t.stride(0) * es, size, bs, [name]) for k in range(2)]
    return [_Chunk(base, size, t.stride(0) * es, [name])]


def _merge(chunks: list[_Chunk]) -> list[tuple[int, int, int, int, list[_Chunk]]]:
    """Chunks of one storage -> (start, count, stride, size, chunks) strided families.

    Chunks of equal size and block stride whose starts form one arithmetic progression are one
    family (one copy); otherwise each chunk is its own family.
    """
    uniq: dict[tuple[int, int, int], _Chunk] = {}
    for c in chunks:  # layers sharing one cache (aliases) are copied once
        kept = uniq.setdefault((c.start, c.size, c.block_stride), c)
        if kept is not c:
            kept.layers.extend(c.layers)
    cs = sorted(uniq.values(), key=lambda c: c.start)
    if len(cs) > 1 and len({(c.size, c.block_stride) for c in cs}) == 1:
        step = cs[1].start - cs[0].start
        if step >= cs[0].size and all(b.start - a.start == step for a, b in pairwise(cs)):
            return [(cs[0].start, len(cs), step, cs[0].size, cs)]
    return [(c.start, 1, c.size, c.size, [c]) for c in cs]


def per_pool(
    cache: dict[int, tuple[int, Any]], pool: torch.Tensor, make: Callable[[torch.Tensor], Any]
) -> Any:
    """`make(pool)`, kept in `cache` while the pool tensor lives (and its memory stays put):
    what a job needs of a tier's pool is the same for every job on it."""
    key = id(pool)
    hit = cache.get(key)
    if hit is not None and hit[0] == pool.data_ptr():
        return hit[1]
    value = make(pool)
    cache[key] = (pool.data_ptr(), value)
    # The value may hold the pool's storage (views): drop it with the pool (a closed tier).
    weakref.finalize(pool, cache.pop, key, None)
    return value


def on_stream(stream: Any) -> contextlib.AbstractContextManager[Any]:
    """`torch.cuda.stream(stream)`, or nothing to do for None (the current stream)."""
    return contextlib.nullcontext() if stream is None else torch.cuda.stream(stream)


class KVLayout:
    """The engine KV buffer as segments; copies blocks to and from pool rows and buffers."""

    def __init__(
        self,
        kv_caches: Mapping[str, torch.Tensor],
        num_blocks: int,
        block_size_factor: int = 1,
        *,
        kv_first: bool | None = None,
    ) -> None:
        if not kv_caches:
            raise ValueError("kv_caches: at least one layer is required")
        check_count("num_blocks", num_blocks)
        check_count("block_size_factor", block_size_factor)
        devices = {t.device for t in kv_caches.values()}
        if len(devices) != 1:
            raise ValueError(f"kv_caches: all layers must be on one device, got {devices}")
        self.device: torch.device = devices.pop()
        self.num_blocks = num_blocks
        self.factor = block_size_factor
        # Group layers by allocation, in order of first appearance (deterministic record format).
        storages: dict[int, tuple[torch.Tensor, list[_Chunk]]] = {}
        for name, t in kv_caches.items():
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"kv_caches[{name!r}]: expected a tensor, got {type(t).__name__}")
            key = t.untyped_storage().data_ptr()
            entry = storages.setdefault(key, (t, []))
            entry[1].extend(_layer_chunks(name, t, num_blocks, kv_first))
        families = [(t, fam) for t, chunks in storages.values() for fam in _merge(chunks)]
        # int64 elements when every offset and size allows: index ops on uint8 are slower.
        record = sum(f[1] * f[3] for _, f in families)
        wide = record % 8 == 0 and all(
            v % 8 == 0
            for t, f in families
            for v in (f[0], f[2], f[3], f[4][0].block_stride, t.untyped_storage().nbytes())
        )
        self.unit = 8 if wide else 1
        self._dtype = torch.int64 if wide else torch.uint8
        u = self.unit
        segments: list[Segment] = []
        offset = 0
        for t, (start, count, stride, size, chunks) in families:
            flat = torch.empty(0, dtype=torch.uint8, device=self.device).set_(t.untyped_storage())
            if wide:
                flat = flat.view(torch.int64)
            bs = chunks[0].block_stride
            view = flat.as_strided(
                (count, num_blocks, size // u), (stride // u, bs // u, 1), start // u
            )
            if count > 1 and stride == size:  # chunks adjacent within a block: one run of bytes
                view = flat.as_strided(
                    (1, num_blocks, count * size // u), (0, bs // u, 1), start // u
                )
                count, size = 1, count * size
            rows = view[0] if count == 1 else view.permute(1, 0, 2)
            layers = tuple(dict.fromkeys(n for c in chunks for n in c.layers))
            segments.append(Segment(rows, offset, count, size, layers))
            offset += count * size
        self.segments: tuple[Segment, ...] = tuple(segments)
        self.engine_block_bytes = offset
        self._pool_views: dict[int, tuple[int, list[torch.Tensor]]] = {}
        self._pool_kinds: dict[int, tuple[int, tuple[bool, bool]]] = {}
        self.block_bytes = offset * block_size_factor
        self._table: batched.ChunkTable | None = None
        self._host_rows: list[tuple[Segment, np.ndarray]] | None = None
        self.copy_mode = os.environ.get("TIERCACHE_CUDA_COPY", "auto")

    def chunk_rows(self) -> list[tuple[int, int, int, int]]:
        """Per chunk, in record order (a `batched.ChunkTable`'s rows): the engine address of
        block 0's chunk, the bytes between engine blocks, the chunk's bytes, its record offset."""
        u, rows = self.unit, []
        for seg in self.segments:
            r = seg.rows
            base, bstride = r.data_ptr(), r.stride(0) * u
            cstride = r.stride(1) * u if seg.chunks > 1 else 0
            for c in range(seg.chunks):
                rows.append(
                    (base + c * cstride, bstride, seg.chunk_bytes, seg.offset + c * seg.chunk_bytes)
                )
        return rows

    @property
    def copy_mode(self) -> str:
        """How blocks move between the engine and pools or buffers (module docstring)."""
        return self._copy_mode

    @copy_mode.setter
    def copy_mode(self, mode: str) -> None:
        if mode not in COPY_MODES:
            raise ValueError(f"copy_mode: {mode!r} is not one of {', '.join(COPY_MODES)}")
        self._copy_mode = mode

    def copy_mode_for(self, buf: torch.Tensor, rows: int, *, pool: bool = False) -> str:
        """The copy mode for a job of `rows` blocks into or out of `buf`. `pool`: `buf` is a
        tier's pool, whose kind (`_buffer_kind`) is kept while it lives."""
        mode = self._copy_mode
        if mode == "layers":
            return "layers"
        rows_of_blocks, reachable = (
            per_pool(self._pool_kinds, buf, self._buffer_kind) if pool else self._buffer_kind(buf)
        )
        if not rows_of_blocks:
            return "layers"
        if self.device.type == "cpu":  # the twin, where asked for, on host memory only
            return "direct" if mode != "auto" and buf.device.type == "cpu" else "layers"
        if self.device.type != "cuda" or not batched.triton_available():
            return "layers"
        if mode == "auto":
            big = AUTO_STAGED_MIN_BYTES is not None
            mode = (
                "staged" if big and rows * self.block_bytes >= AUTO_STAGED_MIN_BYTES else "direct"
            )
        if mode == "direct" and not reachable:
            mode = "staged"
        if mode == "staged" and buf.device == self.device:
            mode = "direct"  # a staging buffer on the device would be a second copy
        return mode

    def _buffer_kind(self, buf: torch.Tensor) -> tuple[bool, bool]:
        """(whether `buf` is uint8 `[n, block_bytes]` rows, whether the kernel reaches it: the
        engine's device or pinned host memory)."""
        rows_of_blocks = (
            buf.dtype == torch.uint8
            and buf.dim() == 2
            and buf.shape[1] == self.block_bytes
            and buf.is_contiguous()
        )
        reachable = buf.device == self.device or (buf.device.type == "cpu" and buf.is_pinned())
        return rows_of_blocks, reachable

    def _batched(
        self,
        block_ids: Sequence[int],
        rows: Sequence[int],
        buf: torch.Tensor,
        *,
        store: bool,
        stream: Any = None,
    ) -> None:
        """Blocks <-> rows of `buf` (uint8 `[n, block_bytes]`) in one launch (or its CPU twin)."""
        if rows and not (min(rows) >= 0 and max(rows) < buf.shape[0]):
            raise IndexError(f"rows {min(rows)}..{max(rows)} outside 0..{buf.shape[0] - 1}")
        if block_ids and not (min(block_ids) >= 0 and max(block_ids) < self.num_blocks):
            raise IndexError(f"engine block ids outside 0..{self.num_blocks - 1}")
        if not rows:
            return
        if self._table is None:
            self._table = batched.ChunkTable(self)
        if self.device.type == "cpu":
            batched.run_cpu(self._table, block_ids, rows, buf, self.block_bytes, store=store)
            return
        args = (self._table, block_ids, rows, buf.data_ptr(), self.block_bytes)
        if torch.cuda.current_device() == self.device.index:  # e.g. a lane stream's context
            batched.launch(*args, store=store, stream=stream)
            return
        with torch.cuda.device(self.device):
            batched.launch(*args, store=store, stream=stream)

    def _one_launch(
        self,
        block_ids: Sequence[int],
        buf: torch.Tensor,
        rows: Sequence[int],
        *,
        store: bool,
        non_blocking: bool,
        stream: Any = None,
        pool: bool = False,
        mode: str | None = None,
    ) -> bool:
        """A job by the kernel where the mode (`copy_mode_for`, or `mode`) says so; "staged":
        through a contiguous buffer on the engine's device, filled or emptied there by
        `gather`/`scatter` (the kernel where the mode allows), one DMA per run of rows.
        False: the caller copies by layers. Blocking callers return with the bytes in place,
        as `copy_` does."""
        mode = mode or self.copy_mode_for(buf, len(rows), pool=pool)
        if mode == "layers":
            return False
        if mode == "direct":  # one launch: the stream goes to the launcher, no stream switch
            self._batched(block_ids, rows, buf, store=store, stream=stream)
        else:
            n = len(rows)
            with on_stream(stream):
                tmp = torch.empty((n, self.block_bytes), dtype=torch.uint8, device=self.device)
                if store:
                    self.gather(block_ids, tmp, non_blocking=True)
                    copy_rows(buf, rows, tmp, range(n), non_blocking=non_blocking)
                else:
                    copy_rows(tmp, range(n), buf, rows, non_blocking=non_blocking)
                    self.scatter(block_ids, tmp, non_blocking=True)
        if not non_blocking and self.device.type == "cuda":
            (stream or torch.cuda.current_stream(self.device)).synchronize()
        return True

    # -- pool rows -------------------------------------------------------------------------
    def check_pool(self, pool: torch.Tensor, what: str = "pool") -> None:
        """A pool must be a contiguous uint8 `[capacity, block_bytes]` tensor."""
        if pool.dtype != torch.uint8 or pool.dim() != 2 or not pool.is_contiguous():
            raise ValueError(f"{what}: expected a contiguous uint8 [capacity, block_bytes] tensor")
        if pool.shape[1] != self.block_bytes:
            raise ValueError(
                f"{what}: rows of {pool.shape[1]} bytes, but an offloaded block of "
                f"this KV layout is {self.block_bytes} bytes (engine block "
                f"{self.engine_block_bytes} x block_size_factor {self.factor})"
            )

    def _records(self, buf: torch.Tensor) -> list[torch.Tensor]:
        """Per segment, a view `[rows * factor, chunks, chunk]` of a uint8 `[rows, block_bytes]`
        tensor (engine-block records), or `[rows, chunks, chunk]` of `[rows,
        engine_block_bytes]` (one record a row). Where a row is one record, rows may be
        strided (each row contiguous): `scatter` of a tier's read buffer."""
        u = self.unit
        rec = buf.view(self._dtype) if u == 8 else buf
        if buf.shape[1] != self.engine_block_bytes:
            rec = rec.view(buf.shape[0] * self.factor, self.engine_block_bytes // u)
        out = []
        for s in self.segments:
            v = rec[:, s.offset // u : (s.offset + s.nbytes) // u]
            out.append(v if s.chunks == 1 else v.unflatten(1, (s.chunks, s.chunk_bytes // u)))
        return out

    def _record_ids(self, slots: Sequence[int]) -> list[int]:
        f = self.factor
        if f == 1:
            return list(slots)
        return [s * f + j for s in slots for j in range(f)]

    def _check_ids(self, block_ids: Sequence[int], n: int) -> None:
        if len(block_ids) != n * self.factor:
            raise ValueError(
                f"block_ids: expected {n * self.factor} engine blocks for {n} "
                f"offloaded blocks (factor {self.factor}), got {len(block_ids)}"
            )

    def copy_to_pool(
        self,
        block_ids: Sequence[int],
        pool: torch.Tensor,
        slots: Sequence[int],
        *,
        non_blocking: bool = False,
        stream: Any = None,
    ) -> None:
        """Store: engine blocks -> pool rows `slots`. `stream`: a CUDA stream to queue the
        copies on instead of the current one."""
        self.pool_copy(block_ids, pool, slots, store=True, non_blocking=non_blocking, stream=stream)

    def copy_from_pool(
        self,
        pool: torch.Tensor,
        slots: Sequence[int],
        block_ids: Sequence[int],
        *,
        non_blocking: bool = False,
        stream: Any = None,
    ) -> None:
        """Load: pool rows `slots` -> engine blocks. `stream`: as `copy_to_pool`'s."""
        self.pool_copy(
            block_ids, pool, slots, store=False, non_blocking=non_blocking, stream=stream
        )

    def pool_copy(
        self,
        block_ids: Sequence[int],
        pool: torch.Tensor,
        slots: Sequence[int],
        *,
        store: bool,
        non_blocking: bool = False,
        stream: Any = None,
    ) -> None:
        """Engine blocks -> pool rows `slots` (`store`) or back: by the kernel where the mode
        says so, else by layers on one device, else staged (`_one_launch`)."""
        self._check_ids(block_ids, len(slots))
        job = (block_ids, pool, slots)
        if self._one_launch(*job, store=store, non_blocking=non_blocking, stream=stream, pool=True):
            return
        if pool.device != self.device:
            self._one_launch(
                *job, store=store, non_blocking=non_blocking, stream=stream, mode="staged"
            )
            return
        with on_stream(stream):
            views = per_pool(self._pool_views, pool, self._records)  # not rebuilt per job
            self._by_layers(block_ids, views, self._record_ids(slots), store=store, split=True)

    def _by_layers(
        self,
        block_ids: Sequence[int],
        views: Sequence[torch.Tensor],
        rows: Sequence[int],
        *,
        store: bool,
        split: bool = False,
    ) -> None:
        """Per segment, engine blocks -> `rows` of its record view (`store`) or back. `split`:
        a large load is shared with a helper thread (`copy_rows`; loads from a pool)."""
        plan = RowPlan(rows, block_ids) if store else RowPlan(block_ids, rows)
        for seg, view in zip(self.segments, views, strict=True):
            if store:
                copy_rows(view, rows, seg.rows, block_ids, plan=plan)
            else:
                copy_rows(seg.rows, block_ids, view, rows, split=split, plan=plan)

    # -- contiguous buffers ----------------------------------------------------------------
    def gather(
        self, block_ids: Sequence[int], out: torch.Tensor, *, non_blocking: bool = False
    ) -> None:
        """Engine blocks -> `out` (uint8 `[len(block_ids) // factor, block_bytes]`)."""
        n = out.shape[0]
        self._check_ids(block_ids, n)
        if self._one_launch(block_ids, out, range(n), store=True, non_blocking=non_blocking):
            return
        if out.device != self.device:
            tmp = torch.empty((n, self.block_bytes), dtype=torch.uint8, device=self.device)
            self.gather(block_ids, tmp)
            out.copy_(tmp, non_blocking=non_blocking)
            return
        self._by_layers(block_ids, self._records(out), range(len(block_ids)), store=True)

    def scatter(
        self, block_ids: Sequence[int], src: torch.Tensor, *, non_blocking: bool = False
    ) -> None:
        """`src` (uint8 `[len(block_ids) // factor, block_bytes]`) -> engine blocks. Its rows
        may be strided, each row contiguous (a tier's read buffer: `Tier.read_to`): copied
        from where they are, by layers."""
        n = src.shape[0]
        self._check_ids(block_ids, n)
        if self._scatter_on_host(block_ids, src):
            return
        if n > 1 and src.stride(0) != src.shape[1] and self.factor > 1:
            # Strided rows of several engine blocks each: one pass per engine block of a row
            # (its columns are again rows of one engine-block record each).
            eb, f = self.engine_block_bytes, self.factor
            for j in range(f):
                views = self._records(src[:, j * eb : (j + 1) * eb])
                self._by_layers(block_ids[j::f], views, range(n), store=False)
            return
        if self._one_launch(block_ids, src, range(n), store=False, non_blocking=non_blocking):
            return
        if src.device != self.device:
            src = src.to(self.device, non_blocking=non_blocking)
        self._by_layers(block_ids, self._records(src), range(len(block_ids)), store=False)

    def _scatter_on_host(self, block_ids: Sequence[int], src: torch.Tensor) -> bool:
        """`scatter` on a CPU engine from host rows of one engine block each (strided rows
        too), by numpy slice copies straight from `src`: `copy_rows` per segment without its
        per-call views and checks. False where it does not apply (another device or mode,
        several engine blocks a row, many short runs) and the general path copies."""
        if (
            self.device.type != "cpu"
            or src.device.type != "cpu"
            or self._copy_mode not in ("auto", "layers")
            or src.dtype != torch.uint8
            or src.dim() != 2
            or src.shape[1] != self.engine_block_bytes
            or (src.shape[0] > 1 and src.stride(1) != 1)
        ):
            return False
        rows = self._host_rows
        if rows is None:
            rows = self._host_rows = [(seg, _host_view(seg, self)) for seg in self.segments]
        n = src.shape[0]
        runs = paired_runs(block_ids, range(n))
        if len(runs) > FEW_RUNS and min(g.nbytes for g, _ in rows) * n < LOOP_MIN_BYTES * len(runs):
            return False
        check_runs(runs, self.num_blocks, n)
        host = src.numpy()
        for seg, dst in rows:
            at = seg.offset
            part = host[:, at : at + seg.nbytes].reshape(n, seg.chunks, seg.chunk_bytes)
            for d, s, k in runs:
                np.copyto(dst[d : d + k], part[s : s + k])
        return True

    def __repr__(self) -> str:
        return (
            f"KVLayout(device={self.device}, num_blocks={self.num_blocks}, "
            f"segments={len(self.segments)}, engine_block_bytes={self.engine_block_bytes}, "
            f"factor={self.factor})"
        )


def _host_view(seg: Segment, layout: KVLayout) -> np.ndarray:
    """A segment's rows as a uint8 numpy view `[num_blocks, chunks, chunk_bytes]` of the
    engine's memory (never a copy: writes through it must land in the engine)."""
    base = seg.rows.numpy()
    out = base.view(np.uint8).reshape(layout.num_blocks, seg.chunks, seg.chunk_bytes)
    if out.__array_interface__["data"][0] != base.__array_interface__["data"][0]:
        raise AssertionError("a segment's host view is not a view")
    return out
