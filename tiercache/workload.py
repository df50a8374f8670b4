"""Seeded synthetic request streams for the demo and benchmarks.

- `synthetic_requests(n, seed=...)`: token-id arrays from a mix of multi-turn chats that share
  system prompts and RAG requests over Zipf-popular documents. Same seed, same stream.
- `block_bytes_for(keys, block_bytes)`: deterministic stand-in KV bytes for a key, so a reader
  can check that what comes back is exactly what was stored for that key.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Request:
    """One prompt: its kind ("chat" or "rag") and token ids."""

    kind: str
    tokens: np.ndarray


def synthetic_requests(
    n: int,
    *,
    seed: int = 0,
    vocab: int = 32000,
    n_system: int = 4,
    n_docs: int = 64,
    zipf_a: float = 1.2,
    chat_share: float = 0.5,
) -> Iterator[Request]:
    """`n` requests: chats (system prompt + growing history) and RAG (system + doc + query)."""
    rng = np.random.default_rng(seed)

    def text(lo: int, hi: int) -> np.ndarray:
        return rng.integers(0, vocab, size=int(rng.integers(lo, hi)), dtype=np.int64)

    systems = [text(128, 512) for _ in range(n_system)]
    docs = [text(256, 1024) for _ in range(n_docs)]
    ranks = np.arange(1, n_docs + 1, dtype=np.float64)
    doc_p = ranks**-zipf_a
    doc_p /= doc_p.sum()
    chats: list[np.ndarray] = []  # open conversations: their full history so far
    for _ in range(n):
        if rng.random() < chat_share:
            if chats and rng.random() < 0.75:
                i = int(rng.integers(len(chats)))
                history = np.concatenate([chats[i], text(16, 96), text(32, 160)])
                if len(history) > 3000 or rng.random() < 0.15:
                    chats.pop(i)  # the conversation ends
                else:
                    chats[i] = history
            else:
                history = np.concatenate([systems[int(rng.integers(n_system))], text(16, 96)])
                chats.append(history)
                if len(chats) > 32:
                    chats.pop(0)
            yield Request("chat", history)
        else:
            doc = docs[int(rng.choice(n_docs, p=doc_p))]
            sys_prompt = systems[int(rng.integers(n_system))]
            yield Request("rag", np.concatenate([sys_prompt, doc, text(8, 48)]))


def block_bytes_for(keys: Sequence[bytes], block_bytes: int) -> torch.Tensor:
    """uint8 `[len(keys), block_bytes]`: each row is its 16-byte key repeated (a checkable
    stand-in for real KV)."""
    reps, rest = divmod(block_bytes, len(keys[0]) if keys else 16)
    data = b"".join(k * reps + k[:rest] for k in keys)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(len(keys), block_bytes)
