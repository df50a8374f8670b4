"""A KV-aware router for the tests: subscribes to vLLM's KV events over ZMQ and scores a request
the way llm-d's precise prefix scorer does (issue 51).

It decodes the wire format itself, as a router in another language would, and never imports
vLLM's event classes:

- a ZMQ PUB stream of multipart messages ``(topic, seq, payload)``: ``seq`` is an 8-byte
  big-endian sequence number counting from 0 per publisher, ``payload`` a msgpack
  ``KVEventBatch`` array ``[ts, [events], data_parallel_rank]``;
- each event a msgpack map tagged ``{"type": "BlockStored", "block_hashes": [...], ...}``
  (vLLM 0.32 and 0.33: msgspec ``tag=True``, not ``array_like``) or, from older publishers,
  a positional array ``["BlockStored", block_hashes, parent_block_hash, token_ids, ...]``.
  Fields a version adds (0.33's ``lookahead_token_ids``, tiercache's ``locality``, any other
  key or trailing element) are kept in ``extra`` and otherwise ignored;
- block hashes are msgpack ints (vLLM's default, ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``:
  the low 64 bits of the hash) or bytes; a ``medium`` of None means ``"GPU"``;
- the replay socket (vLLM's ``replay_endpoint``, a ROUTER): a DEALER sends ``(b"", seq)`` and
  gets ``(b"", topic, seq, payload)`` for every buffered batch from ``seq`` on, then the end
  marker ``(b"", b"", seq -1, b"")``.

Primitives:
- `KVRouter(engines, replay=None)`: engine name -> PUB endpoint (and replay endpoint); a
  background thread (`start`/`stop`, or ``with``) keeps, per engine and medium, the block
  hashes held. `held`, `score`, `predicted_hit_blocks`, `last_seq`, `stats`, `wait_seq`,
  `wait`, `snapshot`, `load_snapshot`, `reset`.
- `decode_batch(payload) -> Batch`, `decode_event(raw) -> Stored | Removed | Cleared | None`:
  the wire format as records.
- `vllm_block_hashes(token_ids, block_size, ...)`: the hashes an engine reports for a prompt,
  computed with vLLM's own hasher.

Sequence numbers: a batch whose number is not the next one opens a gap. With a replay endpoint
the router asks for the missing batches; it also asks when it has heard nothing for
`idle_replay_s`, so a batch lost to ZMQ's slow-joiner window (or a whole quiet stream missed
by a late subscriber) is fetched without waiting for new traffic. What the publisher's buffer
no longer holds is counted in `EngineStats.missed`.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq

__all__ = [
    "Batch",
    "Cleared",
    "EngineStats",
    "KVRouter",
    "Removed",
    "Stored",
    "decode_batch",
    "decode_event",
    "vllm_block_hashes",
]

BlockHashValue = int | bytes
GPU = "GPU"
END_SEQ = -1  # the replay socket's end-of-replay marker (vLLM's ZmqEventPublisher.END_SEQ)

# Positional field order of the array form (vLLM's struct field order; 0.33 appends
# lookahead_token_ids to BlockStored). The map form is read by name.
STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
    "ownership",
    "session_id",
    "lookahead_token_ids",
)
REMOVED_FIELDS = ("block_hashes", "medium", "group_idx", "locality", "ownership")
CLEARED_FIELDS = ("medium",)  # vLLM sends none; a medium, if a publisher adds one, scopes it
# Fields kept on the records; every other one goes to `extra`.
STORED_KEPT = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id")
STORED_KEPT += ("medium", "lora_name", "group_idx", "locality")


@dataclass(frozen=True)
class Stored:
    """A `BlockStored`: `block_hashes` are now held on `medium` (a chain: each block's parent
    is the previous one, the first's is `parent_block_hash`)."""

    block_hashes: tuple[BlockHashValue, ...]
    parent_block_hash: BlockHashValue | None = None
    token_ids: tuple[int, ...] = ()
    block_size: int = 0
    lora_id: int | None = None
    medium: str = GPU
    lora_name: str | None = None
    group_idx: int = 0
    locality: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Removed:
    """A `BlockRemoved`: `block_hashes` are no longer held on `medium`."""

    block_hashes: tuple[BlockHashValue, ...]
    medium: str = GPU
    group_idx: int = 0
    locality: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Cleared:
    """An `AllBlocksCleared`: nothing is held any more (on `medium` only, if one is given)."""

    medium: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)


Event = Stored | Removed | Cleared


@dataclass(frozen=True)
class Batch:
    """A `KVEventBatch`: its timestamp, its decoded events (unknown kinds dropped, counted in
    `unknown`), and the publisher's data-parallel rank."""

    ts: float
    events: tuple[Event, ...]
    data_parallel_rank: int | None
    unknown: int = 0


@dataclass(frozen=True)
class EngineStats:
    """What the router has seen of one engine's stream."""

    last_seq: int | None  # the last sequence number applied (None: none yet)
    batches: int  # batches applied, live or replayed
    replayed: int  # of which fetched through the replay socket
    gaps: int  # times a batch arrived whose number was not the next one
    missed: int  # sequence numbers never applied (neither received nor replayed)
    duplicates: int  # batches received again (already applied) and ignored
    unknown_events: int  # events of a kind the router does not know, ignored


def _fields(raw: Any, names: Sequence[str]) -> tuple[str | None, dict[str, Any]]:
    """A tagged event (map or array) -> (tag, {field: value}); unknown positions named '#i'."""
    if isinstance(raw, dict):
        d = dict(raw)
        return d.pop("type", None), d
    if isinstance(raw, (list, tuple)) and raw and isinstance(raw[0], str):
        values = list(raw[1:])
        d = dict(zip(names, values, strict=False))
        d.update({f"#{i + 1}": v for i, v in enumerate(values) if i >= len(names)})
        return raw[0], d
    return None, {}


def _group(value: Any) -> int:
    # vLLM's single KV cache group is 0; publishers that leave it out mean that group.
    return 0 if value is None else int(value)


def decode_event(raw: Any) -> Event | None:
    """One event as msgpack decoded it (map or array form) -> a record; None for a kind this
    router does not know (a newer publisher's), which callers skip."""
    if isinstance(raw, (Stored, Removed, Cleared)):
        return raw
    tag, d = _fields(raw, STORED_FIELDS)
    if tag == "BlockStored":
        extra = {k: v for k, v in d.items() if k not in STORED_KEPT}
        return Stored(
            block_hashes=tuple(d.get("block_hashes") or ()),
            parent_block_hash=d.get("parent_block_hash"),
            token_ids=tuple(d.get("token_ids") or ()),
            block_size=int(d.get("block_size") or 0),
            lora_id=d.get("lora_id"),
            medium=d.get("medium") or GPU,
            lora_name=d.get("lora_name"),
            group_idx=_group(d.get("group_idx")),
            locality=d.get("locality"),
            extra=extra,
        )
    if tag == "BlockRemoved":
        _, d = _fields(raw, REMOVED_FIELDS)
        kept = ("block_hashes", "medium", "group_idx", "locality")
        return Removed(
            block_hashes=tuple(d.get("block_hashes") or ()),
            medium=d.get("medium") or GPU,
            group_idx=_group(d.get("group_idx")),
            locality=d.get("locality"),
            extra={k: v for k, v in d.items() if k not in kept},
        )
    if tag == "AllBlocksCleared":
        _, d = _fields(raw, CLEARED_FIELDS)
        medium = d.pop("medium", None)
        return Cleared(medium=medium, extra=d)
    return None


def decode_batch(payload: bytes) -> Batch:
    """A msgpack `KVEventBatch` ``[ts, [events], dp_rank]`` (dp_rank may be left out) -> Batch.
    Raises ValueError on a payload of another shape."""
    raw = msgspec.msgpack.decode(payload)
    if isinstance(raw, dict):  # a publisher that encodes the batch as a map
        raw = [raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")]
    if not isinstance(raw, list) or len(raw) < 2 or not isinstance(raw[1], list):
        raise ValueError(f"not a KVEventBatch: {raw!r:.200}")
    decoded = [decode_event(e) for e in raw[1]]
    events = tuple(e for e in decoded if e is not None)
    rank = raw[2] if len(raw) > 2 else None
    return Batch(float(raw[0] or 0.0), events, rank, unknown=len(decoded) - len(events))


class _View:
    """One engine's view: medium -> block hash -> the KV cache groups holding it."""

    def __init__(self) -> None:
        self.held: dict[str, dict[BlockHashValue, set[int]]] = {}
        self.last_seq: int | None = None
        self.batches = self.replayed = self.gaps = self.missed = 0
        self.duplicates = self.unknown = 0

    def apply(self, event: Event) -> None:
        if isinstance(event, Stored):
            medium = self.held.setdefault(event.medium, {})
            for h in event.block_hashes:
                medium.setdefault(h, set()).add(event.group_idx)
        elif isinstance(event, Removed):
            medium = self.held.setdefault(event.medium, {})
            for h in event.block_hashes:
                groups = medium.get(h)
                if groups is not None:
                    groups.discard(event.group_idx)
                    if not groups:
                        del medium[h]
        elif event.medium is None:
            self.held.clear()
        else:
            self.held.pop(event.medium, None)

    def prefix(self, block_hashes: Sequence[BlockHashValue], mediums: Iterable[str]) -> int:
        tables = [self.held.get(m, {}) for m in mediums]
        n = 0
        for h in block_hashes:
            if not any(h in t for t in tables):
                break
            n += 1
        return n

    def stats(self) -> EngineStats:
        return EngineStats(
            self.last_seq,
            self.batches,
            self.replayed,
            self.gaps,
            self.missed,
            self.duplicates,
            self.unknown,
        )


class KVRouter:
    """Subscribes to each engine's KV event stream and scores requests by the longest prefix
    of their block hashes each engine holds, per medium (see the module docstring)."""

    def __init__(
        self,
        engines: dict[str, str],
        replay: dict[str, str] | None = None,
        *,
        topic: str = "",
        idle_replay_s: float = 1.0,
        replay_timeout_s: float = 2.0,
    ) -> None:
        unknown = set(replay or {}) - set(engines)
        if unknown:
            raise ValueError(f"replay endpoints for unknown engines: {sorted(unknown)}")
        self.engines = dict(engines)
        self.replay = dict(replay or {})
        self.topic = topic.encode()
        self.idle_replay_s = idle_replay_s
        self.replay_timeout_s = replay_timeout_s
        # Reentrant: a `wait` predicate may call `score` or `held`.
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._views = {name: _View() for name in engines}
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._error: BaseException | None = None

    # --- lifecycle -------------------------------------------------------------------------
    def start(self) -> KVRouter:
        """Connect and start the receiving thread; returns once its sockets are connected.
        A router may be stopped and started again: it keeps its view and its sequence numbers,
        so what it missed meanwhile is a gap (filled through replay where there is one)."""
        if self._thread is not None:
            raise RuntimeError("KVRouter already started")
        self._stop.clear()
        ready = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(ready,), daemon=True, name="kv-router"
        )
        self._thread.start()
        ready.wait()
        self._raise()
        return self

    def stop(self) -> None:
        """Stop the thread and close the sockets (the view is kept)."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        self._raise()

    def __enter__(self) -> KVRouter:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _raise(self) -> None:
        if self._error is not None:
            raise RuntimeError("KVRouter's thread failed") from self._error

    # --- queries ---------------------------------------------------------------------------
    def held(self, engine: str) -> dict[str, set[BlockHashValue]]:
        """Medium -> the block hashes `engine` holds there (a copy)."""
        with self._lock:
            return {m: set(t) for m, t in self._views[engine].held.items()}

    def score(self, block_hashes: Sequence[BlockHashValue]) -> dict[str, dict[str, int]]:
        """Engine -> medium -> how many leading blocks of `block_hashes` it holds there (the
        longest prefix, as llm-d's precise prefix scorer counts it), for every medium the
        engine has reported."""
        with self._lock:
            return {
                name: {m: view.prefix(block_hashes, (m,)) for m in view.held}
                for name, view in self._views.items()
            }

    def predicted_hit_blocks(
        self, engine: str, block_hashes: Sequence[BlockHashValue], mediums: Collection[str]
    ) -> int:
        """The longest prefix of `block_hashes` `engine` holds, each block in any of
        `mediums` (a block on CPU after one on GPU still extends the hit)."""
        with self._lock:
            return self._views[engine].prefix(block_hashes, mediums)

    def last_seq(self, engine: str) -> int | None:
        """The last sequence number applied for `engine` (None: none yet)."""
        with self._lock:
            return self._views[engine].last_seq

    def stats(self, engine: str) -> EngineStats:
        with self._lock:
            return self._views[engine].stats()

    def wait_seq(self, engine: str, seq: int, timeout: float) -> bool:
        """Wait until `engine`'s batch `seq` (or a later one) is applied; False on timeout."""

        def done() -> bool:
            last = self._views[engine].last_seq
            return last is not None and last >= seq

        return self.wait(done, timeout)

    def wait(self, predicate: Callable[[], bool], timeout: float) -> bool:
        """Wait until `predicate()` holds (it may call `score`, `held`, ...), re-checked after
        every applied batch; False on timeout."""
        with self._changed:
            return self._changed.wait_for(predicate, timeout)

    # --- snapshots -------------------------------------------------------------------------
    def snapshot(self, engine: str) -> tuple[list[Stored], int | None]:
        """`engine`'s view as `BlockStored` records (one per medium and group) and the
        sequence number it is valid up to: what `load_snapshot` takes."""
        with self._lock:
            view = self._views[engine]
            out: list[Stored] = []
            for medium, table in view.held.items():
                by_group: dict[int, list[BlockHashValue]] = {}
                for h, groups in table.items():
                    for g in groups:
                        by_group.setdefault(g, []).append(h)
                for g, hashes in sorted(by_group.items()):
                    out.append(Stored(tuple(hashes), medium=medium, group_idx=g))
            return out, view.last_seq

    def load_snapshot(self, engine: str, events: Iterable[Any], seq: int | None = None) -> None:
        """Replace `engine`'s view with what `events` (records, or events as msgpack decodes
        them) build from nothing. With `seq`, live batches up to `seq` are already in it and
        are skipped; the next expected one is `seq + 1`."""
        view = _View()
        for raw in events:
            event = decode_event(raw)
            if event is not None:
                view.apply(event)
        with self._changed:
            old = self._views[engine]
            view.last_seq = seq if seq is not None else old.last_seq
            self._views[engine] = view
            self._changed.notify_all()

    def reset(self, engine: str, medium: str | None = None) -> None:
        """Forget what `engine` holds (on `medium` only, if given), as `AllBlocksCleared`."""
        with self._changed:
            self._views[engine].apply(Cleared(medium))
            self._changed.notify_all()

    # --- the receiving thread --------------------------------------------------------------
    def _run(self, ready: threading.Event) -> None:
        ctx = zmq.Context()
        subs: dict[zmq.Socket, str] = {}
        dealers: dict[str, zmq.Socket] = {}
        try:
            poller = zmq.Poller()
            for name, endpoint in self.engines.items():
                sub = ctx.socket(zmq.SUB)
                sub.setsockopt(zmq.SUBSCRIBE, self.topic)
                sub.connect(endpoint)
                poller.register(sub, zmq.POLLIN)
                subs[sub] = name
            ready.set()
            last_heard = {name: 0.0 for name in self.replay}  # ask at once on start
            while not self._stop.is_set():
                for sock, _ in poller.poll(100):
                    name = subs[sock]
                    while (frames := self._recv(sock)) is not None:
                        self._receive(ctx, dealers, name, frames)
                        if name in last_heard:
                            last_heard[name] = time.monotonic()
                now = time.monotonic()
                for name, t in last_heard.items():
                    if now - t >= self.idle_replay_s:
                        self._fetch(ctx, dealers, name)
                        last_heard[name] = time.monotonic()
        except BaseException as exc:  # reported by start/stop; the thread must not die silently
            self._error = exc
        finally:
            ready.set()
            for sock in [*subs, *dealers.values()]:
                sock.close(linger=0)
            ctx.term()

    @staticmethod
    def _recv(sock: zmq.Socket) -> list[bytes] | None:
        try:
            return sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return None

    def _receive(
        self, ctx: zmq.Context, dealers: dict[str, zmq.Socket], name: str, frames: list[bytes]
    ) -> None:
        if len(frames) != 3:
            return  # not (topic, seq, payload): another protocol on this endpoint
        _topic, seq_bytes, payload = frames
        seq = int.from_bytes(seq_bytes, "big", signed=True)
        with self._lock:
            last = self._views[name].last_seq
        expected = 0 if last is None else last + 1
        if seq > expected and name in self.replay:
            self._fetch(ctx, dealers, name)  # the missing ones first, in order
        self._apply(name, seq, payload, replayed=False)

    def _apply(self, name: str, seq: int, payload: bytes, *, replayed: bool) -> None:
        batch = decode_batch(payload)
        with self._changed:
            view = self._views[name]
            expected = 0 if view.last_seq is None else view.last_seq + 1
            if seq < expected:
                view.duplicates += 1
                return
            if seq > expected:
                view.gaps += 1
                view.missed += seq - expected
            for event in batch.events:
                view.apply(event)
            view.unknown += batch.unknown
            view.last_seq = seq
            view.batches += 1
            view.replayed += replayed
            self._changed.notify_all()

    def _fetch(self, ctx: zmq.Context, dealers: dict[str, zmq.Socket], name: str) -> None:
        """Ask `name`'s replay socket for every batch after the last applied one; apply them
        in order. A replay that does not end within `replay_timeout_s` is dropped (with its
        socket, so a late answer cannot be mistaken for the next one's)."""
        with self._lock:
            last = self._views[name].last_seq
        start = 0 if last is None else last + 1
        dealer = dealers.get(name)
        if dealer is None:
            dealer = dealers[name] = ctx.socket(zmq.DEALER)
            dealer.connect(self.replay[name])
        dealer.send_multipart((b"", start.to_bytes(8, "big")))
        got: list[tuple[int, bytes]] = []
        deadline = time.monotonic() + self.replay_timeout_s
        while (left := deadline - time.monotonic()) > 0 and not self._stop.is_set():
            if not dealer.poll(min(left, 0.1) * 1000):
                continue
            frames = dealer.recv_multipart()
            if len(frames) != 4:
                continue
            seq = int.from_bytes(frames[2], "big", signed=True)
            if seq == END_SEQ:
                for s, payload in sorted(got):
                    self._apply(name, s, payload, replayed=True)
                return
            got.append((seq, frames[3]))
        dealer.close(linger=0)
        del dealers[name]


def vllm_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    *,
    hash_algo: str = "sha256",
    seed: str | None = None,
    cache_salt: str | None = None,
    as_int: bool | None = None,
) -> list[BlockHashValue]:
    """The block hashes an engine reports in its events for a prompt of `token_ids` (full
    blocks only), computed by vLLM's own `get_request_block_hasher` on a vLLM `Request`.

    Engines and router agree when they use the same `hash_algo` (the engine's
    ``--prefix-caching-hash-algo``, default sha256) and the same NONE_HASH seed: vLLM derives
    it from PYTHONHASHSEED when set, else (sha256, sha256_cbor) from a fixed default; xxhash
    algorithms without PYTHONHASHSEED use a random per-process seed no router can match.
    `seed` is the engines' PYTHONHASHSEED (None: this process's, resolved as vLLM does).
    `as_int` (None: as VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES, default on) gives the low 64 bits
    as an int, the form events carry. Needs vLLM installed."""
    from vllm import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils as kcu
    from vllm.v1.request import Request

    hash_fn = get_hash_fn_by_name(hash_algo)
    previous = getattr(kcu, "NONE_HASH", None)
    if seed is None:
        if hash_algo.startswith("xxhash") and not os.environ.get("PYTHONHASHSEED"):
            raise ValueError(f"{hash_algo} without PYTHONHASHSEED: engines use a random seed")
        kcu.init_none_hash(hash_fn)
    else:
        # What init_none_hash derives when PYTHONHASHSEED is `seed`.
        kcu.NONE_HASH = kcu.BlockHash(hash_fn(seed))
    try:
        hasher = kcu.get_request_block_hasher(block_size, hash_fn)
        request = Request(
            "kv-router",
            list(token_ids),
            SamplingParams(max_tokens=1),
            None,
            cache_salt=cache_salt,
            block_hasher=hasher,
        )
        hashes = list(request.block_hashes)
    finally:
        if previous is not None:
            kcu.NONE_HASH = previous
    if as_int is None:
        return [kcu.maybe_convert_block_hash(h) for h in hashes]
    if as_int:
        return [int.from_bytes(h, "big") & ((1 << 64) - 1) for h in hashes]
    return [bytes(h) for h in hashes]
