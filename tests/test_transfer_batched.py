"""The one-launch copy (`tiercache.transfer.batched`): its copy list against KVLayout's byte
format, on every layout kind and block_size_factor, three ways:
- the CPU twin (the same (engine, record, bytes) triples, one memmove each) against the
  per-segment path, byte for byte, through KVLayout and through the copy handler;
- the Triton kernel itself under Triton's interpreter on CPU tensors (where Triton imports);
- on CUDA, every copy mode (direct into pinned memory, staged, layers) against the others.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.test_transfer_common import LAYOUTS, cuda_only, make_kv
from tiercache.tiers.cpu import CPUTier
from tiercache.transfer import GPULoadStoreSpec, TierLoadStoreSpec, batched, build_worker
from tiercache.transfer.kv_layout import KVLayout

NB = 16
ROOT = Path(__file__).resolve().parents[1]


def _ops(layout: KVLayout, caches: dict[str, torch.Tensor], pool: torch.Tensor) -> list[bytes]:
    """Stores, loads, gathers and scatters with scattered ids and slots; every byte after."""
    f = layout.factor
    n = 3
    ids = [(7 * i + 3) % NB for i in range(n * f)]  # scattered engine blocks
    slots = [5, 0, 3][:n]  # scattered slots, out of order
    layout.copy_to_pool(ids, pool, slots)
    layout.copy_from_pool(pool, [0, 5], [(5 * i + 1) % NB for i in range(2 * f)])
    dev = next(iter(caches.values())).device
    out = torch.zeros((2, layout.block_bytes), dtype=torch.uint8, device=dev)
    layout.gather([(3 * i + 2) % NB for i in range(2 * f)], out)
    layout.scatter([(11 * i + 4) % NB for i in range(2 * f)], out.flip(0).contiguous())
    if dev.type == "cuda":
        torch.cuda.synchronize()
    snap = [pool.cpu().numpy().tobytes(), out.cpu().numpy().tobytes()]
    snap += [t.cpu().contiguous().view(torch.uint8).numpy().tobytes() for t in caches.values()]
    return snap


def _run(kind: str, factor: int, mode: str, device: str = "cpu", pinned: bool = False):
    caches, kv_first = make_kv(kind, NB, device=device)
    layout = KVLayout(caches, NB, factor, kv_first=kv_first)
    layout.copy_mode = mode
    pool = torch.zeros((8, layout.block_bytes), dtype=torch.uint8, pin_memory=pinned)
    return _ops(layout, caches, pool)


@pytest.mark.parametrize("factor", [1, 2])
@pytest.mark.parametrize("kind", LAYOUTS)
def test_the_cpu_twin_writes_the_same_bytes_as_the_layer_path(kind: str, factor: int) -> None:
    assert _run(kind, factor, "direct") == _run(kind, factor, "layers")


def test_entries_are_the_chunks_of_each_block_in_record_order() -> None:
    # Two layers [2, NB, 4 int64] (K/V first): chunks of 32 bytes, 4 per engine block.
    caches = {f"l{i}": torch.zeros((2, NB, 4), dtype=torch.int64) for i in range(2)}
    layout = KVLayout(caches, NB, 2, kv_first=True)
    table = batched.ChunkTable(layout)
    assert table.chunks == 4 and table.wide and layout.engine_block_bytes == 128
    eng, rec, size = batched.entries(table, [9, 2], [3], row_base=1000, row_bytes=256)
    l0, l1 = (t.data_ptr() for t in caches.values())
    kv = NB * 32  # bytes between K and V of a layer
    assert eng.tolist() == [
        *(l0 + 9 * 32, l0 + kv + 9 * 32, l1 + 9 * 32, l1 + kv + 9 * 32),
        *(l0 + 2 * 32, l0 + kv + 2 * 32, l1 + 2 * 32, l1 + kv + 2 * 32),
    ]
    # Row 3 of the buffer: engine-block record 0 then 1, each K0 V0 K1 V1.
    assert rec.tolist() == [1000 + 3 * 256 + j * 128 + c * 32 for j in range(2) for c in range(4)]
    assert size.tolist() == [32] * 8
    with pytest.raises(ValueError, match="3 engine blocks for 1 rows"):
        batched.entries(table, [1, 2, 3], [0], 0, 256)


def test_the_twin_refuses_rows_and_block_ids_out_of_range() -> None:
    caches, kv_first = make_kv("kv_separate", NB)
    layout = KVLayout(caches, NB, kv_first=kv_first)
    layout.copy_mode = "direct"
    pool = torch.zeros((4, layout.block_bytes), dtype=torch.uint8)
    before = pool.clone()
    with pytest.raises(IndexError, match="rows"):
        layout.copy_to_pool([1], pool, [4])
    with pytest.raises(IndexError, match="engine block ids"):
        layout.copy_to_pool([NB], pool, [0])
    assert torch.equal(pool, before)


def test_copy_mode_is_checked() -> None:
    caches, kv_first = make_kv("separate", NB)
    layout = KVLayout(caches, NB, kv_first=kv_first)
    with pytest.raises(ValueError, match="copy_mode: 'fast' is not one of"):
        layout.copy_mode = "fast"
    assert layout.copy_mode == "auto"


def test_the_handler_runs_jobs_through_the_twin() -> None:
    """The worker and copy handler on the twin: a store then a load round-trip the bytes."""
    caches, kv_first = make_kv("kv_separate", NB)
    layout = KVLayout(caches, NB, kv_first=kv_first)
    layout.copy_mode = "direct"
    tier = CPUTier(block_bytes=layout.block_bytes, capacity_blocks=8)
    keys = [bytes([i]) * 16 for i in range(3)]
    want = [t[:, [1, 6, 9]].clone() for t in caches.values()]
    with build_worker(layout, [tier]) as w:
        assert w.transfer_async(
            0, (GPULoadStoreSpec([1, 6, 9]), TierLoadStoreSpec(0, "cpu", [2, 7, 4], keys))
        )
        w.wait([0])
        assert w.transfer_async(
            1, (TierLoadStoreSpec(0, "cpu", [2, 7, 4], keys), GPULoadStoreSpec([12, 13, 0]))
        )
        w.wait([1])
        assert all(r.success for r in w.get_finished())
    for t, w_ in zip(caches.values(), want, strict=True):
        assert torch.equal(t[:, [12, 13, 0]].view(torch.int16), w_.view(torch.int16))


_INTERPRETED = """
import json, sys
import torch
sys.path.insert(0, {root!r})
from tests.test_transfer_common import make_kv
from tests.test_transfer_batched import NB, _ops
from tiercache.transfer import batched
from tiercache.transfer.kv_layout import KVLayout

class Interpreted(KVLayout):
    # The kernel (interpreted) where the twin would run: same copy list, other executor;
    # ids as kernel arguments where a job is small enough (`inline`), else in a list.
    inline = False

    def _batched(self, block_ids, rows, buf, *, store, stream=None):
        if self._table is None:
            self._table = batched.ChunkTable(self)
        batched.run_interpreted(
            self._table, block_ids, rows, buf, self.block_bytes, store=store, inline=self.inline
        )

out = {{}}
for kind in {kinds!r}:
    for factor in (1, 2):
        for inline in (False, True):
            caches, kv_first = make_kv(kind, NB)
            layout = Interpreted(caches, NB, factor, kv_first=kv_first)
            layout.copy_mode = "direct"
            layout.inline = inline
            pool = torch.zeros((8, layout.block_bytes), dtype=torch.uint8)
            out[f"{{kind}}/{{factor}}/{{inline}}"] = [b.hex() for b in _ops(layout, caches, pool)]
print(json.dumps(out))
"""


@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="CUDA present: the kernel itself runs (test_every_cuda_copy_mode_writes_the_same_bytes)",
)
def test_the_kernel_under_tritons_interpreter_writes_the_layer_paths_bytes() -> None:
    pytest.importorskip("triton")
    kinds = ["kv_separate", "kv_shared", "odd_bytes"]
    code = textwrap.dedent(_INTERPRETED.format(root=str(ROOT), kinds=kinds))
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr[-3000:]
    import json

    got = json.loads(res.stdout.strip().splitlines()[-1])
    for kind in kinds:
        for factor in (1, 2):
            want = [b.hex() for b in _run(kind, factor, "layers")]
            for inline in (False, True):
                assert got[f"{kind}/{factor}/{inline}"] == want, (kind, factor, inline)


@cuda_only
@pytest.mark.parametrize("kind", LAYOUTS)
def test_every_cuda_copy_mode_writes_the_same_bytes(kind: str) -> None:
    if not batched.triton_available():
        pytest.skip("Triton is not installed: CUDA copies run by layers")
    want = _run(kind, 2, "layers", "cuda", pinned=True)
    for mode in ("direct", "staged", "auto"):
        assert _run(kind, 2, mode, "cuda", pinned=True) == want, mode
    # A pageable pool: the kernel cannot reach it; "direct" falls back to staging.
    assert _run(kind, 2, "direct", "cuda", pinned=False) == want


class _FakeLauncher:
    """Triton 3.6's launcher object: `__call__` allocates scratch memory, then `launch`."""

    global_scratch_size = profile_scratch_size = 0
    launch_cooperative_grid, launch_pdl = "coop", "pdl"

    def __init__(self, calls: list) -> None:
        self.calls = calls

    def launch(self, gx, gy, gz, stream, fn, coop, pdl, gscratch, pscratch, *rest):
        assert (coop, pdl, gscratch, pscratch) == ("coop", "pdl", None, None)
        self.calls.append(("launcher", (gx, gy, gz, stream, fn, *rest)))


class _FakeCompiled:
    """What Triton's `JITFunction.run` returns: a compiled kernel with its launcher (a plain
    callable, or 3.6's launcher object, which is then called past its `__call__`)."""

    function = "fn"
    packed_metadata = "meta"
    launcher_object = False

    def __init__(self, calls: list) -> None:
        self.calls = calls

    @property
    def run(self):
        if self.launcher_object:
            return _FakeLauncher(self.calls)
        return lambda *a: self.calls.append(("launcher", a))


class _FakeJIT:
    """`_kv_blocks_kernel` standing in for Triton: `[grid](*args)` records and compiles."""

    def __init__(self) -> None:
        self.calls: list = []
        self.compiled: list[_FakeCompiled] = []

    def __getitem__(self, grid):
        def run(*args):
            self.calls.append(("jit", grid, args))
            k = _FakeCompiled(self.calls)
            self.compiled.append(k)
            return k

        return run


class _Stream:
    cuda_stream = 0xBEEF


@pytest.mark.parametrize("launcher_object", [False, True])
def test_later_jobs_of_a_kind_launch_through_the_compiled_kernels_launcher(
    monkeypatch, launcher_object: bool
) -> None:
    """The launcher cache on the CPU: the first job of each kind goes through Triton's
    `JITFunction.run`; later ones of that kind call the kernel it returned, with the grid,
    the stream's handle and the same arguments; a job of another kind (inline or not,
    row_bytes, store or load, an address past 2**31 where one was below) compiles its own."""
    caches, kv_first = make_kv("kv_separate", NB)
    layout = KVLayout(caches, NB, kv_first=kv_first)
    table = batched.ChunkTable(layout)
    table.launchers.enabled = True
    fake = _FakeJIT()
    monkeypatch.setattr(_FakeCompiled, "launcher_object", launcher_object)
    monkeypatch.setattr(batched, "_kv_blocks_kernel", fake)
    monkeypatch.setattr(batched, "_no_launch_hooks", lambda: True)
    rb = layout.block_bytes

    def job(ids, rows, base=2**40, *, store=True, row_bytes=rb, fast=True):
        batched.launch(
            table,
            ids,
            rows,
            base,
            row_bytes,
            store=store,
            stream=_Stream(),
            fast=fast,
            idx_tensor=None if len(ids) <= 4 else torch.zeros(2),
        )

    monkeypatch.setattr(torch.cuda, "stream", lambda s: __import__("contextlib").nullcontext())
    job([1], [0])
    job([2, 3], [4, 5], 2**40 + 64)
    assert [c[0] for c in fake.calls] == ["jit", "launcher"]
    jit_args, (gx, gy, gz, handle, fn, meta, lm, enter, exit_, *args) = (
        fake.calls[0][2],
        fake.calls[1][1],
    )
    assert (gx, gz, handle, fn, meta, (lm, enter, exit_)) == (
        2 * table.chunks,
        1,
        0xBEEF,
        "fn",
        "meta",
        (None, None, None),
    )
    assert gy == fake.calls[0][1][1]
    assert len(args) == len(jit_args) and args[2] == 2 and args[5] == 2**40 + 64
    assert args[8:10] == [2, 3] and args[12:14] == [4, 5]
    assert table.launchers.launched == 1
    # Other kinds compile (here: go through run) once each, then reuse their own kernel.
    for kw in ({"store": False}, {"row_bytes": 2 * rb}, {"base": 4096}):
        n = len(fake.compiled)
        job([5], [1], **kw)
        job([6], [2], **kw)
        assert len(fake.compiled) == n + 1, kw
        assert fake.calls[-1][0] == "launcher", kw
    job(list(range(5)), [0] * 5)  # ids from a list: its own kind
    assert fake.calls[-1][0] == "jit"
    # fast=False always binds through run; launch hooks (a profiler) do too.
    job([1], [0], fast=False)
    assert fake.calls[-1][0] == "jit"
    monkeypatch.setattr(batched, "_no_launch_hooks", lambda: False)
    job([1], [0])
    assert fake.calls[-1][0] == "jit"


def test_the_launcher_cache_is_off_where_triton_differs(monkeypatch) -> None:
    """Only a Triton whose launcher interface was read (3.4 to 3.x) uses the cache."""
    if not batched.triton_available():
        assert not batched._launcher_interface()
        return
    for version, want in (("3.6.0", True), ("3.4.1", True), ("3.3.1", False), ("4.0.0", False)):
        monkeypatch.setattr(batched.triton, "__version__", version)
        assert batched._launcher_interface() is want, version


@cuda_only
@pytest.mark.parametrize("kind", LAYOUTS)
def test_launches_through_the_compiled_launcher_write_the_layer_paths_bytes(kind: str) -> None:
    """Every operation twice on one layout: the second round's launches reuse the kernels the
    first compiled (`Launchers`), and the bytes match the layer path's, pool pinned and on
    the device."""
    if not batched.triton_available():
        pytest.skip("Triton is not installed: CUDA copies run by layers")
    for pinned in (True, False):
        snaps = {}
        for mode in ("layers", "direct"):
            caches, kv_first = make_kv(kind, NB, device="cuda")
            layout = KVLayout(caches, NB, 2, kv_first=kv_first)
            layout.copy_mode = mode
            pool = torch.zeros((8, layout.block_bytes), dtype=torch.uint8, pin_memory=pinned)
            if not pinned:
                pool = pool.cuda()
            snaps[mode] = [_ops(layout, caches, pool) for _ in range(2)]
            if mode == "direct" and layout._table.launchers.enabled:
                assert layout._table.launchers.launched > 0
        assert snaps["direct"] == snaps["layers"], pinned
