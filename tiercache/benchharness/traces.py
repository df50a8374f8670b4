"""Request traces for replay: seeded synthetic generators and a JSONL loader.

Primitives:
- `Trace`: a frozen list of requests (each a prefix chain of 16-byte block keys) with arrival
  timestamps; `n_blocks`, `unique_blocks`.
- `chat_trace`, `rag_trace`, `agentic_trace`, `scan_trace` (and `make_trace(name, ...)`):
  seeded generators; the same seed gives the same trace, key for key.
- `load_jsonl(path)`: a user trace, one request per line: `{"timestamp": t, "hash_ids": [...]}`
  (the Mooncake trace format: one integer per block, already prefix-chained) or
  `{"timestamp": t, "token_ids": [...]}` (hashed here with `prefix_hashes`), or
  `"block_hashes": ["32 hex digits", ...]`. A bad line is a `TraceError` naming the line.

Generators produce token ids and hash them with tiercache's own `prefix_hashes`, so shared
text yields shared keys exactly as in serving.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tiercache.hashing import prefix_hashes

NAMESPACE = "tiercache-bench/synthetic/bs16"
KEY_BYTES = 16


class TraceError(ValueError):
    """A user trace that cannot be replayed; the message names the file, line and field."""


@dataclass(frozen=True)
class Trace:
    """Requests (prefix chains of distinct 16-byte keys, head first) in arrival order."""

    name: str
    requests: tuple[tuple[bytes, ...], ...]
    timestamps: tuple[float, ...]
    block_size: int = 16

    def __post_init__(self) -> None:
        if len(self.requests) != len(self.timestamps):
            raise ValueError("timestamps: expected one per request")

    @property
    def n_blocks(self) -> int:
        """Block accesses in the whole trace."""
        return sum(len(r) for r in self.requests)

    @property
    def unique_blocks(self) -> int:
        """Distinct keys in the trace (the footprint an infinite cache would hold)."""
        return len({k for r in self.requests for k in r})

    def head(self, n: int) -> Trace:
        """The first `n` requests."""
        return Trace(self.name, self.requests[:n], self.timestamps[:n], self.block_size)


class _Gen:
    """Shared state of one generator run: the rng, text snippets, arrival clock."""

    def __init__(self, seed: int, vocab: int, rate: float) -> None:
        self.rng = np.random.default_rng(seed)
        self.vocab = vocab
        self.rate = rate
        self.t = 0.0

    def text(self, lo: int, hi: int) -> np.ndarray:
        n = int(self.rng.integers(lo, hi + 1))
        return self.rng.integers(0, self.vocab, size=n, dtype=np.int64)

    def tick(self) -> float:
        self.t += float(self.rng.exponential(1.0 / self.rate))
        return self.t

    def zipf(self, n: int, a: float) -> np.ndarray:
        p = np.arange(1, n + 1, dtype=np.float64) ** -a
        return p / p.sum()


def _build(name: str, gen: _Gen, prompts: Iterator[np.ndarray], block_size: int) -> Trace:
    reqs: list[tuple[bytes, ...]] = []
    stamps: list[float] = []
    for tokens in prompts:
        keys = prefix_hashes(tokens, block_size, namespace=NAMESPACE)
        if keys:
            reqs.append(tuple(keys))
            stamps.append(gen.tick())
    return Trace(name, tuple(reqs), tuple(stamps), block_size)


def _sessions(
    g: _Gen,
    n: int,
    start: Callable[[], np.ndarray],
    turn: Callable[[], list[np.ndarray]],
    *,
    p_turn: float,
    max_len: int,
    p_end: float,
    max_open: int,
) -> Iterator[np.ndarray]:
    """`n` prompts of interleaved growing sessions (chat, agent loops): with probability
    `p_turn` a random open session gets `turn()` appended and is resent (it ends past `max_len`
    tokens or with probability `p_end`); otherwise a new session starts from `start()`, the
    oldest open one dropping past `max_open`."""
    open_: list[np.ndarray] = []
    for _ in range(n):
        if open_ and g.rng.random() < p_turn:
            i = int(g.rng.integers(len(open_)))
            ctx = np.concatenate([open_[i], *turn()])
            if len(ctx) > max_len or g.rng.random() < p_end:
                open_.pop(i)
            else:
                open_[i] = ctx
        else:
            ctx = start()
            open_.append(ctx)
            if len(open_) > max_open:
                open_.pop(0)
        yield ctx


def chat_trace(
    n: int, *, seed: int = 0, block_size: int = 16, n_system: int = 8, max_open: int = 64
) -> Trace:
    """Multi-turn chats: each conversation starts from one of a few shared system prompts and
    resends its whole growing history each turn; conversations interleave and end at random."""
    g = _Gen(seed, 32000, rate=20.0)
    systems = [g.text(256, 1024) for _ in range(n_system)]
    sys_p = g.zipf(n_system, 1.0)

    def start() -> np.ndarray:
        return np.concatenate([systems[int(g.rng.choice(n_system, p=sys_p))], g.text(16, 96)])

    def turn() -> list[np.ndarray]:
        return [g.text(32, 256), g.text(16, 96)]

    prompts = _sessions(g, n, start, turn, p_turn=0.8, max_len=6000, p_end=0.1, max_open=max_open)
    return _build("chat", g, prompts, block_size)


def rag_trace(
    n: int, *, seed: int = 0, block_size: int = 16, n_docs: int = 500, zipf_a: float = 1.1
) -> Trace:
    """RAG: a shared system prompt, then 1-3 retrieved documents drawn from a Zipf popularity,
    then a unique question. Only the system prompt plus the first document is a shared prefix."""
    g = _Gen(seed, 32000, rate=50.0)
    system = g.text(128, 384)
    docs = [g.text(256, 1024) for _ in range(n_docs)]
    p = g.zipf(n_docs, zipf_a)

    def prompts() -> Iterator[np.ndarray]:
        for _ in range(n):
            k = int(g.rng.integers(1, 4))
            picked = g.rng.choice(n_docs, size=k, replace=False, p=p)
            yield np.concatenate([system, *(docs[int(d)] for d in picked), g.text(16, 64)])

    return _build("rag", g, prompts(), block_size)


def agentic_trace(
    n: int, *, seed: int = 0, block_size: int = 16, n_agents: int = 4, max_open: int = 16
) -> Trace:
    """Agent loops: a long shared prefix per agent type (instructions and tool schemas), then
    steps that each append a tool call and its observation and resend everything."""
    g = _Gen(seed, 32000, rate=10.0)
    prefixes = [g.text(2048, 4096) for _ in range(n_agents)]

    def start() -> np.ndarray:
        return np.concatenate([prefixes[int(g.rng.integers(n_agents))], g.text(32, 128)])

    def turn() -> list[np.ndarray]:
        return [g.text(16, 64), g.text(64, 512)]

    prompts = _sessions(g, n, start, turn, p_turn=0.9, max_len=12000, p_end=0.05, max_open=max_open)
    return _build("agentic", g, prompts, block_size)


def scan_trace(n: int, *, seed: int = 0, block_size: int = 16, scan_share: float = 0.4) -> Trace:
    """A reused working set (popular prompts, Zipf) interleaved with one-off long scans (batch
    summarisation of documents seen once): recency-only policies let the scans flush the set."""
    g = _Gen(seed, 32000, rate=30.0)
    n_hot = 200
    hot = [g.text(128, 768) for _ in range(n_hot)]
    p = g.zipf(n_hot, 0.9)

    def prompts() -> Iterator[np.ndarray]:
        for _ in range(n):
            if g.rng.random() < scan_share:
                yield g.text(1024, 4096)  # seen once, never again
            else:
                yield np.concatenate([hot[int(g.rng.choice(n_hot, p=p))], g.text(8, 32)])

    return _build("scan", g, prompts(), block_size)


GENERATORS: dict[str, Callable[..., Trace]] = {
    "chat": chat_trace,
    "rag": rag_trace,
    "agentic": agentic_trace,
    "scan": scan_trace,
}


def make_trace(name: str, n: int, *, seed: int = 0, block_size: int = 16) -> Trace:
    """One of the synthetic traces by name (see GENERATORS)."""
    gen = GENERATORS.get(name)
    if gen is None:
        raise ValueError(f"unknown trace {name!r}; expected one of {', '.join(GENERATORS)}")
    if n < 1:
        raise ValueError(f"requests: expected >= 1, got {n}")
    return gen(n, seed=seed, block_size=block_size)


# -- user traces ---------------------------------------------------------------------------
def _key_from_id(v: object, where: str) -> bytes:
    if isinstance(v, bool) or not isinstance(v, int | str):
        raise TraceError(f"{where}: expected an integer or a hex string, got {type(v).__name__}")
    if isinstance(v, int):
        if v < 0 or v >= 1 << 128:
            raise TraceError(f"{where}: block id {v} is outside [0, 2**128)")
        return v.to_bytes(KEY_BYTES, "big")
    try:
        raw = bytes.fromhex(v)
    except ValueError:
        raise TraceError(f"{where}: {v[:40]!r} is not a hex string") from None
    if len(raw) != KEY_BYTES:
        raise TraceError(f"{where}: expected {2 * KEY_BYTES} hex digits, got {len(v)}")
    return raw


def _parse_line(
    line: str, where: str, block_size: int, namespace: str
) -> tuple[float, tuple[bytes, ...]]:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{where}: not valid JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    ts = obj.get("timestamp")
    if isinstance(ts, bool) or not isinstance(ts, int | float):
        raise TraceError(f"{where}.timestamp: expected a number, got {ts!r}")
    fields = [f for f in ("hash_ids", "block_hashes", "token_ids") if f in obj]
    if len(fields) != 1:
        raise TraceError(
            f"{where}: expected exactly one of 'hash_ids', 'block_hashes', 'token_ids', "
            f"got {fields or 'none'}"
        )
    field = fields[0]
    ids = obj[field]
    if not isinstance(ids, list):
        raise TraceError(f"{where}.{field}: expected a list, got {type(ids).__name__}")
    if field == "token_ids":
        try:
            keys = prefix_hashes(ids, block_size, namespace=namespace)
        except (TypeError, ValueError) as exc:
            raise TraceError(f"{where}.token_ids: {exc}") from None
    else:
        keys = [_key_from_id(v, f"{where}.{field}[{i}]") for i, v in enumerate(ids)]
        if len(set(keys)) != len(keys):
            raise TraceError(f"{where}.{field}: a request repeats a block id")
    return float(ts), tuple(keys)


def load_jsonl(
    path: str | Path, *, block_size: int = 16, namespace: str = NAMESPACE, name: str | None = None
) -> Trace:
    """Read a JSONL trace. Blank lines and requests with no full block are skipped; requests
    are replayed in timestamp order (stable for equal stamps)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise TraceError(f"{p}: no such trace file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(f"{p}: cannot read trace: {exc}") from None
    rows: list[tuple[float, tuple[bytes, ...]]] = []
    for no, line in enumerate(text.splitlines(), 1):
        if line.strip():
            ts, keys = _parse_line(line, f"{p}:{no}", block_size, namespace)
            if keys:
                rows.append((ts, keys))
    if not rows:
        raise TraceError(f"{p}: the trace holds no request with a full block")
    rows.sort(key=lambda r: r[0])
    return Trace(name or p.stem, tuple(r[1] for r in rows), tuple(r[0] for r in rows), block_size)
