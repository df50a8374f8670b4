"""`TierCacheECConnector`: vLLM 0.32 encoder outputs (multimodal embeddings) kept in tiercache.

Loaded by vLLM with ``ec_transfer_config={"ec_connector": "TierCacheECConnector",
"ec_connector_module_path": "tiercache.connectors.vllm", "ec_role": "ec_both",
"ec_connector_extra_config": {"config": <mapping or TOML path>, "block_bytes": 262144}}``.

Primitives:
- `TierCacheECConnector(vllm_config, role)`: an `ECConnectorBase` (its scheduler side answers
  `has_cache_item` on 0.32, `has_caches` on older vLLM).
- `item_keys(namespace, mm_hash, n)`, `encode_item(tensor, block_bytes)`,
  `decode_item(blocks)`: an item is fixed-size blocks under keys ``xxh3_128(prefix,
  namespace, mm_hash, i)``; block 0 starts with a 64-byte header (magic, version, dtype name,
  shape, payload bytes), then the payload and zero padding. Nothing is pickled.

A header is only what some process wrote into a (possibly shared) store: its size is checked
against ``max_item_bytes`` and the store's capacity before any key is made, and a header that
fails a check is a counted miss (``ec_bad_headers``), dropped so the next save replaces it.
Once `has_cache_item` answers True vLLM will not run the encoder, so it reads and verifies the
whole item first and the tensor travels to the worker in the step's metadata: a corrupt item
is a miss, never garbage. Saves copy the output to host memory at once and write it to the
tiers on a background thread.
"""

from __future__ import annotations

import contextlib
import logging
import math
import queue
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
)
from xxhash import xxh3_128_digest

from tiercache.cache import TierCache
from tiercache.connectors.namespace import (
    derive_namespace,
    kv_settings_digest,
    read_user_config,
    resolve_config,
)
from tiercache.connectors.stores import acquire_store, release_store
from tiercache.connectors.vllm_logging import follow_vllm_logging
from tiercache.errors import ConfigError

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

HEADER_BYTES = 64
_MAGIC = b"TCEC"
_VERSION = 1
_MAX_DIMS = 4
# magic, version, ndim, dtype name (16 bytes, NUL padded), payload bytes, up to 4 dims.
_HEADER = struct.Struct("<4sHH16sQ4Q")
assert _HEADER.size <= HEADER_BYTES
_KEY_PREFIX = b"tiercache/vllm-encoder-output/v1\x00"
_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float64,
        torch.int8,
        torch.uint8,
        torch.int32,
        torch.int64,
    )
}
DEFAULT_BLOCK_BYTES = 256 * 1024
DEFAULT_STAGED_BYTES = 256 * 2**20
DEFAULT_MAX_ITEM_BYTES = 2**30  # the largest item saved or read (payload bytes; module doc)


def item_keys(namespace: str, mm_hash: str, n: int) -> list[bytes]:
    """The 16-byte tiercache keys of an item's `n` blocks."""
    base = _KEY_PREFIX + namespace.encode("utf-8") + b"\x00" + mm_hash.encode("utf-8") + b"\x00"
    return [xxh3_128_digest(base + i.to_bytes(4, "little")) for i in range(n)]


def _blocks_for(payload_bytes: int, block_bytes: int) -> int:
    return -(-(HEADER_BYTES + payload_bytes) // block_bytes)


def encode_item(tensor: torch.Tensor, block_bytes: int) -> torch.Tensor:
    """An encoder output as uint8 `[n, block_bytes]` blocks: header, payload, zero padding."""
    name = str(tensor.dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise TypeError(f"encoder output: dtype {tensor.dtype} is not supported")
    if tensor.dim() > _MAX_DIMS:
        raise ValueError(
            f"encoder output: at most {_MAX_DIMS} dims, got shape {tuple(tensor.shape)}"
        )
    flat = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    nbytes = flat.numel()
    dims = list(tensor.shape) + [0] * (_MAX_DIMS - tensor.dim())
    header = _HEADER.pack(_MAGIC, _VERSION, tensor.dim(), name.encode(), nbytes, *dims)
    n = _blocks_for(nbytes, block_bytes)
    out = torch.zeros(n * block_bytes, dtype=torch.uint8)
    out[: len(header)] = torch.frombuffer(bytearray(header), dtype=torch.uint8)
    out[HEADER_BYTES : HEADER_BYTES + nbytes] = flat
    return out.view(n, block_bytes)


def _read_header(block0: torch.Tensor) -> tuple[torch.dtype, tuple[int, ...], int]:
    """(dtype, shape, payload bytes) from block 0; ValueError if it is not an item header."""
    magic, version, ndim, name, nbytes, *dims = _HEADER.unpack(
        block0[: _HEADER.size].numpy().tobytes()
    )
    if magic != _MAGIC or version != _VERSION or ndim > _MAX_DIMS:
        raise ValueError("encoder item: bad header")
    dtype = _DTYPES.get(name.rstrip(b"\x00").decode("ascii", "replace"))
    shape = tuple(dims[:ndim])
    if dtype is None:
        raise ValueError(f"encoder item: unknown dtype {name!r}")
    if math.prod(shape) * dtype.itemsize != nbytes:
        raise ValueError(f"encoder item: shape {shape} does not match {nbytes} payload bytes")
    return dtype, shape, nbytes


def decode_item(blocks: torch.Tensor) -> torch.Tensor:
    """The tensor that `encode_item` laid out in `blocks` (uint8 `[n, block_bytes]`)."""
    dtype, shape, nbytes = _read_header(blocks[0])
    if _blocks_for(nbytes, blocks.shape[1]) != blocks.shape[0]:
        raise ValueError("encoder item: block count does not match the header")
    payload = blocks.reshape(-1)[HEADER_BYTES : HEADER_BYTES + nbytes].clone()
    return payload.view(dtype).reshape(shape)


@dataclass
class TierCacheECConnectorMetadata(ECConnectorMetadata):
    """What the worker loads this step: verified encoder outputs (host tensors) by mm_hash."""

    loads: dict[str, torch.Tensor] = field(default_factory=dict)


class TierCacheECConnector(ECConnectorBase):
    """An `ECConnectorBase` storing encoder outputs by `mm_hash` in tiercache's tiers."""

    def __init__(self, vllm_config: VllmConfig, role: ECConnectorRole) -> None:
        super().__init__(vllm_config=vllm_config, role=role)
        follow_vllm_logging()
        ec = vllm_config.ec_transfer_config
        assert ec is not None  # the base class raised otherwise
        extra = ec.ec_connector_extra_config or {}
        try:
            user = read_user_config(extra)
        except ConfigError as exc:  # name the field the user wrote
            where = exc.field.replace("kv_connector_extra_config", "ec_connector_extra_config")
            raise ConfigError(where, exc.problem) from None
        bb = _extra_int(extra, "block_bytes", DEFAULT_BLOCK_BYTES, HEADER_BYTES + 1)
        self._max_staged = _extra_int(extra, "max_staged_bytes", DEFAULT_STAGED_BYTES, 0)
        max_item = _extra_int(extra, "max_item_bytes", DEFAULT_MAX_ITEM_BYTES, 1)
        mc = vllm_config.model_config
        if mc is None:
            raise ValueError("vllm_config.model_config: required to name the encoder outputs")
        self.block_bytes = bb
        # The block size splits items: part of the key space. (The token block_size is unused.)
        config = resolve_config(
            user,
            block_size=user.get("block_size", 16),
            namespace=derive_namespace(
                model=str(mc.model),
                kv_dtype=str(mc.dtype).removeprefix("torch."),
                block_size=bb,
                layout="vllm-encoder-output/v1",
                settings=kv_settings_digest(vllm_config),
            ),
        )
        self.namespace = config.namespace
        self._store = acquire_store(config, bb)
        self._cache = self._store.cache
        # Sizes read from a store are bounded by `max_item_bytes` and by what every tier
        # together holds (an item is not split across requests).
        store_bytes = sum(t.capacity_blocks for t in self._cache.tiers) * bb - HEADER_BYTES
        self._max_item_bytes = max(0, min(max_item, store_bytes))
        # Scheduler side: verified items read by has_cache_item, waiting for their request to be
        # scheduled (mm_hash -> (tensor, step)), and this step's loads. Worker side: saves run
        # on one background thread.
        self._staged: OrderedDict[str, tuple[torch.Tensor, int]] = OrderedDict()
        self._staged_bytes = 0
        self._step = 0
        self._loads: dict[str, torch.Tensor] = {}
        self._saves: queue.Queue[tuple[str, torch.Tensor] | None] | None = None
        self._saver: threading.Thread | None = None
        self._closed = False

    @property
    def cache(self) -> TierCache:
        """The `TierCache` holding the encoder outputs (stats, tests)."""
        return self._cache

    # -- scheduler side --------------------------------------------------------------------
    def has_cache_item(self, identifier: str) -> bool:
        """Whether the item's encoder output is stored, complete and verified (it is read now,
        and handed to the worker when its request is scheduled)."""
        if not self.is_consumer:
            return False
        if identifier in self._staged:
            return True
        tensor = self._read(identifier)
        if tensor is None:
            return False
        self._stage(identifier, tensor)
        return True

    def has_caches(self, request: Request) -> list[bool]:
        """The older (seed) form of the check: one answer per multimodal item of `request`."""
        return [self.has_cache_item(f.identifier) for f in request.mm_features]

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        mm_hash = request.mm_features[index].identifier
        entry = self._staged.pop(mm_hash, None)
        if entry is not None:
            self._staged_bytes -= entry[0].nbytes
            self._loads[mm_hash] = entry[0]

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ECConnectorMetadata:
        meta = TierCacheECConnectorMetadata(self._loads)
        self._loads = {}
        self._step += 1
        return meta

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        # Saves copied their tensors to host memory in save_caches: nothing to wait for.
        return False, None

    # -- worker side -----------------------------------------------------------------------
    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, TierCacheECConnectorMetadata):
            raise TypeError(
                f"connector metadata: expected TierCacheECConnectorMetadata, got "
                f"{type(meta).__name__}"
            )
        device = _device()
        for mm_hash, tensor in meta.loads.items():
            if mm_hash not in encoder_cache:
                encoder_cache[mm_hash] = tensor.to(device, non_blocking=True)

    def save_caches(
        self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs: Any
    ) -> None:
        # Called only for items the encoder just ran on (a miss): store each of them.
        if not self.is_producer:
            return
        out = encoder_cache.get(mm_hash)
        if not isinstance(out, torch.Tensor):
            raise TypeError(
                f"encoder_cache[{mm_hash!r}]: expected a tensor, got {type(out).__name__}"
            )
        # The host copy is taken now: vLLM may free or reuse its entry once this returns.
        host = out.detach().to("cpu", copy=True)
        self._saver_queue().put((mm_hash, host))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, None

    def wait_for_saves(self) -> None:
        """Block until every queued save reached the tiers (tests, shutdown)."""
        if self._saves is not None:
            self._saves.join()

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._saves is not None and self._saver is not None:
            self._saves.put(None)
            self._saver.join()
        release_store(self._store)

    def _read(self, mm_hash: str) -> torch.Tensor | None:
        """The stored item, verified; None if missing, partial or corrupt (a miss)."""
        # One request: block 0 counts once (hit or miss), the rest once each after it.
        first = item_keys(self.namespace, mm_hash, 1)
        head = self._cache.get(first)
        if len(head) == 0:
            return None
        try:
            _, _, nbytes = _read_header(head[0])
            if nbytes > self._max_item_bytes:
                # Before any key is made: a forged size must not make ~10^15 keys.
                raise ValueError(
                    f"header claims {nbytes} payload bytes, more than max_item_bytes or the "
                    f"store allows ({self._max_item_bytes})"
                )
        except ValueError as exc:
            self._reject(mm_hash, first[0], exc)
            return None
        n = _blocks_for(nbytes, self.block_bytes)
        keys = item_keys(self.namespace, mm_hash, n)
        blocks = head
        if n > 1:
            rest = self._cache.get(keys[1:])
            if len(rest) < n - 1:
                return None
            blocks = torch.cat([head, rest])
        try:
            return decode_item(blocks)
        except ValueError as exc:
            self._reject(mm_hash, first[0], exc)
            return None

    def _reject(self, mm_hash: str, key0: bytes, why: Exception) -> None:
        """Block 0 of `mm_hash` passed its checksum but is no valid item header: a miss, an
        error of the tier holding it, and the block dropped so that the next save replaces it."""
        log.warning("encoder item %s: %s; encoding it again", mm_hash, why)
        manager = self._cache.manager
        with self._store.lock:
            where = manager.where(key0)
            manager.record_error(where[0] if where else 0)
            if where:
                # Pinned by a read right now (ValueError): the next miss drops it.
                with contextlib.suppress(ValueError):
                    manager.discard((key0,))
        self._store.count("ec_bad_headers")

    def _stage(self, mm_hash: str, tensor: torch.Tensor) -> None:
        self._staged[mm_hash] = (tensor, self._step)
        self._staged_bytes += tensor.nbytes
        # Drop the oldest items staged in earlier steps (their requests were not scheduled
        # yet; they will be read again); this step's must stay until update_state_after_alloc.
        while self._staged_bytes > self._max_staged and self._staged:
            old, (t, step) = next(iter(self._staged.items()))
            if step == self._step:
                break
            del self._staged[old]
            self._staged_bytes -= t.nbytes

    def _saver_queue(self) -> queue.Queue[tuple[str, torch.Tensor] | None]:
        if self._saves is None:
            self._saves = queue.Queue()
            self._saver = threading.Thread(
                target=self._save_loop, name="tiercache-ec-saver", daemon=True
            )
            self._saver.start()
        return self._saves

    def _save_loop(self) -> None:
        assert self._saves is not None
        while True:
            item = self._saves.get()
            try:
                if item is None:
                    return
                mm_hash, tensor = item
                if tensor.nbytes > self._max_item_bytes:  # it could never be read back
                    log.debug("encoder item %s: larger than max_item_bytes, not saved", mm_hash)
                    self._store.count("ec_items_too_large")
                    continue
                blocks = encode_item(tensor, self.block_bytes)
                keys = item_keys(self.namespace, mm_hash, blocks.shape[0])
                # Blocks of an earlier copy may still be held although the item was a miss
                # (e.g. its header block failed verification): put() would keep them, so read
                # each one first, which drops those that fail their checksum.
                for k in keys:  # a check, not a request: no hit or miss is counted
                    if self._cache.lookup((k,), count=False):
                        self._cache.get((k,), count=False)
                if self._cache.put(keys, blocks) < len(keys):
                    log.debug("encoder item %s: stored %s only in part", mm_hash, len(keys))
            except Exception:  # a save is best effort: the item is encoded again next time
                log.exception("saving an encoder output failed")
            finally:
                self._saves.task_done()


def _extra_int(extra: dict[str, Any], name: str, default: int, low: int) -> int:
    """``ec_connector_extra_config[name]`` (`default` if absent): an int >= `low`."""
    v = extra.get(name, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise ConfigError(
            f"ec_connector_extra_config.{name}", f"expected an int >= {low}, got {v!r}"
        )
    return v


def _device() -> torch.device:
    from vllm.platforms import current_platform

    kind = current_platform.device_type
    if kind == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(kind)
