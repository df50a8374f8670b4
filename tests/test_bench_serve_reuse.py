"""bench/bench_serve.py's per-request reuse accounting (issue 48): reusable tokens are those
of a prompt's prefix that a request finished before it was sent had, less what vLLM's own
cache held at its admission; captured is what tiercache gave of them."""

from __future__ import annotations

import importlib.util
from collections import Counter
from pathlib import Path
from types import ModuleType

import pytest

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


def test_warm_up_prompts_count_as_finished_before_every_request() -> None:
    """prefix_repetition_warm: the warm-up sent each prefix alone before the run, so B, sent
    at 0 s while nothing of the run has finished, has its 3 prefix blocks reusable (the
    warm prompt PREFIX is 12 tokens: 3 full blocks), and a prompt whose prefix was not
    warmed has none."""
    b = _bench()
    other = [7, 7, 7, 7, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]
    admitted = {0: (15, 0, 12), 1: (15, 0, 0)}
    result = _result([0.0, 0.0], [1.0, 1.0])
    out = b.reuse_per_request([B, other], result, admitted, BLOCK, warm=[PREFIX])
    assert out["reusable_exact"] == 12
    assert out["captured_tokens"] == 12
    cold = b.reuse_per_request([B, other], result, admitted, BLOCK)
    assert cold["reusable_exact"] == 0
    assert cold["loaded_beyond"] == 12


def _identity() -> ModuleType:
    return _bench()._load("serve_identity", ROOT / "bench" / "serve_identity.py")


def test_identity_prompts_share_each_prefix_alike_and_mismatches_name_the_prompts() -> None:
    """bench/serve_identity.py: 12 prompts over 3 prefixes of 5 tokens, 4 prompts each, ids
    from 3 (the tokenizer's specials excluded), the same for the same seed; a pass's
    mismatches are the answered prompts whose ids differ (a cut-off one is not judged, an
    aborted one must be the reference's start)."""
    m = _identity()
    prompts = m.identity_prompts(12, 3, 5, 2, 50, seed=1)
    assert prompts == m.identity_prompts(12, 3, 5, 2, 50, seed=1)
    assert sorted(Counter(tuple(p[:5]) for p in prompts).values()) == [4, 4, 4]
    assert all(len(p) == 7 and min(p) >= 3 for p in prompts)
    reference = [[1, 2], [3, 4], [5, 6], [7, 8]]
    assert m.Pass([[1, 2], None, [5, 9], [7]]).mismatched(reference) == [2, 3]
    aborted = m.Pass([[1, 2], [3], [5, 9], []], aborted={1, 2, 3})
    assert aborted.mismatched(reference) == [2]
    with pytest.raises(ValueError, match="fewer prompts than --num-prefixes"):
        m.identity_prompts(2, 3, 5, 2, 50, seed=1)


def test_unique_prompts_share_no_block_and_are_seeded() -> None:
    """The no-reuse workload: no two prompts alike in their first block (so in any block of
    a chain), the same prompts for the same seed, words of the model's vocabulary only."""
    b = _bench()
    rows = b.unique_prompts(500, 40, 8, seed=3, block=BLOCK)  # a tiny vocabulary: 5 words
    ids = [[int(w[1:]) for w in r.split()] for r in rows]
    assert len(ids) == 500 and all(len(x) == 40 for x in ids)
    assert len({tuple(x[:BLOCK]) for x in ids}) == 500
    assert all(3 <= i < 8 for x in ids for i in x)
    assert b.unique_prompts(500, 40, 8, seed=3, block=BLOCK) == rows
    assert b.unique_prompts(500, 40, 8, seed=4, block=BLOCK) != rows
