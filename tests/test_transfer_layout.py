"""KVLayout: layout detection, shared allocations copied once, bytes per block, and the row
copy primitive against a plain Python model."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.test_transfer_common import LAYOUTS, make_kv
from tiercache.transfer import rows as row_copies
from tiercache.transfer.kv_layout import KVLayout
from tiercache.transfer.rows import copy_rows, paired_runs

NB = 16


@pytest.mark.parametrize(
    ("kind", "segments", "chunks"),
    [
        ("cross_layer", 1, 1),  # 4 layers in one allocation, a block is one run: one copy
        ("layers_outer", 1, 4),  # 4 layer chunks per block, one strided copy
        ("separate", 4, 1),
        ("kv_separate", 4, 2),  # K and V of each layer
        ("kv_shared", 1, 8),  # 4 layers x (K, V) in one allocation
        ("odd_bytes", 4, 1),
    ],
)
def test_segments_per_distinct_allocation(kind: str, segments: int, chunks: int) -> None:
    caches, kv_first = make_kv(kind, NB)
    layout = KVLayout(caches, NB, 2)
    assert len(layout.segments) == segments
    assert all(s.chunks == chunks for s in layout.segments)
    # Bytes per offloaded block: per-engine-block bytes of every layer, times the factor.
    per_block = sum((t[:, 0] if kv_first else t[0]).nbytes for t in caches.values())
    assert layout.engine_block_bytes == per_block
    assert layout.block_bytes == 2 * per_block
    assert layout.unit == (1 if kind == "odd_bytes" else 8)
    assert {n for s in layout.segments for n in s.layers} == set(caches)


def test_aliased_layers_are_copied_once() -> None:
    caches, _ = make_kv("separate", NB, layers=2)
    caches["layer.2"] = caches["layer.0"]  # a layer sharing another's KV cache
    layout = KVLayout(caches, NB)
    assert len(layout.segments) == 2
    assert layout.segments[0].layers == ("layer.0", "layer.2")


def test_explicit_and_ambiguous_kv_first() -> None:
    t = torch.zeros(2, 2, 4, dtype=torch.int64)  # [2 blocks, ...] or [K/V, 2 blocks, ...]
    with pytest.raises(ValueError, match="ambiguous"):
        KVLayout({"l": t}, 2)
    assert KVLayout({"l": t}, 2, kv_first=True).segments[0].chunks == 2  # K, then V
    assert KVLayout({"l": t}, 2, kv_first=False).engine_block_bytes == 64
    with pytest.raises(ValueError, match="is not"):
        KVLayout({"l": torch.zeros(3, 5)}, 4)
    with pytest.raises(ValueError, match="not contiguous"):
        KVLayout({"l": torch.zeros(4, 6, 8).transpose(1, 2)}, 4)
    with pytest.raises(ValueError, match="num_blocks"):
        KVLayout({"l": torch.zeros(4, 8)}, 0)
    with pytest.raises(ValueError, match="block_size_factor"):
        KVLayout({"l": torch.zeros(4, 8)}, 4, 0)
    with pytest.raises(ValueError, match="at least one layer"):
        KVLayout({}, 4)


@pytest.mark.parametrize("kind", LAYOUTS)
def test_gather_scatter_round_trip(kind: str) -> None:
    caches, kv_first = make_kv(kind, NB)
    layout = KVLayout(caches, NB, 2)
    ids = [9, 3, 4, 5, 0, 15]
    buf = torch.empty((3, layout.block_bytes), dtype=torch.uint8)
    layout.gather(ids, buf)
    before = {n: t.clone() for n, t in caches.items()}
    for t in caches.values():
        t.zero_()
    layout.scatter(ids, buf)
    for n, t in caches.items():
        sel = (lambda x: x[:, ids]) if kv_first else (lambda x: x[ids])
        assert torch.equal(sel(t).view(torch.uint8), sel(before[n]).view(torch.uint8))
        rest = [b for b in range(NB) if b not in ids]
        sel_rest = t[:, rest] if kv_first else t[rest]
        assert not sel_rest.view(torch.uint8).any()  # nothing else written


@pytest.mark.parametrize("kind", LAYOUTS)
@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize(
    "ids",
    [[9, 3, 4, 5, 0, 15], [0, 1, 2, 3, 4, 5, 6, 7], [14, 12, 10, 8, 6, 4, 2, 0], [7]],
)
def test_host_scatter_writes_what_the_general_path_writes(
    monkeypatch, kind: str, strided: bool, ids: list[int]
) -> None:
    """The CPU engine's scatter by numpy slices (`_scatter_on_host`, an NVMe load's sink) and
    the general path by `copy_rows` write the same bytes, and only into the blocks named: from
    contiguous rows and from strided ones (a read buffer's payload columns behind 64-byte
    headers, as `Tier.read_to` hands them over); many short runs fall back to `index_copy_`."""
    caches, _ = make_kv(kind, NB)
    layout = KVLayout(caches, NB)
    g = torch.Generator().manual_seed(len(ids) * 7 + strided)
    n, bb = len(ids), layout.block_bytes
    if strided:
        run = torch.randint(0, 256, (n, 64 + bb + 40), dtype=torch.uint8, generator=g)
        src = run[:, 64 : 64 + bb]
        assert src.stride(0) != bb
    else:
        src = torch.randint(0, 256, (n, bb), dtype=torch.uint8, generator=g)
    for t in caches.values():
        t.zero_()
    taken: list[bool] = []
    real = KVLayout._scatter_on_host

    def spy(self, block_ids, rows):
        taken.append(real(self, block_ids, rows))
        return taken[-1]

    monkeypatch.setattr(KVLayout, "_scatter_on_host", spy)
    layout.scatter(ids, src)
    fast = {k: t.clone() for k, t in caches.items()}
    assert taken == [
        len(paired_runs(ids, range(n))) <= row_copies.FEW_RUNS
        or n * min(s.nbytes for s in layout.segments)
        >= row_copies.LOOP_MIN_BYTES * len(paired_runs(ids, range(n)))
    ]
    monkeypatch.setattr(KVLayout, "_scatter_on_host", lambda self, block_ids, rows: False)
    for t in caches.values():
        t.zero_()
    layout.scatter(ids, src)
    for k, t in caches.items():
        assert torch.equal(fast[k].view(torch.uint8), t.view(torch.uint8)), k
    back = torch.empty((n, bb), dtype=torch.uint8)
    layout.gather(ids, back)
    assert torch.equal(back, src)


def test_host_scatter_refuses_block_ids_out_of_range() -> None:
    caches, _ = make_kv("separate", NB)
    layout = KVLayout(caches, NB)
    src = torch.ones((2, layout.block_bytes), dtype=torch.uint8)
    before = {k: t.clone() for k, t in caches.items()}
    with pytest.raises(IndexError, match="out of range"):
        layout.scatter([NB - 1, NB], src)
    with pytest.raises(IndexError, match="out of range"):
        layout.scatter([-1, 0], src)
    assert all(
        torch.equal(before[k].view(torch.uint8), t.view(torch.uint8)) for k, t in caches.items()
    )


def test_a_jobs_block_ids_are_indexed_once_for_every_segment(monkeypatch) -> None:
    """Every segment of a job copies the same block ids: their index tensor (on CUDA a
    host->device copy each) is made once, not once per layer (bench/bench_transfer.py --layers
    32 on an H100: store 0.66 -> 0.74 of pinned cudaMemcpy)."""
    caches, _ = make_kv("separate", NB)
    layout = KVLayout(caches, NB)
    assert len(layout.segments) == 4
    ids, slots = [9, 3, 14, 5, 0, 7], [5, 1, 3, 0, 4, 2]  # no runs: the index path
    pool = torch.randint(0, 255, (6, layout.block_bytes), dtype=torch.uint8)
    made: list[int] = []
    real = row_copies._index
    monkeypatch.setattr(
        row_copies, "_index", lambda idx, dev: made.append(len(idx)) or real(idx, dev)
    )
    layout.copy_from_pool(pool, slots, ids)
    assert len(made) == 2  # destination ids and source slots, once each
    made.clear()
    back = torch.zeros_like(pool)
    layout.copy_to_pool(ids, back, slots)
    assert len(made) == 2
    assert torch.equal(back, pool)  # and the bytes went where the ids say


def test_copy_rows_refuses_index_lists_of_unequal_length() -> None:
    with pytest.raises(ValueError, match="3 destination rows for 2 source rows"):
        copy_rows(torch.zeros(4, 8), [0, 1, 2], torch.zeros(4, 8), [0, 1])


def test_pool_shape_is_checked() -> None:
    caches, _ = make_kv("separate", NB)
    layout = KVLayout(caches, NB)
    with pytest.raises(ValueError, match="offloaded block"):
        layout.check_pool(torch.zeros(4, layout.block_bytes + 8, dtype=torch.uint8))
    with pytest.raises(ValueError, match="contiguous uint8"):
        layout.check_pool(torch.zeros(4, layout.block_bytes // 8, dtype=torch.int64))


def test_paired_runs() -> None:
    assert paired_runs([0, 1, 2, 7, 8, 3], [5, 6, 7, 1, 2, 9]) == [(0, 5, 3), (7, 1, 2), (3, 9, 1)]
    assert paired_runs([], []) == []


@settings(max_examples=120, deadline=None)
@given(
    n=st.integers(1, 40),
    row=st.sampled_from([1, 2, 3]),
    data=st.data(),
    loop_min=st.sampled_from([1, 64 * 1024]),
)
def test_copy_rows_matches_model(n: int, row: int, data, loop_min: int) -> None:
    # Every strategy (slice runs, index_select, index_copy_, both) against a Python loop.
    dst_rows, src_rows = 48, 48
    dst_idx = data.draw(st.lists(st.integers(0, dst_rows - 1), min_size=n, max_size=n, unique=True))
    src_idx = data.draw(
        st.one_of(
            st.lists(st.integers(0, src_rows - 1), min_size=n, max_size=n),
            st.integers(0, src_rows - n).map(lambda a: list(range(a, a + n))),
        )
    )
    if data.draw(st.booleans()):
        dst_idx = list(range(dst_idx[0] % (dst_rows - n + 1), dst_idx[0] % (dst_rows - n + 1) + n))
    src = torch.arange(src_rows * row * 2, dtype=torch.int64).view(src_rows, row, 2)
    dst = torch.full((dst_rows, row, 2), -1, dtype=torch.int64)
    want = dst.clone()
    for d, s in zip(dst_idx, src_idx, strict=True):
        want[d] = src[s]
    old = row_copies.LOOP_MIN_BYTES
    row_copies.LOOP_MIN_BYTES = loop_min
    try:
        copy_rows(dst, dst_idx, src, src_idx)
    finally:
        row_copies.LOOP_MIN_BYTES = old
    assert torch.equal(dst, want)


@pytest.mark.parametrize(
    "dst_idx",
    [list(range(40, 104)), [*range(0, 20), *range(50, 63), 90, *range(100, 130)], [7]],
)
def test_a_split_copy_writes_the_same_rows_as_one_thread(dst_idx: list[int]) -> None:
    """Large loads are halved between the caller and a helper thread (`split=True`); every
    row lands where the unsplit copy puts it, the cut falling inside a run or between runs."""
    from tiercache.transfer.rows import SPLIT_MIN_BYTES, halves

    row = SPLIT_MIN_BYTES // 32  # 64 rows of these: well past the split threshold
    src = torch.randint(0, 255, (80, 2, row // 2), dtype=torch.uint8)
    src_idx = list(range(3, 3 + len(dst_idx)))
    want = torch.zeros((140, 2, row // 2), dtype=torch.uint8)
    got = want.clone()
    copy_rows(want, dst_idx, src, src_idx)
    copy_rows(got, dst_idx, src, src_idx, split=True)
    assert torch.equal(got, want)
    runs = [(d, s, 1) for d, s in zip(dst_idx, src_idx, strict=True)]
    first, second = halves(runs)
    assert sorted(first + second) == sorted(runs) and len(first) == len(runs) // 2
    first, second = halves([(0, 0, 9), (20, 9, 4)])
    assert (first, second) == ([(0, 0, 6)], [(6, 6, 3), (20, 9, 4)])
