"""Record the calls vLLM's own OffloadingConnector scheduler makes on its OffloadingManager.

Used by `test_bench_agreement.py` to check the bench's `replay_vllm` against the real thing.

- `RecordingSpec`: an out-of-tree `OffloadingSpec` (loaded by vLLM through
  ``kv_connector_extra_config = {"spec_name": "RecordingSpec", "spec_module_path":
  "scheduler_calls", "num_chunks": N, "eviction_policy": "arc"}``). Its manager is vLLM's
  own `CPUOffloadingManager`, every call recorded (`RecordingManager`); its worker
  (`NullWorker`) moves no bytes and reports every job done, successfully, at its next
  `get_finished`. Loaded KV is therefore garbage: only the calls matter here.
- `record(recorder, name, req_context, keys, result)`: one call as a JSON-able row.
- Run as a script: ``python scheduler_calls.py MODEL PROMPTS.json OUT.json`` serves each
  prompt in its own `generate` (one request at a time, as the bench replays them) on an
  in-process engine with vLLM's prefix cache off, so every request reaches the connector
  from its first block, and writes the recorded calls.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Collection
from pathlib import Path
from typing import Any

from vllm.v1.kv_offload.base import (
    OffloadingSpec,
    OffloadingWorker,
    OffloadKey,
    ReqContext,
    TransferResult,
    get_offload_block_hash,
)
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

CALLS: list[dict[str, Any]] = []

# Per-request manager calls compared with the replay. Per-step hooks (`on_schedule_end`,
# `has_pending_work`), metrics (`get_stats`, `get_load_source`) and events change no cache
# state in `CPUOffloadingManager`; they are recorded apart.
REQUEST_CALLS = (
    "on_new_request",
    "lookup",
    "touch",
    "prepare_load",
    "complete_load",
    "prepare_store",
    "complete_store",
    "on_request_finished",
)


def _hex(key: OffloadKey) -> str:
    return bytes(get_offload_block_hash(key)).hex()


def record(
    calls: list[dict[str, Any]],
    name: str,
    ctx: ReqContext | None,
    keys: Collection[OffloadKey] = (),
    result: Any = None,
) -> None:
    """Append one call: its name, request, keys (hex block hashes, in the order given) and,
    for `on_request_finished`, every key position the request context carries."""
    row: dict[str, Any] = {"call": name, "req": None if ctx is None else ctx.req_id}
    row["keys"] = [_hex(k) for k in keys]
    if result is not None:
        row["result"] = result
    if name == "on_request_finished" and ctx is not None:
        # Positions the scheduler recorded (the manager orders a request's keys by them).
        row["positions"] = {
            _hex(k): p
            for k, p in ctx._offload_key_positions.items()  # a private field: test probe
        }
    calls.append(row)


class RecordingManager(CPUOffloadingManager):
    """vLLM's `CPUOffloadingManager`, each call appended to `CALLS` before it runs."""

    def on_new_request(self, req_context: ReqContext) -> Any:
        record(CALLS, "on_new_request", req_context)
        return super().on_new_request(req_context)

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> Any:
        result = super().lookup(key, req_context)
        record(CALLS, "lookup", req_context, [key], result.name)
        return result

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        record(CALLS, "touch", req_context, list(keys))
        super().touch(keys, req_context)

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> Any:
        record(CALLS, "prepare_load", req_context, list(keys))
        return super().prepare_load(keys, req_context)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        record(CALLS, "complete_load", req_context, list(keys))
        super().complete_load(keys, req_context)

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> Any:
        out = super().prepare_store(keys, req_context)
        stored = None if out is None else [_hex(k) for k in out.keys_to_store]
        record(CALLS, "prepare_store", req_context, list(keys), {"stored": stored})
        return out

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        record(CALLS, "complete_store", req_context, list(keys), {"success": success})
        super().complete_store(keys, req_context, success)

    def on_request_finished(self, req_context: ReqContext) -> None:
        record(CALLS, "on_request_finished", req_context)
        super().on_request_finished(req_context)

    def on_schedule_end(self, context: Any) -> None:
        record(CALLS, "on_schedule_end", None)
        super().on_schedule_end(context)


class NullWorker(OffloadingWorker):
    """Moves nothing; every submitted job is reported done, successfully."""

    def __init__(self) -> None:
        self._done: list[int] = []

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        self._done.append(job_id)
        return True

    def submit_load(self, job_id: int, src_spec: Any, dst_spec: Any, *_: Any, **__: Any) -> bool:
        self._done.append(job_id)
        return True

    def get_finished(self) -> list[TransferResult]:
        done, self._done = self._done, []
        return [TransferResult(j, True) for j in done]

    def wait(self, job_ids: set[int]) -> None:
        return


class RecordingSpec(OffloadingSpec):
    """Out-of-tree spec: vLLM's CPU manager (recorded) and a worker that moves nothing."""

    def get_manager(self) -> RecordingManager:
        return RecordingManager(
            num_chunks=int(self.extra_config["num_chunks"]),
            cache_policy=str(self.extra_config.get("eviction_policy", "lru")),
        )

    def get_worker(self, kv_caches: Any) -> NullWorker:
        return NullWorker()


def main(argv: list[str]) -> int:
    model, prompts_path, out_path = argv[1:4]
    spec = json.loads(Path(prompts_path).read_text())
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # scheduler in this process
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=model,
        skip_tokenizer_init=True,
        enable_prefix_caching=False,  # every request asks the connector from block 0
        max_model_len=1024,
        block_size=spec["block_size"],
        dtype="float32",  # the model's own dtype (engine.py's DTYPE)
        enforce_eager=True,
        seed=0,
        kv_transfer_config={
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "spec_name": "RecordingSpec",
                "spec_module_path": "scheduler_calls",
                "num_chunks": spec["num_chunks"],
                "eviction_policy": spec["policy"],
                "block_size": spec["block_size"],
            },
        },
    )
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, detokenize=False)
    tick = [TokensPrompt(prompt_token_ids=[3])]  # shorter than a block: no lookup, no store
    for p in spec["prompts"]:  # one request at a time, as the bench replays a trace
        llm.generate([TokensPrompt(prompt_token_ids=p)], params, use_tqdm=False)
        # vLLM signals a request finished, and reports the store it issued in its last step
        # done, only in the next engine step: run one, so that the next request finds the
        # manager settled (the bench's replay completes each request before the next).
        llm.generate(tick, params, use_tqdm=False)
    import scheduler_calls  # the module vLLM loaded by name (this script runs as __main__)

    Path(out_path).write_text(json.dumps(scheduler_calls.CALLS))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
