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

    def _batched(self, block_ids, rows, buf, *, store):
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
