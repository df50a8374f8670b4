"""tiercache's log lines in vLLM's log (`follow_vllm_logging`), for the three adapters."""

from __future__ import annotations

import logging


def follow_vllm_logging() -> None:
    """Let tiercache's log lines reach vLLM's log. vLLM configures its own logger only
    ("vllm", which does not propagate), so without this tiercache's INFO lines (the store a
    connector opened, a wait for memory, a format upgrade) went nowhere: the root logger has
    no handler, and Python's last resort prints warnings only. Where nothing configured
    tiercache's logging (no handler on its logger or above), it takes vLLM's handlers and
    level; a user's own configuration, or a VLLM_LOGGING_CONFIG_PATH naming tiercache's
    loggers, is left alone. Each adapter calls it when vLLM builds it: vLLM configures its
    logging at each process's start, before it builds connectors (no vLLM import here)."""
    ours, theirs = logging.getLogger("tiercache"), logging.getLogger("vllm")
    if ours.hasHandlers() or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    if ours.level == logging.NOTSET:
        ours.setLevel(theirs.getEffectiveLevel())
