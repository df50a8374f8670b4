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


def test_a_first_difference_at_the_references_runner_up_within_the_margin_is_a_tie() -> None:
    """`Pass.ties`: of the mismatched prompts, those whose first differing token the reference
    ranked second within TIE_NATS (a float near-tie vLLM's own paths flip); a difference at
    a token the reference did not rank second, or ranked far below, stays a mismatch; the
    summary counts ties apart from mismatches."""
    m = _identity()
    ref = m.Pass([[5, 6, 7], [5, 6, 7], [5, 6, 7], [5, 6, 7]])
    near = [{"a": -1.0, "b": -1.0}, {"c": -1.2000, "d": -1.2004}, {"e": -0.1, "f": -3.0}]
    far = [{"a": -1.0, "b": -1.0}, {"c": -0.5, "d": -2.0}, {"e": -0.1, "f": -3.0}]
    ref.tops = {0: near, 1: far, 2: near, 3: near}
    got = m.Pass([[5, 8, 9], [5, 8, 9], [9, 6, 7], [5, 6, 7]])
    got.tokens = {0: ["a", "d", "x"], 1: ["a", "d", "x"], 2: ["z", "c", "e"], 3: ["a", "c", "e"]}
    ties = got.ties(ref)
    assert list(ties) == [0] and ties[0] == pytest.approx(0.0004)
    s = m.summary("cpu", {"before": got}, ref)["before"]
    assert s["mismatched"] == [1, 2] and list(s["ties"]) == ["0"]
    assert m._ties(s["ties"]) == "1 (#0: 0.0004)"
    # without the reference's log-probabilities nothing is a tie
    assert m.Pass([[5, 8, 9]]).ties(m.Pass([[5, 6, 7]])) == {}


def test_allcache_holds_every_prefix_and_the_running_requests(tmp_path: Path) -> None:
    """The `allcache` server's engine cache: every prefix's blocks and max_model_len for each
    of the largest concurrency's requests, in KV space enough for them in fp32 (2 x layers x
    KV heads x head_dim x block x 4 bytes a block), unless --allcache-blocks says."""
    import argparse
    import json

    b = _bench()
    (tmp_path / "config.json").write_text(json.dumps({
        "num_hidden_layers": 6, "hidden_size": 512, "num_attention_heads": 8,
        "num_key_value_heads": 4, "head_dim": 64,
    }))  # fmt: skip
    args = argparse.Namespace(
        allcache_blocks=None, max_model_len=2048, block=32, num_prefixes=64, prefix_len=1024,
        concurrency=[4, 16], engine_blocks=512, kv_space_gib=1,
    )  # fmt: skip
    a = b.allcache_args(args, tmp_path)
    assert a.engine_blocks == 64 * 32 + 16 * 64
    assert a.kv_space_gib == -(-a.engine_blocks * 2 * 6 * 4 * 64 * 32 * 4 // 2**30) + 1 == 3
    assert args.engine_blocks == 512  # the other servers' settings are left alone
    args.allcache_blocks = 100
    assert b.allcache_args(args, tmp_path).engine_blocks == 100
    assert b.kv_config("allcache", tmp_path, args, "") is None  # no connector


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
