"""Children of the demotion crash campaign (tests/test_campaign_demotion.py): processes that
store, promote and verify blocks through a `TierCache` whose first tier is full, logging
what they acknowledge and every event to a ledger log (tests/ledger.py).

- `facade_worker`: puts new chains and gets older blocks (promotions, which demote in turn)
  through the facade, until killed;
- `connector_worker`: stores through the KV connector's path: the manager's plan run by the
  transfer engine (`build_worker` over an engine buffer), moves and stores as jobs;
- `verify`: a fresh process gets each block and reports which came back exact or wrong.

A `kill_point` (tier index, method, n) makes the process SIGKILL itself right before the
n-th call of that tier's method (`write` into the lower tier: mid-demotion, its source
released and its destination not written), so the dangerous moments are hit every run, not
by chance. `wrong_order` puts back the bug the campaign exists for: a demoted block's
source slot freed (journaled) when the move is planned, not when it ends.
"""

from __future__ import annotations

import os
import random
import signal
from typing import Any

import numpy as np
import torch

from tests.campaign_support import blocks, key, key_id, payload
from tests.ledger import LogWriter


def _events(cache: Any) -> list[tuple[str, bool, list[int]]]:
    return [(e.medium, e.removed, [key_id(k) for k in e.keys]) for e in cache.take_events()]


def _open(
    config: dict, bb: int, log: str, kill_point: list | None = None, wrong_order: bool = False
) -> tuple[Any, LogWriter]:
    """The cache (armed with the kill point, the old order put back if asked) and its ledger
    log, with the open event (what the store recovered) logged."""
    from tiercache import TierCache

    cache = TierCache.open(config, block_bytes=bb)
    if wrong_order:
        for t in cache.tiers:
            t.release = t.free  # the source forgotten at plan time (the old order)
    if kill_point:
        tier, method, n = kill_point
        target = cache.tiers[tier]
        real = getattr(target, method)
        calls = [0]

        def hooked(*args: Any, **kw: Any) -> Any:
            calls[0] += 1
            if calls[0] == n:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(*args, **kw)

        setattr(target, method, hooked)
    w = LogWriter(log)
    w.call(events=_events(cache))
    return cache, w


def facade_worker(
    config: dict,
    bb: int,
    log: str,
    seed: int,
    first_id: int,
    old_ids: list[int],
    kill_point: list | None = None,
    wrong_order: bool = False,
) -> str:
    """Put chains of 1-4 new blocks; one call in four, get an older block (a promotion into
    the first tier, demoting another). Runs until killed."""
    cache, w = _open(config, bb, log, kill_point, wrong_order)
    rnd = random.Random(seed)
    nxt = first_id
    for _ in range(100_000):
        if old_ids and rnd.random() < 0.25:
            cache.get([key(rnd.choice(old_ids))])
            w.call(events=_events(cache))
            continue
        ids = list(range(nxt, nxt + rnd.randint(1, 4)))
        nxt += len(ids)
        held = cache.put([key(i) for i in ids], blocks(ids, bb))
        ev = _events(cache)
        stored = {i for _, removed, got in ev if not removed for i in got}
        w.call([i for i in ids if held == len(ids) or i in stored], ev)
    return "finished without being killed"


def connector_worker(
    config: dict,
    bb: int,
    log: str,
    seed: int,
    first_id: int,
    old_ids: list[int],
    kill_point: list | None = None,
    wrong_order: bool = False,
) -> str:
    """Store chains of 1-4 new blocks as the KV connector's worker does: the manager's plan
    (moves, then stores) submitted to the transfer engine as jobs, each completed on the
    manager when it finishes. Acknowledged: the blocks whose store completed. Runs until
    killed."""
    from tiercache.transfer import KVLayout, TierLoadStoreSpec, build_worker, store_transfers

    cache, w = _open(config, bb, log, kill_point, wrong_order)
    manager = cache.manager
    engine = torch.zeros((8, bb), dtype=torch.uint8)
    worker = build_worker(KVLayout({"layer.0": engine}, 8), cache.tiers)
    rnd = random.Random(seed)
    nxt, job = first_id, 0
    for _ in range(100_000):
        ids = list(range(nxt, nxt + rnd.randint(1, 4)))
        nxt += len(ids)
        keys = [key(i) for i in ids]
        engine[: len(ids)] = blocks(ids, bb)
        with cache.lock:
            manager.touch(keys)
            plan = manager.prepare_store(keys)
        if plan is None:
            continue
        jobs: dict[int, tuple[bytes, ...]] = {}
        for spec in store_transfers(plan, keys, list(range(len(ids)))):
            dst = spec[1]
            assert isinstance(dst, TierLoadStoreSpec)
            job += 1
            assert worker.transfer_async(job, spec)
            jobs[job] = dst.keys
        worker.wait(list(jobs))
        ok: list[bytes] = []
        with cache.lock:
            for r in worker.get_finished():
                done = jobs.pop(r.job_id)
                bad = set(r.failed) if r.success else set(range(len(done)))
                good = [k for i, k in enumerate(done) if i not in bad]
                manager.complete_store(good, success=True)
                manager.complete_store([done[i] for i in sorted(bad)], success=False)
                ok += good
        assert not jobs
        mine = set(keys)
        w.call([key_id(k) for k in ok if k in mine], _events(cache))
    return "finished without being killed"


def verify(config: dict, bb: int, log: str, ids: list[int]) -> dict[str, list[int]]:
    """Open the store in this fresh process and get each block alone (promotions and their
    demotions logged too): the ids read back exact, and those served with other bytes."""
    cache, w = _open(config, bb, log)
    exact: list[int] = []
    wrong: list[int] = []
    try:
        for i in ids:
            got = cache.get([key(i)])
            w.call(events=_events(cache))
            if len(got) == 1:
                same = np.array_equal(got[0].numpy(), payload(i, bb))
                (exact if same else wrong).append(i)
    finally:
        cache.close()
        w.close()
    return {"exact": exact, "wrong": wrong}
