"""One-launch block copies between the engine's paged KV buffer and rows of a record buffer.

A job of `n` engine blocks over a layout of `M` chunks (one chunk: one segment's K or V bytes
of one engine block) is `n * M` byte ranges. The per-segment path (`copy_rows`) issues a copy
per segment, with its own index tensor; here the whole job is one kernel launch over a table:

- `ChunkTable(layout)`: per chunk `m`, the four int64s of `layout.chunk_rows()`: the engine
  address of block 0's chunk, the bytes between engine blocks, the chunk's bytes, its offset
  inside an engine-block record.
  Built once per layout (the engine buffer never moves); on CUDA it lives on the device.
- `entries(table, block_ids, rows, ...)`: the job's `(engine address, record address, bytes)`
  triples, what the kernel computes in its programs: record `rows[i // factor]` of a buffer
  whose rows are `row_bytes` apart, engine-block record `i % factor` inside it. The CPU twin
  (`run_cpu`) copies exactly these triples; tests hold both against `KVLayout`'s byte format.
- `_kv_blocks_kernel`: the Triton kernel; one program per 1,024 words of a triple, 8-byte words
  where every address and size allows. Its index list (block ids, then rows) is read from
  pinned host memory through unified addressing: no upload, no extra copy, one launch.

The record buffer is a pool tier's tensor (rows = slots), a contiguous staging buffer (rows =
0..n-1), on the engine's device or pinned on the host, which the GPU reaches directly.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections import deque
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import torch

BLOCK = 1024  # words per program (a chunk of more has several programs)
INLINE_IDS = 4  # jobs of at most this many engine blocks pass their ids as kernel arguments

try:  # Triton comes with PyTorch's CUDA builds (and with vLLM); without it: the layer path.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


def triton_available() -> bool:
    """Whether the one-launch kernel can run (Triton imports)."""
    return triton is not None


class Chunks(Protocol):
    """What a `ChunkTable` is built from (`KVLayout` is one)."""

    engine_block_bytes: int
    factor: int
    device: torch.device

    def chunk_rows(self) -> list[tuple[int, int, int, int]]: ...


class ChunkTable:
    """The layout's chunks as an `[M, 4]` int64 table (engine base, block stride, bytes,
    record offset), on the host and, for a CUDA layout, on its device."""

    def __init__(self, layout: Chunks) -> None:
        rows = layout.chunk_rows()
        self.host = np.asarray(rows, dtype=np.int64).reshape(-1, 4)
        self.chunks = len(rows)
        self.max_bytes = int(self.host[:, 2].max())
        self.engine_block_bytes = layout.engine_block_bytes
        self.factor = layout.factor
        # 8-byte words where every engine address, stride, size and offset is a multiple of 8.
        self.wide = bool((self.host % 8 == 0).all()) and layout.engine_block_bytes % 8 == 0
        self.device = layout.device
        self.tensor = torch.from_numpy(self.host.copy()).reshape(-1).to(layout.device)
        # Pinned index lists of launched jobs, each with an event after its kernel: torch's
        # host allocator would hand a freed pinned block out again at once, while the GPU may
        # not have read it yet (it knows of copies, not of kernels reading host memory).
        self._held: deque[tuple[Any, torch.Tensor]] = deque()
        self._lock = threading.Lock()
        self.launchers = Launchers(self.device.index)

    def hold(self, idx: torch.Tensor, stream: Any = None) -> None:
        """Keep `idx` until what `stream` (default: the current stream) queued so far has run."""
        if stream is None:
            stream = torch.cuda.current_stream(self.device.index)
        ev = stream.record_event()
        with self._lock:  # lanes of one handler launch from several threads
            held = self._held
            while held and held[0][0].query():
                held.popleft()
            held.append((ev, idx))

    def check_job(self, n_ids: int, n_rows: int) -> int:
        """The block_size_factor, once `n_ids` engine blocks are checked to fill `n_rows`."""
        if n_ids != n_rows * self.factor:
            raise ValueError(
                f"block_ids: {n_ids} engine blocks for {n_rows} rows "
                f"(block_size_factor {self.factor})"
            )
        return self.factor


def entries(
    table: ChunkTable,
    block_ids: Sequence[int],
    rows: Sequence[int],
    row_base: int,
    row_bytes: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(engine addresses, record addresses, bytes) of every chunk of a job, block-major:
    the ranges the kernel copies, one program per entry."""
    f = table.check_job(len(block_ids), len(rows))
    ids = np.asarray(block_ids, dtype=np.int64)
    rws = np.asarray(rows, dtype=np.int64)
    i = np.arange(len(ids), dtype=np.int64)
    base, stride, size, roff = (table.host[:, k][None, :] for k in range(4))
    eng = base + ids[:, None] * stride
    rec = row_base + (rws[i // f] * row_bytes + (i % f) * table.engine_block_bytes)[:, None] + roff
    return eng.reshape(-1), rec.reshape(-1), np.broadcast_to(size, eng.shape).reshape(-1)


def run_cpu(
    table: ChunkTable,
    block_ids: Sequence[int],
    rows: Sequence[int],
    buf: torch.Tensor,
    row_bytes: int,
    *,
    store: bool,
    interpret: bool = False,
    inline: bool = False,
) -> None:
    """The CPU twin of the kernel: the same triples, one memmove each (engine and `buf` on
    the CPU). Stores copy engine -> record, loads record -> engine.

    `interpret` (`run_interpreted`): the kernel itself instead, under Triton's interpreter
    (`TRITON_INTERPRET=1` set before this module is imported): the tests' check of the
    kernel's address arithmetic, with the ids as arguments (`inline`, at most `INLINE_IDS`)
    or in a list."""
    if table.device.type != "cpu" or buf.device.type != "cpu":
        raise ValueError("run_cpu: the engine buffer and the record buffer must be on the CPU")
    if interpret:
        inline = inline and len(block_ids) <= INLINE_IDS
        idx = None if inline else torch.tensor([*block_ids, *rows], dtype=torch.int64)
        launch(table, block_ids, rows, buf.data_ptr(), row_bytes, store=store, idx_tensor=idx)
        return
    eng, rec, size = entries(table, block_ids, rows, buf.data_ptr(), row_bytes)
    src, dst = (eng, rec) if store else (rec, eng)
    for s, d, n in zip(src.tolist(), dst.tolist(), size.tolist(), strict=True):
        ctypes.memmove(d, s, n)


run_interpreted = functools.partial(run_cpu, interpret=True)


def launch(
    table: ChunkTable,
    block_ids: Sequence[int],
    rows: Sequence[int],
    row_base: int,
    row_bytes: int,
    *,
    store: bool,
    idx_tensor: torch.Tensor | None = None,
    stream: Any = None,
    fast: bool = True,
) -> None:
    """Queue the kernel on `stream` (a `torch.cuda.Stream`; default: the current stream), as
    any launch, asynchronously; the engine's device must be the current device.

    A job of at most `INLINE_IDS` engine blocks (a decode step's store) passes its ids as
    arguments; a larger one in one pinned int64 list (block ids, then rows) that the GPU reads
    through unified addressing: no host-to-device copy of its own either way.
    `idx_tensor`: a list of the caller's instead (the interpreter's, on the CPU).
    `fast`: launch through the compiled kernel's own launcher once Triton has compiled it for
    this job's kind (`Launchers`); False: always through Triton's `JITFunction.run`.
    """
    f = table.check_job(len(block_ids), len(rows))
    n_eng = len(block_ids)
    idx = idx_tensor
    if idx is None and n_eng > INLINE_IDS:
        idx = torch.tensor([*block_ids, *rows], dtype=torch.int64, pin_memory=True)
    if idx is None:
        pad = (0,) * (INLINE_IDS - n_eng)
        ids, rws = (*block_ids, *pad), (*rows, *(0,) * (INLINE_IDS - len(rows)))
    else:
        ids = rws = (0,) * INLINE_IDS
    wide = table.wide and row_base % 8 == 0 and row_bytes % 8 == 0  # 8-byte words: rows too
    words = table.max_bytes // 8 if wide else table.max_bytes
    ids_addr = 0 if idx is None else idx.data_ptr()
    grid = (n_eng * table.chunks, -(-words // BLOCK))
    args = (
        ids_addr,
        table.tensor,
        n_eng,
        f,
        table.chunks,
        row_base,
        row_bytes,
        table.engine_block_bytes,
        *ids,
        *rws,
        store,
        wide,
        idx is None,
        BLOCK,
    )
    launchers = table.launchers
    kind = (store, wide, idx is None, row_bytes, ids_addr >= _I32, row_base >= _I32)
    if not (fast and launchers.launch(kind, grid, stream, args)):
        if stream is None:
            kernel = _kv_blocks_kernel[grid](*args)
        else:
            with torch.cuda.stream(stream):
                kernel = _kv_blocks_kernel[grid](*args)
        if fast:
            launchers.learn(kind, kernel)
    if idx is not None and idx_tensor is None:
        table.hold(idx, stream)


_I32 = 2**31  # Triton passes an int below this as i32, from it as i64: part of a kernel's kind


class Launchers:
    """Compiled kernels by job kind, launched without Triton's per-call binding.

    `JITFunction.run` binds and specializes every argument on every call. The compiled kernel
    it returns depends only on what Triton specializes: the constexprs, the table (fixed per
    table), `row_bytes`, and the width Triton gives each unspecialized int (i32 below 2**31,
    else i64) — the job's `kind`. Later jobs of a kind call that kernel's launcher directly on
    the stream's handle, as `JITFunction.run` does, minus the binding. Used only where the
    Triton version has the launcher interface this was written against (3.4 to 3.x), each
    compiled kernel has the attributes it uses (checked by `learn`), and no launch hook is set
    (a profiler's: those go through `run`, which calls them).
    """

    def __init__(self, device_index: int | None) -> None:
        self._index = device_index
        self._kernels: dict[tuple[Any, ...], Any] = {}
        self.enabled = _launcher_interface()
        self.launched = 0  # launches through a compiled kernel's launcher (tests read it)

    def learn(self, kind: tuple[Any, ...], kernel: Any) -> None:
        """Remember what `JITFunction.run` returned for a job of `kind`."""
        if not (self.enabled and all(hasattr(kernel, a) for a in ("function", "packed_metadata"))):
            return
        run = kernel.run  # the launcher (a property: loads the module on first use)
        fn, meta = kernel.function, kernel.packed_metadata
        if (
            getattr(run, "global_scratch_size", 1) == 0
            and getattr(run, "profile_scratch_size", 1) == 0
        ):
            # The launcher object's __call__ only allocates scratch memory (none here) and
            # calls its compiled `launch`: call that, with what __call__ would add.
            coop, pdl = run.launch_cooperative_grid, run.launch_pdl
            self._kernels[kind] = (run.launch, (fn, coop, pdl, None, None, meta, None, None, None))
        else:
            self._kernels[kind] = (run, (fn, meta, None, None, None))

    def launch(
        self, kind: tuple[Any, ...], grid: tuple[int, int], stream: Any, args: tuple
    ) -> bool:
        """Launch a known kind's kernel on `stream` (None: the current stream); False when
        this kind is not compiled yet, or launch hooks are set."""
        k = self._kernels.get(kind)
        if k is None or not _no_launch_hooks():
            return False
        handle = (
            torch._C._cuda_getCurrentRawStream(self._index)
            if stream is None
            else stream.cuda_stream
        )
        fn, tail = k
        fn(grid[0], grid[1], 1, handle, *tail, *args)
        self.launched += 1
        return True


def _launcher_interface() -> bool:
    """Whether this Triton's compiled kernels take `run(gx, gy, gz, stream, function,
    packed_metadata, launch_metadata, enter_hook, exit_hook, *args)` (read in 3.6's
    `JITFunction.run`; the same from 3.4) and it has `knobs` to tell whether hooks are set."""
    if triton is None or not hasattr(triton, "knobs"):
        return False
    try:
        major, minor = (int(x) for x in triton.__version__.split(".")[:2])
    except ValueError:
        return False
    return (3, 4) <= (major, minor) < (4, 0)


def _no_launch_hooks() -> bool:
    rt = triton.knobs.runtime
    for h in (rt.launch_enter_hook, rt.launch_exit_hook):
        if h is not None and getattr(h, "calls", True):  # a HookChain with hooks, or a hook
            return False
    return True


_kv_blocks_kernel: Any = None
if triton is not None:
    # Addresses and counts change with every job: specializing on them (Triton's default for
    # ints: divisible by 16, equal to 1) would compile new variants while the engine serves.
    @triton.jit(
        do_not_specialize=[
            *("ids_addr", "n_eng", "row_base"),
            *("b0", "b1", "b2", "b3", "r0", "r1", "r2", "r3"),
        ]
    )
    def _kv_blocks_kernel(  # type: ignore[no-redef]
        ids_addr,
        tab_ptr,
        n_eng,
        factor,
        n_chunks,
        row_base,
        row_bytes,
        eng_bytes,
        b0,
        b1,
        b2,
        b3,
        r0,
        r1,
        r2,
        r3,
        STORE: tl.constexpr,
        WIDE: tl.constexpr,
        INLINE: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # Program (e, part): words part*BLOCK.. of chunk m of the job's engine block i.
        e = tl.program_id(0)
        part = tl.program_id(1)
        i = e // n_chunks
        m = e - i * n_chunks
        j = i // factor
        if INLINE:  # ids as arguments: b0..b3 are engine blocks 0..3, r0..r3 rows 0..3
            blk = tl.where(i == 0, b0, tl.where(i == 1, b1, tl.where(i == 2, b2, b3)))
            row = tl.where(j == 0, r0, tl.where(j == 1, r1, tl.where(j == 2, r2, r3)))
            blk = blk.to(tl.int64)
            row = row.to(tl.int64)
        else:
            ids = ids_addr.to(tl.pointer_type(tl.int64))
            blk = tl.load(ids + i)
            row = tl.load(ids + n_eng + j)
        base = tl.load(tab_ptr + m * 4)
        stride = tl.load(tab_ptr + m * 4 + 1)
        size = tl.load(tab_ptr + m * 4 + 2)
        roff = tl.load(tab_ptr + m * 4 + 3)
        eng = base + blk * stride
        rec = row_base + row * row_bytes + (i % factor).to(tl.int64) * eng_bytes + roff
        if STORE:
            src_a = eng
            dst_a = rec
        else:
            src_a = rec
            dst_a = eng
        if WIDE:
            src = src_a.to(tl.pointer_type(tl.int64))
            dst = dst_a.to(tl.pointer_type(tl.int64))
            n = size // 8
        else:
            src = src_a.to(tl.pointer_type(tl.uint8))
            dst = dst_a.to(tl.pointer_type(tl.uint8))
            n = size
        offs = part.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)
