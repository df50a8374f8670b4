"""bench/bench_serve.py's per-request reuse accounting (issue 48): reusable tokens are those
of a prompt's prefix that a request finished before it was sent had, less what vLLM's own
cache held at its admission; captured is what tiercache gave of them."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 4


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_serve", ROOT / "bench" / "bench_serve.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _result(starts: list[float], lats: list[float], errors: list[str] | None = None) -> dict:
    return {"start_times": starts, "latencies": lats, "errors": errors or [""] * len(starts)}


PREFIX = list(range(100, 112))  # 3 blocks
A, B, C, D = ([*PREFIX, i, i + 1, i + 2] for i in (1, 5, 9, 13))  # 15 tokens: 3 full blocks


def test_only_prefixes_of_requests_finished_before_the_send_are_reusable() -> None:
    """A runs 0-10 s; B is sent at 11 s (A finished: its 3 prefix blocks are reusable and
    tiercache gives them); C at 5 s, while A runs (nothing reusable, though the engine's
    cache shares 1 block with it and tiercache gives it 1 block A had stored already: beyond
    the definition); D at 12 s with 2 blocks in vLLM's own cache (1 block left reusable,
    tiercache gives it)."""
    b = _bench()
    admitted = {0: (15, 0, 0), 1: (15, 0, 12), 2: (15, 4, 4), 3: (15, 8, 4)}
    out = b.reuse_per_request(
        [A, B, C, D], _result([0.0, 11.0, 5.0, 12.0], [10.0, 1.0, 1.0, 1.0]), admitted, BLOCK
    )
    assert out["reusable_exact"] == 12 + 0 + 4
    assert out["captured_tokens"] == 12 + 0 + 4
    assert out["loaded_beyond"] == 4
    assert out["unlogged_requests"] == 0


def test_a_failed_request_finishes_nothing_and_the_last_token_block_is_never_reusable() -> None:
    """A failed (no latency): B, sent after, has nothing reusable. C repeats B's prompt
    exactly once B finished: its full blocks are reusable except the one holding its last
    token (12 of 15 tokens: blocks 0-2; the 4th would hold token 15)."""
    b = _bench()
    admitted = {0: (15, 0, 0), 1: (15, 0, 0), 2: (16, 0, 8)}
    c = [*B, 7]  # 16 tokens: 4 full blocks, the last one holds its last token
    out = b.reuse_per_request(
        [A, B, c], _result([0.0, 1.0, 3.0], [0.0, 1.0, 1.0], ["boom", "", ""]), admitted, BLOCK
    )
    assert out["reusable_exact"] == 12
    assert out["captured_tokens"] == 8


def test_admission_lines_are_read_per_run_first_admission_only(tmp_path: Path) -> None:
    """Lines of another run (seed) and a second admission of a request (after an asynchronous
    load, or a preemption) are not counted."""
    b = _bench()
    log = tmp_path / "server.log"
    line = (
        "DEBUG x tiercache.connectors.vllm_kv.admissions: admitted cmpl-tcb{}-{}-0-ab12: "
        "1088 prompt tokens, {} from the engine's cache, {} from tiercache\n"
    )
    log.write_text(
        line.format(7, 0, 0, 0) + line.format(8, 0, 32, 1024) + line.format(8, 0, 0, 0)
        + line.format(8, 3, 64, 0)
    )  # fmt: skip
    assert b.admissions(log, 0, 8) == {0: (1088, 32, 1024), 3: (1088, 64, 0)}
    assert b.admissions(log, 0, 9) == {}
