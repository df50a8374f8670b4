"""Belady's optimal offline policy (MIN with bypass) on a request trace: the hit-rate ceiling.

Primitives: `belady(requests, capacity) -> BeladyResult` and `next_uses(ids)`.

The trace is read as one stream of block accesses (each request's keys, head first). On a
miss the block is cached only if its next use comes sooner than the furthest next use among
the resident blocks (which is then evicted); a block never used again is not cached. This
maximises block hits over every policy that may decline to cache (MIN is optimal for unit-size
blocks), so no online policy's hits can exceed it.

Managers count *prefix* hits (the leading resident blocks of a request). Under MIN a block's
parent is always used before it in the same request, so the parent's next use is strictly
earlier and MIN evicts the child first: its cache stays prefix-closed and its prefix hits equal
its block hits up to the rare case of a never-reused parent. Both counts are reported.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

NEVER = 1 << 62  # next-use position of a block that is not accessed again


@dataclass(frozen=True)
class BeladyResult:
    """Hits of MIN on a trace: prefix hits (what managers count) and block hits."""

    capacity: int
    blocks: int
    prefix_hits: int
    block_hits: int

    @property
    def hit_rate(self) -> float:
        """Prefix hits over block accesses."""
        return self.prefix_hits / self.blocks if self.blocks else 0.0


def next_uses(ids: Sequence[int]) -> list[int]:
    """For each position, the position of the next access to the same id (NEVER if none)."""
    out = [NEVER] * len(ids)
    last: dict[int, int] = {}
    for i in range(len(ids) - 1, -1, -1):
        k = ids[i]
        out[i] = last.get(k, NEVER)
        last[k] = i
    return out


def belady(requests: Sequence[Sequence[bytes]], capacity: int) -> BeladyResult:
    """Replay `requests` under MIN with `capacity` blocks."""
    if capacity < 1:
        raise ValueError(f"capacity: expected >= 1 block, got {capacity}")
    intern: dict[bytes, int] = {}
    ids = [intern.setdefault(k, len(intern)) for r in requests for k in r]
    nxt = next_uses(ids)
    resident: dict[int, int] = {}  # id -> its current next use
    heap: list[tuple[int, int]] = []  # (-next use, id); stale entries skipped lazily
    push, pop = heapq.heappush, heapq.heappop
    pos = prefix_hits = block_hits = 0
    for r in requests:
        leading = True
        for _ in range(len(r)):
            k, nu = ids[pos], nxt[pos]
            pos += 1
            if k in resident:
                block_hits += 1
                prefix_hits += leading
                resident[k] = nu
                push(heap, (-nu, k))
                continue
            leading = False
            if nu == NEVER:
                continue  # bypass: caching it can never pay off
            if len(resident) >= capacity:
                while resident.get(heap[0][1]) != -heap[0][0]:
                    pop(heap)  # an outdated entry of a block since reused or evicted
                far, victim = heap[0]
                if -far <= nu:
                    continue  # every resident block is needed sooner: bypass
                pop(heap)
                del resident[victim]
            resident[k] = nu
            push(heap, (-nu, k))
    return BeladyResult(capacity, pos, prefix_hits, block_hits)
