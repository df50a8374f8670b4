"""The test router (`tests/kv_router.py`, issue 51) against vLLM's real event publisher.

- `test_router_*`: vLLM's own `ZmqEventPublisher` (the installed vLLM's encoding: 0.32 and
  0.33, see conftest.EVERY_VLLM) publishes `BlockStored`/`BlockRemoved`/`AllBlocksCleared`
  batches over ipc sockets; the router's held sets, scores, gap handling (replay), late
  subscribers and snapshots are checked against what was published. No engine: seconds.
- `test_vllm_serve_*`: one real ``vllm serve`` (no connector, prefix caching, KV events on
  ZMQ, PYTHONHASHSEED=0): the router's prediction for a request, from hashes computed by
  `vllm_block_hashes`, equals the tokens vLLM's prefix cache then serves it
  (``cached_tokens``): the router computes vLLM's real hashes.

Publishers here run in this process; the router never imports vLLM's event classes (it
decodes msgpack itself), so an agreement here is one between two independent decoders.
Waits are on conditions (`wait_seq`, `wait`), with generous timeouts only as a backstop."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

vllm = pytest.importorskip("vllm")
kv_events = pytest.importorskip("vllm.distributed.kv_events")
msgspec = pytest.importorskip("msgspec")  # vLLM's dependency, as zmq is

from tests.kv_router import (  # noqa: E402  (after the skip: it needs zmq and msgspec)
    Cleared,
    KVRouter,
    Removed,
    Stored,
    decode_batch,
    vllm_block_hashes,
)
from tests.openai_server_deps import skip_if_missing  # noqa: E402

AllBlocksCleared = kv_events.AllBlocksCleared
BlockRemoved = kv_events.BlockRemoved
BlockStored = kv_events.BlockStored
EventBatch = kv_events.EventBatch
KVEventBatch = kv_events.KVEventBatch
ZmqEventPublisher = kv_events.ZmqEventPublisher

WAIT = 30.0  # a backstop: every wait below returns as soon as its condition holds
BLOCK = 32


def stored(hashes: list[int], medium: str | None = "GPU", parent: int | None = None) -> Any:
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=list(range(4 * len(hashes))),
        block_size=4,
        lora_id=None,
        medium=medium,
        lora_name=None,
    )


def removed(hashes: list[int], medium: str | None = "GPU") -> Any:
    return BlockRemoved(block_hashes=hashes, medium=medium)


class Publishers:
    """vLLM publishers on ipc sockets under one folder: `add(name, buffer_steps)`,
    `publish(name, *events) -> seq`; `router(**kw)` subscribes to all of them."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.pubs: dict[str, Any] = {}
        self.seqs: dict[str, int] = {}

    def endpoint(self, name: str, kind: str) -> str:
        path = self.root / f"{name}.{kind}"
        assert len(str(path)) < 100, path  # ipc paths are limited to ~107 bytes
        return f"ipc://{path}"

    def add(self, name: str, buffer_steps: int = 10_000) -> None:
        self.pubs[name] = ZmqEventPublisher(
            data_parallel_rank=0,
            endpoint=self.endpoint(name, "pub"),
            replay_endpoint=self.endpoint(name, "replay"),
            buffer_steps=buffer_steps,
        )
        self.seqs[name] = -1

    def publish(self, name: str, *events: Any) -> int:
        self.pubs[name].publish(KVEventBatch(ts=time.time(), events=list(events)))
        self.seqs[name] += 1
        return self.seqs[name]

    def publish_raw(self, name: str, *events: Any) -> int:
        """Events as plain maps or arrays (msgpack encodes them as given): other shapes."""
        self.pubs[name].publish(EventBatch(ts=time.time(), events=list(events)))
        self.seqs[name] += 1
        return self.seqs[name]

    def router(self, replay: bool = True, **kw: Any) -> KVRouter:
        engines = {n: self.endpoint(n, "pub") for n in self.pubs}
        replays = {n: self.endpoint(n, "replay") for n in self.pubs} if replay else None
        return KVRouter(engines, replays, idle_replay_s=0.2, **kw)

    def close(self) -> None:
        for pub in self.pubs.values():
            pub.shutdown()


@pytest.fixture
def pubs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Publishers]:
    p = Publishers(tmp_path_factory.mktemp("kvr"))
    try:
        yield p
    finally:
        p.close()


def test_router_held_sets_and_prefix_scores_per_engine_and_medium(pubs: Publishers) -> None:
    pubs.add("a")
    pubs.add("b")
    with pubs.router() as router:
        # a: a chain 1-2-3-4 on GPU, 1-2 on CPU; b: 1 on GPU.
        pubs.publish("a", stored([1, 2, 3, 4]), stored([1, 2], "CPU"))
        pubs.publish("b", stored([1], None))  # medium None is vLLM's GPU
        # a: 3 leaves the GPU (and reaches the CPU); a separate chain 10-11.
        pubs.publish("a", removed([3]), stored([10, 11]))
        last = pubs.publish("a", stored([3], "CPU", parent=2))
        assert router.wait_seq("a", last, WAIT) and router.wait_seq("b", 0, WAIT)

        assert router.held("a") == {"GPU": {1, 2, 4, 10, 11}, "CPU": {1, 2, 3}}
        assert router.held("b") == {"GPU": {1}}
        # The longest prefix per medium: a's GPU breaks at 3, its CPU at 4.
        assert router.score([1, 2, 3, 4]) == {"a": {"GPU": 2, "CPU": 3}, "b": {"GPU": 1}}
        # A prefix, not a count: held blocks after a missing first one score nothing.
        assert router.score([99, 1, 2]) == {"a": {"GPU": 0, "CPU": 0}, "b": {"GPU": 0}}
        # Any of the mediums, block by block: 1, 2 (both), 3 (CPU), 4 (GPU).
        assert router.predicted_hit_blocks("a", [1, 2, 3, 4], ("GPU", "CPU")) == 4
        assert router.predicted_hit_blocks("a", [1, 2, 3, 4], ("GPU",)) == 2
        assert router.predicted_hit_blocks("a", [1, 2, 3, 4], ("STORAGE",)) == 0

        # AllBlocksCleared: a holds nothing, b is untouched.
        last = pubs.publish("a", AllBlocksCleared())
        assert router.wait_seq("a", last, WAIT)
        assert router.held("a") == {}
        assert router.score([1]) == {"a": {}, "b": {"GPU": 1}}
        st = router.stats("a")
        assert (st.last_seq, st.batches, st.missed, st.unknown_events) == (last, last + 1, 0, 0)


def test_router_a_gap_is_filled_by_replay(pubs: Publishers) -> None:
    pubs.add("a")
    with pubs.router() as witness, pubs.router() as router:
        s0 = pubs.publish("a", stored([1, 2]))
        assert router.wait_seq("a", s0, WAIT)
        # The router's connection drops; two batches go by while it is away. The witness
        # having them proves they were sent (replay buffers a batch only once it is sent).
        router.stop()
        pubs.publish("a", stored([3], parent=2))
        s2 = pubs.publish("a", removed([1]))
        assert witness.wait_seq("a", s2, WAIT)
        router.start()
        s3 = pubs.publish("a", stored([4], parent=3))
        assert router.wait_seq("a", s3, WAIT)
        assert router.held("a") == {"GPU": {2, 3, 4}} == witness.held("a")
        st = router.stats("a")
        # Batches 1 and 2 reached it only through the replay socket; nothing is missing.
        assert st.replayed >= 2 and st.missed == 0 and st.batches == 4, st


def test_router_a_gap_the_replay_buffer_no_longer_holds_is_counted(pubs: Publishers) -> None:
    pubs.add("a", buffer_steps=2)
    for h in range(5):  # seq 0..4; the publisher keeps only 3 and 4
        last = pubs.publish("a", stored([h]))
    with pubs.router() as witness:
        assert witness.wait_seq("a", last, WAIT)  # all five were sent
    with pubs.router() as late:
        assert late.wait_seq("a", last, WAIT)
        st = late.stats("a")
        assert (st.replayed, st.gaps, st.missed) == (2, 1, 3), st
        assert late.held("a") == {"GPU": {3, 4}}
    # Without a replay socket the late subscriber counts the gap at the next live batch.
    with pubs.router(replay=False) as no_replay:
        # Slow joiner: a batch may be lost until the subscription reaches the publisher;
        # publish until one arrives (each loss is one more sequence number missed).
        seq = pubs.publish("a", stored([100]))
        while not no_replay.wait_seq("a", seq, 0.5):
            seq = pubs.publish("a", stored([100]))
        st = no_replay.stats("a")
        assert st.gaps >= 1 and st.missed >= 5, st
        assert st.missed + st.batches == st.last_seq + 1, st
        assert no_replay.held("a") == {"GPU": {100}}


def test_router_an_engine_restart_starts_its_view_afresh(pubs: Publishers) -> None:
    pubs.add("a")
    with pubs.router() as router:
        pubs.publish("a", stored([1, 2]))
        last = pubs.publish("a", stored([3], parent=2))
        assert router.wait_seq("a", last, WAIT)
        # The engine restarts: a new publisher on the same sockets numbers from 0 again, and
        # what the old process held is gone. The router notices it live (a number not above
        # the last one received) or through replay (seq 1 is not the batch it applied as 1).
        pubs.pubs["a"].shutdown()
        pubs.add("a")
        pubs.publish("a", stored([7]))
        pubs.publish("a", stored([8], parent=7))
        pubs.publish("a", removed([7]))

        def fresh() -> bool:
            return router.stats("a").restarts == 1 and router.held("a") == {"GPU": {8}}

        assert router.wait(fresh, WAIT), (router.stats("a"), router.held("a"))
        st = router.stats("a")
        assert (st.last_seq, st.missed) == (2, 0), st


def test_router_a_restarted_router_equals_the_live_one(pubs: Publishers) -> None:
    pubs.add("a")
    pubs.add("b")
    with pubs.router() as live:
        rng = random.Random(5)
        for _ in range(20):  # stores, removals and a clear, both engines
            name = rng.choice("ab")
            hashes = rng.sample(range(40), 4)
            kind = rng.random()
            medium = rng.choice(["GPU", "CPU"])
            if kind < 0.6:
                pubs.publish(name, stored(hashes, medium))
            elif kind < 0.95:
                pubs.publish(name, removed(hashes, medium))
            else:
                pubs.publish(name, AllBlocksCleared())
        for name in "ab":
            assert live.wait_seq(name, pubs.seqs[name], WAIT)
        # A router started now rebuilds both views from the publishers' replay buffers.
        with pubs.router() as late:
            for name in "ab":
                assert late.wait_seq(name, pubs.seqs[name], WAIT)
                assert late.held(name) == live.held(name)
                assert late.stats(name).replayed == pubs.seqs[name] + 1
        # One restarted from the live router's snapshot: it asks replay only for what came
        # after the snapshot's sequence number.
        restored = pubs.router()
        for name in "ab":
            events, seq = live.snapshot(name)
            restored.load_snapshot(name, events, seq)
            assert restored.held(name) == live.held(name)
        with restored:
            last = pubs.publish("a", removed([1, 2, 3]), stored([7, 8], "CPU"))
            assert live.wait_seq("a", last, WAIT) and restored.wait_seq("a", last, WAIT)
            assert restored.held("a") == live.held("a")
            assert restored.held("b") == live.held("b")
            st = restored.stats("a")
            assert (st.batches, st.missed) == (1, 0), st


def test_router_decodes_vllm_033_and_other_event_shapes(pubs: Publishers) -> None:
    pubs.add("a")
    # 0.33's BlockStored has lookahead_token_ids; on 0.32 it goes out as a plain map.
    if "lookahead_token_ids" in BlockStored.__struct_fields__:
        ev033: Any = BlockStored(
            block_hashes=[1],
            parent_block_hash=None,
            token_ids=[5, 6, 7, 8],
            block_size=4,
            lora_id=None,
            medium="GPU",
            lora_name=None,
            lookahead_token_ids=[[9]],
        )
    else:
        ev033 = {
            "type": "BlockStored",
            "block_hashes": [1],
            "parent_block_hash": None,
            "token_ids": [5, 6, 7, 8],
            "block_size": 4,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
            "lookahead_token_ids": [[9]],
        }
    # tiercache's kind of event: a locality and a key no vLLM has.
    shared = {"type": "BlockStored", "block_hashes": [2], "parent_block_hash": 1}
    shared |= {"token_ids": [], "block_size": 4, "medium": "STORAGE", "locality": "SHARED"}
    shared["tiercache"] = {"store": "redis"}
    # The positional (array_like) form older publishers use, with two trailing fields more
    # than any vLLM has; and a kind of event this router does not know.
    array = ["BlockStored", [3], None, [1, 2, 3, 4], 4, None, "CPU", None, None, 0]
    array += [None, None, "LOCAL", None, None, [[1]], "newer-field"]
    removed_array = ["BlockRemoved", [3], "CPU", 0, "LOCAL", None, "newer-field"]
    with pubs.router() as router:
        s = pubs.publish_raw("a", ev033, shared, array, {"type": "BlockMoved", "x": 1})
        s = pubs.publish_raw("a", ["BlockStored", [4], 3, [], 4, None, "CPU", None])
        assert router.wait_seq("a", s, WAIT)
        assert router.held("a") == {"GPU": {1}, "STORAGE": {2}, "CPU": {3, 4}}
        assert router.stats("a").unknown_events == 1
        s = pubs.publish_raw("a", removed_array)
        assert router.wait_seq("a", s, WAIT)
        assert router.held("a")["CPU"] == {4}

    # The records carry what was read, the rest in `extra`.
    payload = msgspec.msgpack.encode(EventBatch(ts=1.0, events=[ev033, shared, array]))
    batch = decode_batch(payload)
    first, second, third = batch.events
    assert isinstance(first, Stored) and first.token_ids == (5, 6, 7, 8)
    assert first.extra["lookahead_token_ids"] == [[9]]
    assert isinstance(second, Stored) and second.locality == "SHARED"
    assert second.extra["tiercache"] == {"store": "redis"}
    assert isinstance(third, Stored) and third.locality == "LOCAL" and third.group_idx == 0
    assert third.extra["lookahead_token_ids"] == [[1]] and third.extra["#16"] == "newer-field"
    assert decode_batch(msgspec.msgpack.encode([0.0, [removed_array]])).events == (
        Removed((3,), "CPU", 0, "LOCAL", {"ownership": None, "#6": "newer-field"}),
    )
    cleared = msgspec.msgpack.encode([0.0, [{"type": "AllBlocksCleared"}]])
    assert decode_batch(cleared).events == (Cleared(),)


def test_router_block_hashes_follow_the_seed_algorithm_and_salt() -> None:
    tokens = list(range(3, 3 + 3 * BLOCK + 5))
    h = vllm_block_hashes(tokens, BLOCK, seed="0")
    assert len(h) == 3 and all(isinstance(x, int) and 0 <= x < 1 << 64 for x in h)
    assert vllm_block_hashes(tokens[: 2 * BLOCK], BLOCK, seed="0") == h[:2]  # a chain
    assert vllm_block_hashes(tokens, BLOCK, seed="1") != h
    assert vllm_block_hashes(tokens, BLOCK, seed="0", hash_algo="sha256_cbor") != h
    salted = vllm_block_hashes(tokens, BLOCK, seed="0", cache_salt="s")
    assert all(a != b for a, b in zip(salted, h, strict=True))  # the salt is in block 0
    raw = vllm_block_hashes(tokens, BLOCK, seed="0", as_int=False)
    assert [int.from_bytes(b, "big") & ((1 << 64) - 1) for b in raw] == h  # type: ignore[arg-type]


def test_vllm_serve_events_match_the_routers_hashes(
    server: ModuleType, tiny_llama: Path, tmp_path: Path
) -> None:
    skip_if_missing(module_level=False)  # vLLM 0.33's server needs orjson
    pub, rep = server.free_port(), server.free_port()
    events = {"enable_kv_cache_events": True, "publisher": "zmq"}
    events |= {"endpoint": f"tcp://*:{pub}", "replay_endpoint": f"tcp://*:{rep}"}
    rng = random.Random(51)
    a = [rng.randrange(3, 4096) for _ in range(10 * BLOCK + 10)]  # 10 full blocks
    b = a[: 2 * BLOCK] + [rng.randrange(3, 4096) for _ in range(3 * BLOCK + 1)]
    unseen = [rng.randrange(3, 4096) for _ in range(4 * BLOCK)]
    # Engine and router agree on NONE_HASH: the same seed (and vLLM's default sha256).
    ha, hb, hu = (vllm_block_hashes(p, BLOCK, seed="0") for p in (a, b, unseen))
    router = KVRouter({"e": f"tcp://127.0.0.1:{pub}"}, {"e": f"tcp://127.0.0.1:{rep}"})
    args = ["--kv-events-config", json.dumps(events)]
    env = {"PYTHONHASHSEED": "0"}
    with router, server.Server(tiny_llama, tmp_path / "server.log", args=args, env=env) as srv:
        srv.start()
        assert srv.complete(a, max_tokens=4)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

        def gpu(hashes: list[Any]) -> int:
            return router.score(hashes)["e"].get("GPU", 0)

        # vLLM's own events, hashed by vLLM: every full block of the prompt is on GPU.
        assert router.wait(lambda: gpu(ha) == 10, WAIT), router.stats("e")
        assert gpu(hu) == 0
        # The prediction for each next request is what vLLM's prefix cache serves it.
        for prompt, hashes, blocks in ((b, hb, 2), (a, ha, 10)):
            predicted = router.predicted_hit_blocks("e", hashes, ("GPU",))
            r = srv.complete(prompt, max_tokens=4)
            assert predicted == blocks
            assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == predicted * BLOCK
        assert router.wait(lambda: gpu(hb) == 5, WAIT)  # b's own blocks, stored as it ran
        st = router.stats("e")
        assert st.missed == 0 and st.unknown_events == 0, st
