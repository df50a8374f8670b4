"""Identical outputs under load and across a restart, at the serving bench's sizes (issue 48;
LMCache #4492's scenario, where 38 of 38 requests came back corrupted after a restart with
HTTP 200). `bench/bench_serve.py --identity N` runs it for every configuration:

1. N token-id prompts, `--num-prefixes` prefixes shared alike, shuffled, sent at the bench's
   largest concurrency, temperature 0, to the server without a connector: the reference.
2. The same prompts to each connector's server: every output equals the reference's.
3. The same prompts again, and SIGTERM to the API server once a tenth have answered (vLLM
   force-kills its engine core with stores in flight): every answer equals the reference's;
   one vLLM ended at the shutdown (HTTP 200, finish_reason "abort", the tokens so far) must
   be the start of it; requests cut off without an answer are counted, not judged.
4. A new server on the same store, the same prompts: every output equals the reference's,
   and the tokens the connector gave (a CPU-only store starts empty: its hits then come from
   siblings of the same run; a persistent one's from before the restart too).

The fp32 model makes greedy outputs independent of batching (tests/vllm/engine.py's DTYPE),
but not of vLLM's own computation paths: a prompt whose prefix vLLM's cache holds runs its
attention another way than a full prefill, and the log-probabilities differ in the fifth
digit (measured without any connector: -1.2203363 / -1.2203706 for one token of one prompt).
Where the reference's two likeliest tokens are closer than that, greedy decoding may pick
either: a random model has such near-ties (one prompt of 2,048 flipped between two servers
without a connector that differ only in engine cache size). Every completion of the bench
asks for its top log-probabilities, and an answer that differs from the reference first at a
token that is the reference's runner-up within `TIE_NATS` is a *tie* (`Pass.ties`), reported
with its margin apart from the mismatches; any other difference is a mismatch. (The CI test
at its small size asks for none: its server has no tokenizer; it demands identical outputs.)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# A first difference at a token the reference ranked second, within this many nats of its
# first: a float tie (see the module doc), not a mismatch. Corrupt KV moves the logits by far
# more, and flips answers from their first token on.
TIE_NATS = 0.01


def identity_prompts(
    n: int, num_prefixes: int, prefix_len: int, suffix_len: int, vocab: int, seed: int
) -> list[list[int]]:
    """`n` prompts of `num_prefixes` random prefixes (each shared by n / num_prefixes
    prompts) and random suffixes, shuffled as users' requests arrive. Ids from 3 up: the
    word-level tokenizer's 0-2 are special."""
    if n < num_prefixes:
        raise ValueError(f"--identity {n}: fewer prompts than --num-prefixes {num_prefixes}")
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, vocab) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    prompts = [
        prefixes[i % num_prefixes] + [rng.randrange(3, vocab) for _ in range(suffix_len)]
        for i in range(n)
    ]
    rng.shuffle(prompts)
    return prompts


@dataclass
class Pass:
    """One pass of the prompts: each one's output ids (None: it failed or was cut off), the
    failures' messages, which answers came after a SIGTERM, and which were aborted."""

    outputs: list[list[int] | None]
    failures: list[str] = field(default_factory=list)
    after_signal: set[int] = field(default_factory=set)
    aborted: set[int] = field(default_factory=set)
    # per prompt, per output token: the chosen token's text and the top log-probabilities
    tokens: dict[int, list[str]] = field(default_factory=dict)
    tops: dict[int, list[dict[str, float]]] = field(default_factory=dict)

    def mismatched(self, reference: list[list[int] | None]) -> list[int]:
        """Prompts answered with other ids than the reference's: a whole answer must equal
        it, an aborted one (finish_reason "abort": vLLM ended it at a shutdown, with the
        tokens it had) must be its start."""
        bad = []
        for i, (o, r) in enumerate(zip(self.outputs, reference, strict=True)):
            if o is None:
                continue
            if r is None or (o != r[: len(o)] if i in self.aborted else o != r):
                bad.append(i)
        return bad

    def ties(self, reference: Pass, within: float = TIE_NATS) -> dict[int, float]:
        """Of the prompts `mismatched` with `reference`'s outputs, those whose first
        differing token is the one the reference ranked second, within `within` nats of its
        first: prompt -> that margin (see the module doc)."""
        out = {}
        for i in self.mismatched(reference.outputs):
            o, r = self.outputs[i], reference.outputs[i]
            if o is None or r is None or i not in self.tokens or i not in reference.tops:
                continue
            j = next((j for j, (a, b) in enumerate(zip(o, r, strict=False)) if a != b), None)
            if j is None or j >= len(reference.tops[i]) or j >= len(self.tokens[i]):
                continue
            top = reference.tops[i][j]
            ours = self.tokens[i][j]
            if ours in top and len(top) >= 2:
                margin = max(top.values()) - top[ours]
                if margin <= within:
                    out[i] = margin
        return out


def complete(
    url: str, model: str, prompt: list[int], max_tokens: int, logprobs: bool = False
) -> tuple[list[int], str, list[str], list[dict[str, float]]]:
    """One greedy completion of token-id `prompt`: its output ids, finish reason, and with
    `logprobs` (a server with a tokenizer: vLLM names the tokens) per output token its text
    and the two likeliest tokens' log-probabilities (for `Pass.ties`; else empty lists)."""
    body = {
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True,
    }  # fmt: skip
    if logprobs:
        body["logprobs"] = 2
    req = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            choice = json.load(r)["choices"][0]
            lp = choice.get("logprobs") or {}
            tops = [dict(t or {}) for t in lp.get("top_logprobs") or []]
            tokens = list(lp.get("tokens") or [])
            return list(choice["token_ids"]), str(choice.get("finish_reason")), tokens, tops
    except urllib.error.HTTPError as exc:
        raise RuntimeError(f"HTTP {exc.code}: {exc.read()[:500]!r}") from None


def run_pass(
    url: str,
    model: str,
    prompts: list[list[int]],
    concurrency: int,
    max_tokens: int,
    stop_after: int | None = None,
    stop: Any = None,
    logprobs: bool = False,
) -> Pass:
    """Every prompt, `concurrency` at a time. With `stop_after`, call `stop()` once that many
    have answered (the others fail or answer after it). `logprobs`: see `complete`."""
    out = Pass([None] * len(prompts))
    answered = threading.Semaphore(0)
    signalled = threading.Event()
    lock = threading.Lock()

    def one(i: int) -> None:
        try:
            ids, finish, tokens, tops = complete(url, model, prompts[i], max_tokens, logprobs)
            with lock:
                out.outputs[i] = ids
                out.tokens[i], out.tops[i] = tokens, tops
                if finish == "abort":
                    out.aborted.add(i)
                if signalled.is_set():
                    out.after_signal.add(i)
        except Exception as exc:  # counted, as vllm bench serve counts them
            with lock:
                out.failures.append(f"{i}: {exc!r}"[:300])
        finally:
            answered.release()

    with ThreadPoolExecutor(concurrency) as pool:
        for i in range(len(prompts)):
            pool.submit(one, i)
        if stop_after is not None:
            for _ in range(stop_after):
                if not answered.acquire(timeout=600):
                    raise RuntimeError(f"no answer in 600 s before the stop ({url})")
            signalled.set()
            stop()
    return out


def sigterm_mid_run(proc: Any, log_text: Any, timeout: float = 60) -> bool:
    """SIGTERM to the API server only, as a supervisor stops it; once its engine core is
    gone (vLLM 0.32 logs "MPClient: complete"; its API server then waits for the open
    connections), or after `timeout`, kill what is left of its process group. True if the
    engine core was seen gone."""
    proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while not (gone := "MPClient: complete" in log_text()) and proc.poll() is None:
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)
    return gone or "MPClient: complete" in log_text()


def summary(name: str, phases: dict[str, Pass], reference: Pass) -> dict:
    """A configuration's identity figures: per phase, answered (whole), aborted, failed,
    mismatched, and ties (prompt -> margin in nats: `Pass.ties`, not counted as mismatched)."""
    out: dict[str, Any] = {"config": name, "requests": len(reference.outputs)}
    for phase, p in phases.items():
        answered = sum(o is not None for o in p.outputs) - len(p.aborted)
        ties = p.ties(reference)
        out[phase] = {
            "answered": answered,
            "aborted": len(p.aborted),
            "failed": len(p.failures),
            "mismatched": [i for i in p.mismatched(reference.outputs) if i not in ties],
            "ties": {str(i): round(m, 5) for i, m in sorted(ties.items())},
            "after_signal": len(p.after_signal),
            "failures": p.failures[:5],
        }
    return out


class Identity:
    """The check's steps around each configuration's server (the module doc says what and
    why): the prompts, the reference (the prefix config's outputs), and per
    connector config its passes before, during (SIGTERM) and after a restart."""

    def __init__(self, model: Path, args: argparse.Namespace):
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        self.prompts = identity_prompts(
            args.identity, args.num_prefixes, args.prefix_len, args.suffix_len, vocab, seed=48
        )
        self.conc, self.max_tokens = max(args.concurrency), args.output_len
        self.reference = Pass([])
        self.phases: dict[str, dict[str, Any]] = {}
        self.results: list[dict[str, Any]] = []

    def _pass(self, srv: Any, **kw: Any) -> Any:
        # the bench's models have a tokenizer (`word_tokenizer`): ties can be told
        return run_pass(
            srv.url, srv.model, self.prompts, self.conc, self.max_tokens, logprobs=True, **kw
        )

    def before_restart(self, name: str, srv: Any) -> None:
        """The reference (prefix), or a pass and a pass cut by SIGTERM (connector configs)."""
        first = self._pass(srv)
        if name == "prefix":
            self.reference = first
            r = summary(name, {"reference": first}, self.reference)
            r["distinct_outputs"] = len({tuple(o) for o in first.outputs if o is not None})
            self.results.append(r)
            print(f"identity: reference of {len(self.prompts)} prompts, "
                  f"{r['distinct_outputs']} distinct outputs, {len(first.failures)} failed",
                  flush=True)  # fmt: skip
            return
        proc, log = srv.proc, srv.log

        def stop() -> None:
            sigterm_mid_run(proc, lambda: log.read_text(errors="replace"))

        cut = self._pass(srv, stop_after=max(1, len(self.prompts) // 10), stop=stop)
        self.phases[name] = {"before": first, "sigterm": cut}

    def after_restart(self, name: str, srv: Any) -> None:
        """The prompts again on a new server over the same store."""
        before = srv.counters()["external_prefix_cache_hits"]
        self.phases[name]["restart"] = self._pass(srv)
        loaded = srv.counters()["external_prefix_cache_hits"] - before
        r = summary(name, self.phases.pop(name), self.reference)
        r["restart_loaded_tokens"] = loaded
        self.results.append(r)
        print(f"identity: {name}: " + ", ".join(
            f"{k} {v['answered']} answered, {v['aborted']} aborted, {v['failed']} failed, "
            f"{len(v['mismatched'])} mismatched" for k, v in r.items() if isinstance(v, dict)
        ) + f"; {loaded:.0f} tokens loaded after the restart", flush=True)  # fmt: skip

    def table(self) -> str:
        """The identity figures as a markdown table."""
        rows = [
            "\n| config | phase | answered | aborted | failed | mismatched | ties (margin, nats) "
            "| after SIGTERM |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in self.results:
            for phase, v in r.items():
                if isinstance(v, dict):
                    rows.append(f"| {r['config']} | {phase} | {v['answered']} | {v['aborted']} "
                                f"| {v['failed']} "
                                f"| {len(v['mismatched'])} | {_ties(v['ties'])} "
                                f"| {v['after_signal']} |")  # fmt: skip
        return "\n".join(rows) + "\n"


def _ties(ties: dict[str, float]) -> str:
    """Ties as the table shows them: their count, and each prompt's margin."""
    if not ties:
        return "0"
    return f"{len(ties)} (" + ", ".join(f"#{i}: {m:.4f}" for i, m in ties.items()) + ")"
