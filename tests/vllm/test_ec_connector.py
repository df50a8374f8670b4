"""`TierCacheECConnector` against vLLM 0.32's real EC connector machinery.

No tiny multimodal model is built here: vLLM's multimodal processors need a tokenizer and an
image processor from a model hub. Instead the tests drive vLLM's own classes with real
tensors: `ECConnectorFactory` loads the connector by module path for both roles, real
`Request`s carry real `MultiModalFeatureSpec`s, the worker half runs inside vLLM's
`ECConnectorModelRunnerMixin` (the code path the model runner takes around the encoder), and
the tiers are real (CPU pool, LMDB and NVMe files). A second process plays "another instance
or a restart".
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

import torch
from vllm import SamplingParams
from vllm.config import ECTransferConfig, ModelConfig, VllmConfig
from vllm.distributed.ec_transfer import ec_transfer_state
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.request import Request
from vllm.v1.worker.ec_connector_model_runner_mixin import (
    ECConnectorModelRunnerMixin,
)

from tiercache.connectors.stores import store_snapshots
from tiercache.connectors.vllm_ec import (
    HEADER_BYTES,
    TierCacheECConnector,
    decode_item,
    encode_item,
    item_keys,
)

MODULE = "tiercache.connectors.vllm"  # the module vLLM loads; re-exports the connector
BLOCK_BYTES = 4096


def _vllm_config(model: Path, config: Any, role: str = "ec_both", **extra: Any) -> VllmConfig:
    ec = ECTransferConfig(
        ec_connector="TierCacheECConnector",
        ec_connector_module_path=MODULE,
        ec_role=role,
        ec_connector_extra_config={"config": config, "block_bytes": BLOCK_BYTES, **extra},
    )
    if role == "ec_producer":
        # VllmConfig refuses an encode-only instance without a multimodal model (it would
        # allocate no KV cache); the connector only reads the role, so set it afterwards.
        ec.ec_role = "ec_both"
    # bf16 stays here: these tests check bytes (encoder outputs saved and loaded back equal),
    # never a model's greedy outputs, which the end-to-end tests compare in fp32.
    mc = ModelConfig(model=str(model), skip_tokenizer_init=True, dtype="bfloat16")
    vc = VllmConfig(model_config=mc, ec_transfer_config=ec)
    vc.ec_transfer_config.ec_role = role
    return vc


def _request(req_id: str, *items: tuple[str, int]) -> Request:
    """A request whose prompt holds one image placeholder run per (mm_hash, embeds) item."""
    feats, pos = [], 1
    for mm_hash, n in items:
        feats.append(
            MultiModalFeatureSpec(
                data=None,
                modality="image",
                identifier=mm_hash,
                mm_position=PlaceholderRange(offset=pos, length=n),
            )
        )
        pos += n + 1
    return Request(req_id, [7] * (pos + 4), SamplingParams(max_tokens=4), None, mm_features=feats)


def _embeds(seed: int, rows: int, hidden: int = 128) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, hidden, generator=g).to(torch.bfloat16)


class Instance:
    """One vLLM instance's two connector halves, built by vLLM's factory, and the worker's
    encoder cache. `step()` is one engine step the way vLLM runs it."""

    def __init__(self, vllm_config: VllmConfig) -> None:
        self.scheduler = ECConnectorFactory.create_connector(vllm_config, ECConnectorRole.SCHEDULER)
        # The worker half is the process-global agent, as the model runner's mixin expects.
        ec_transfer_state.ensure_ec_transfer_initialized(vllm_config)
        self.worker = ec_transfer_state.get_ec_transfer()
        self.encoder_cache: dict[str, torch.Tensor] = {}
        self.encoded: list[str] = []

    def step(self, request: Request, encoder: dict[str, torch.Tensor]) -> None:
        """Schedule every item of `request` (load it when the connector has it, else encode it
        with `encoder`), then run the worker side and wait for its saves."""
        to_encode = []
        for i, f in enumerate(request.mm_features):
            if not self.scheduler.has_cache_item(f.identifier):
                to_encode.append(f.identifier)
            self.scheduler.update_state_after_alloc(request, i)
        out = SchedulerOutput.make_empty()
        out.ec_connector_metadata = self.scheduler.build_connector_meta(out)
        with ECConnectorModelRunnerMixin.maybe_get_ec_connector_output(
            out, encoder_cache=self.encoder_cache
        ) as ec_output:
            for mm_hash in to_encode:  # what _execute_mm_encoder does per encoded item
                self.encoded.append(mm_hash)
                self.encoder_cache[mm_hash] = encoder[mm_hash].clone()
                ECConnectorModelRunnerMixin.maybe_save_ec_to_connector(self.encoder_cache, mm_hash)
        assert ec_output is not None and ec_output.finished_sending is None
        self.worker.wait_for_saves()

    def close(self) -> None:
        ec_transfer_state.ensure_ec_transfer_shutdown()
        self.scheduler.shutdown()


@pytest.fixture
def instances():
    made: list[Instance] = []

    def make(vllm_config: VllmConfig) -> Instance:
        inst = Instance(vllm_config)
        made.append(inst)
        return inst

    yield make
    for inst in made:
        inst.close()


def test_factory_loads_both_roles_over_one_cache(tiny_llama: Path, instances) -> None:
    inst = instances(_vllm_config(tiny_llama, {"tiers": [{"kind": "cpu", "capacity": "1MiB"}]}))
    assert isinstance(inst.scheduler, TierCacheECConnector)
    assert isinstance(inst.worker, TierCacheECConnector)
    assert inst.scheduler.role is ECConnectorRole.SCHEDULER
    assert inst.worker.role is ECConnectorRole.WORKER
    # One store per process: both halves see the same blocks.
    assert inst.scheduler.cache is inst.worker.cache


def test_an_image_seen_once_is_loaded_not_encoded(tiny_llama: Path, instances) -> None:
    inst = instances(_vllm_config(tiny_llama, {"tiers": [{"kind": "cpu", "capacity": "1MiB"}]}))
    encoder = {"img-a": _embeds(1, 40), "img-b": _embeds(2, 3)}
    # Step 1: both images are new, so they are encoded (and saved).
    inst.step(_request("r1", ("img-a", 40), ("img-b", 3)), encoder)
    assert inst.encoded == ["img-a", "img-b"]
    # img-a spans several 4 KiB blocks (40 x 128 bf16 = 10 KiB), img-b fits in one.
    assert inst.scheduler.cache.stats()["cpu"]["ready_blocks"] == 3 + 1
    # Step 2: a new request with the same images, on a worker whose encoder cache was freed.
    inst.encoder_cache.clear()
    inst.step(_request("r2", ("img-b", 3), ("img-a", 40)), encoder)
    assert inst.encoded == ["img-a", "img-b"]  # not encoded again
    for mm_hash, expected in encoder.items():
        got = inst.encoder_cache[mm_hash]
        assert got.dtype == torch.bfloat16 and torch.equal(got, expected)


def test_counters_count_each_block_once(tiny_llama: Path, instances) -> None:
    """Issue 14: block 0 of a hit was counted three times, and every save counted misses."""
    inst = instances(_vllm_config(tiny_llama, {"tiers": [{"kind": "cpu", "capacity": "1MiB"}]}))
    encoder = {"img-a": _embeds(1, 40), "img-b": _embeds(2, 3)}  # 3 blocks and 1 block

    def counts() -> tuple[int, int]:
        s = inst.scheduler.cache.stats()["cpu"]
        return s["hits"], s["misses"]

    inst.step(_request("r1", ("img-a", 40), ("img-b", 3)), encoder)
    assert counts() == (0, 2)  # two items asked for: block 0 of each missed; saves count none
    inst.encoder_cache.clear()
    inst.step(_request("r2", ("img-b", 3), ("img-a", 40)), encoder)
    assert counts() == (4, 2)  # every block of both items hit once


def _forge(inst: Instance, mm_hash: str, nbytes: int, *dims: int) -> None:
    """Store a checksum-valid block 0 for `mm_hash` whose header claims a bf16 item of shape
    `dims` and `nbytes` payload bytes (what any process sharing the store could write)."""
    from tiercache.connectors.vllm_ec import _HEADER, _MAGIC, _MAX_DIMS, _VERSION, item_keys

    cache = inst.scheduler.cache
    padded = list(dims) + [0] * (_MAX_DIMS - len(dims))
    header = _HEADER.pack(_MAGIC, _VERSION, len(dims), b"bfloat16", nbytes, *padded)
    block = torch.zeros((1, cache.block_bytes), dtype=torch.uint8)
    block[0, : len(header)] = torch.frombuffer(bytearray(header), dtype=torch.uint8)
    assert cache.put(item_keys(inst.scheduler.namespace, mm_hash, 1), block) == 1


def _counter(inst: Instance, name: str) -> int:
    return store_snapshots()[inst.scheduler.namespace]["counters"].get(name, 0)


def test_a_forged_item_size_is_a_counted_miss(tiny_llama: Path, instances, tmp_path) -> None:
    """A checksum-valid header in a shared store claiming a huge item: a miss and a counted
    error, never ~10^15 keys."""
    cfg = {"tiers": [{"kind": "lmdb", "path": str(tmp_path / "ec"), "capacity": "4MiB"}]}
    inst = instances(_vllm_config(tiny_llama, cfg))
    _forge(inst, "img-forged", 2**61, 2**40, 2**20)
    t0 = time.monotonic()
    assert not inst.scheduler.has_cache_item("img-forged")
    assert time.monotonic() - t0 < 5
    assert inst.scheduler.cache.stats()["lmdb"]["errors"] == 1


def test_item_sizes_are_bounded_by_max_item_bytes_and_a_bad_header_is_replaced(
    tiny_llama: Path, instances, tmp_path
) -> None:
    """Issue 14, item 6: a size read from a store is checked against `max_item_bytes`, not
    only against what the store could hold (a 4 TiB LMDB tier would still allow ~10^7 keys of
    lookups per check). A violation is a miss and a counted error, and the bad block 0 is
    dropped so that the item's next save stores it again (a save keeps blocks it finds held,
    so the forged header used to make the item uncacheable for good)."""
    cfg = {"tiers": [{"kind": "lmdb", "path": str(tmp_path / "ec"), "capacity": "4MiB"}]}
    inst = instances(_vllm_config(tiny_llama, cfg, max_item_bytes=64 * 1024))
    lmdb = lambda: inst.scheduler.cache.stats()["lmdb"]  # noqa: E731
    # 1 MiB: within the 4 MiB store, past the 64 KiB bound.
    _forge(inst, "img", 2**20, 512, 1024)
    assert not inst.scheduler.has_cache_item("img")
    assert lmdb()["errors"] == 1 and _counter(inst, "ec_bad_headers") == 1
    assert lmdb()["ready_blocks"] == 0  # the forged block is gone
    # The image is encoded and saved again, then loads.
    encoder = {"img": _embeds(8, 40)}  # 10 KiB: 3 blocks
    inst.step(_request("r1", ("img", 40)), encoder)
    inst.encoder_cache.clear()
    inst.step(_request("r2", ("img", 40)), encoder)
    assert inst.encoded == ["img"]
    assert torch.equal(inst.encoder_cache["img"], encoder["img"])
    assert lmdb()["errors"] == 1 and _counter(inst, "ec_bad_headers") == 1


def test_an_item_larger_than_max_item_bytes_is_not_saved(tiny_llama: Path, instances) -> None:
    """It could never be read back (the read refuses its size): saving it is refused too."""
    cfg = {"tiers": [{"kind": "cpu", "capacity": "1MiB"}]}
    inst = instances(_vllm_config(tiny_llama, cfg, max_item_bytes=8 * 1024))
    encoder = {"big": _embeds(9, 40), "small": _embeds(10, 3)}  # 10 KiB and 768 B
    inst.step(_request("r1", ("big", 40), ("small", 3)), encoder)
    assert inst.scheduler.cache.stats()["cpu"]["ready_blocks"] == 1  # "small" only
    assert _counter(inst, "ec_items_too_large") == 1
    inst.encoder_cache.clear()
    inst.step(_request("r2", ("big", 40), ("small", 3)), encoder)
    assert inst.encoded == ["big", "small", "big"]
    with pytest.raises(ValueError, match="max_item_bytes"):
        TierCacheECConnector(
            _vllm_config(tiny_llama, cfg, max_item_bytes=0), ECConnectorRole.SCHEDULER
        )


def test_a_save_is_not_a_use_and_a_hit_is_one(tiny_llama: Path, instances) -> None:
    """Issue 14, item 1, through the EC connector: an item saved once sits in ARC's recency
    list (T1); loading it is its first use (T2). The save used to touch what it had just
    stored, so every saved item went straight to T2 and ARC behaved as LRU."""
    cfg = {"tiers": [{"kind": "cpu", "capacity": "1MiB", "policy": "arc"}]}
    inst = instances(_vllm_config(tiny_llama, cfg))
    arc = inst.scheduler.cache.manager.policies[0]
    encoder = {"img-a": _embeds(1, 40)}  # 3 blocks
    inst.step(_request("r1", ("img-a", 40)), encoder)
    keys = set(item_keys(inst.scheduler.namespace, "img-a", 3))
    assert (set(arc.state().t1), set(arc.state().t2)) == (keys, set())
    inst.encoder_cache.clear()
    inst.step(_request("r2", ("img-a", 40)), encoder)
    assert inst.encoded == ["img-a"]
    assert (set(arc.state().t1), set(arc.state().t2)) == (set(), keys)


def test_seed_has_caches_answers_per_item(tiny_llama: Path, instances) -> None:
    inst = instances(_vllm_config(tiny_llama, {"tiers": [{"kind": "cpu", "capacity": "1MiB"}]}))
    inst.step(_request("r1", ("seen", 5)), {"seen": _embeds(3, 5)})
    req = _request("r2", ("unseen", 5), ("seen", 5))
    assert inst.scheduler.has_caches(req) == [False, True]


def test_roles_producer_saves_only_consumer_loads_only(tiny_llama: Path, instances) -> None:
    cfg = {"tiers": [{"kind": "cpu", "capacity": "1MiB"}]}
    producer = instances(_vllm_config(tiny_llama, cfg, role="ec_producer"))
    producer.step(_request("r1", ("img", 8)), {"img": _embeds(4, 8)})
    producer.encoder_cache.clear()
    producer.step(_request("r2", ("img", 8)), {"img": _embeds(4, 8)})
    # A producer does not load (it has no consumer side): it encodes again.
    assert producer.encoded == ["img", "img"]
    assert producer.scheduler.cache.stats()["cpu"]["ready_blocks"] == 1
    producer.close()
    consumer = instances(_vllm_config(tiny_llama, cfg, role="ec_consumer"))
    consumer.step(_request("r3", ("other", 8)), {"other": _embeds(5, 8)})
    assert consumer.scheduler.cache.stats()["cpu"]["ready_blocks"] == 0  # nothing saved


_PRODUCER = textwrap.dedent(
    """
    import json, sys, torch
    from vllm.config import ECTransferConfig, ModelConfig, VllmConfig
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory
    args = json.loads(sys.argv[1])
    ec = ECTransferConfig(ec_connector="TierCacheECConnector",
        ec_connector_module_path=args["module"], ec_role="ec_both",
        ec_connector_extra_config={"config": args["config"], "block_bytes": args["block_bytes"]})
    mc = ModelConfig(model=args["model"], skip_tokenizer_init=True, dtype="bfloat16")
    worker = ECConnectorFactory.create_connector(
        VllmConfig(model_config=mc, ec_transfer_config=ec), ECConnectorRole.WORKER)
    g = torch.Generator().manual_seed(args["seed"])
    out = torch.randn(args["rows"], 128, generator=g).to(torch.bfloat16)
    worker.save_caches({args["mm_hash"]: out}, args["mm_hash"])
    worker.shutdown()  # waits for the save, closes the store
    """
)


def test_encoded_by_another_process_is_not_encoded_again(
    tiny_llama: Path, tmp_path: Path, instances
) -> None:
    config = {
        "tiers": [
            {"kind": "cpu", "capacity": "64KiB"},
            {"kind": "lmdb", "path": str(tmp_path / "ec.lmdb"), "capacity": "4MiB"},
        ]
    }
    args = {
        "module": MODULE,
        "config": config,
        "block_bytes": BLOCK_BYTES,
        "model": str(tiny_llama),
        "mm_hash": "img-shared",
        "seed": 11,
        "rows": 33,
    }
    # Another instance (a separate process, since exited: also a restart) encodes the image.
    proc = subprocess.run(
        [sys.executable, "-c", _PRODUCER, json.dumps(args)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    inst = instances(_vllm_config(tiny_llama, config))
    inst.step(_request("r1", ("img-shared", 33)), {"img-shared": _embeds(99, 33)})
    assert inst.encoded == []  # loaded from the persistent tier
    assert torch.equal(inst.encoder_cache["img-shared"], _embeds(11, 33))


def test_corrupt_item_is_encoded_again_and_counted(
    tiny_llama: Path, tmp_path: Path, instances
) -> None:
    nvme = tmp_path / "ec-nvme"
    config = {"tiers": [{"kind": "nvme", "path": str(nvme), "capacity": "1MiB"}]}
    encoder = {"img": _embeds(6, 40)}  # 3 blocks
    first = instances(_vllm_config(tiny_llama, config))
    first.step(_request("r1", ("img", 40)), encoder)
    first.close()  # flushes and closes the slab
    # Flip one payload byte of every slot (the slab: slot i at i * slot_bytes, 64-byte header).
    meta = json.loads((nvme / "meta.json").read_text())
    slab = bytearray((nvme / "slab").read_bytes())
    for i in range(meta["capacity_blocks"]):
        slab[i * meta["slot_bytes"] + 64 + 100] ^= 0xFF
    (nvme / "slab").write_bytes(slab)
    second = instances(_vllm_config(tiny_llama, config))
    second.step(_request("r2", ("img", 40)), encoder)
    assert second.encoded == ["img"]  # a miss, not garbage
    stats = second.scheduler.cache.stats()["nvme"]
    assert stats["errors"] >= 1
    # It was stored again and now loads.
    second.encoder_cache.clear()
    second.step(_request("r3", ("img", 40)), encoder)
    assert second.encoded == ["img"]
    assert torch.equal(second.encoder_cache["img"], encoder["img"])


@pytest.mark.parametrize(
    "tensor",
    [
        torch.arange(12, dtype=torch.float32).reshape(3, 4),
        torch.randn(17, 5).to(torch.bfloat16),
        torch.randint(0, 255, (2, 3, 700), dtype=torch.uint8),
        torch.zeros(0, 8, dtype=torch.float16),
    ],
)
def test_item_layout_round_trips(tensor: torch.Tensor) -> None:
    blocks = encode_item(tensor, 512)
    assert blocks.dtype == torch.uint8 and blocks.shape[1] == 512
    assert blocks.shape[0] == -(-(HEADER_BYTES + tensor.numel() * tensor.element_size()) // 512)
    out = decode_item(blocks)
    assert out.dtype == tensor.dtype and out.shape == tensor.shape and torch.equal(out, tensor)


def test_item_layout_rejects_bad_bytes() -> None:
    blocks = encode_item(torch.ones(4, 4), 256)
    bad = blocks.clone()
    bad[0, 0] ^= 0xFF
    with pytest.raises(ValueError, match="bad header"):
        decode_item(bad)
    with pytest.raises(ValueError, match="block count"):
        decode_item(torch.cat([blocks, blocks]))
    with pytest.raises(TypeError, match="not supported"):
        encode_item(torch.ones(2, dtype=torch.complex64), 256)


def test_bad_config_is_a_clear_error(tiny_llama: Path) -> None:
    with pytest.raises(ValueError, match=r"ec_connector_extra_config\.config"):
        TierCacheECConnector(_vllm_config(tiny_llama, None), ECConnectorRole.SCHEDULER)
    cfg = {"tiers": [{"kind": "cpu", "capacity": "1MiB"}]}
    with pytest.raises(ValueError, match="block_bytes"):
        TierCacheECConnector(
            _vllm_config(tiny_llama, cfg, block_bytes=16), ECConnectorRole.SCHEDULER
        )
    with pytest.raises(ValueError, match=r"tiers\[0\].capacity"):
        TierCacheECConnector(
            _vllm_config(tiny_llama, {"tiers": [{"kind": "cpu", "capacity": "lots"}]}),
            ECConnectorRole.SCHEDULER,
        )
