"""tiercache's log lines in vLLM's log (`tiercache.connectors.vllm_logging`): vLLM configures
only its own, non-propagating logger, so a connector's INFO lines (the store it opened, a
wait for memory) went nowhere in `vllm serve`. Each case is a fresh process, as vLLM's
engine core and workers are: vLLM configures logging at a process's start (`_CONFIGURE`,
the way its engine core does), then builds the connector (which calls
`follow_vllm_logging`)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm")

_CONFIGURE = (
    "import vllm.logger as vl\n"
    "if hasattr(vl, 'configure_logging'):  # vLLM 0.32 on: each process configures at start\n"
    "    from vllm.config.logging import LoggingConfig\n"
    "    vl.configure_logging(LoggingConfig())\n"
    "from tiercache.connectors.vllm_logging import follow_vllm_logging\n"
    "follow_vllm_logging()\n"
    "follow_vllm_logging()  # every adapter calls it: once is enough\n"
)


def _run(code: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "VLLM_LOGGING_STREAM": "ext://sys.stdout"}
    env.pop("VLLM_LOGGING_CONFIG_PATH", None)
    env.pop("VLLM_CONFIGURE_LOGGING", None)
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )


def test_tiercache_info_lines_go_where_vllms_lines_go() -> None:
    code = _CONFIGURE + (
        "import logging\n"
        "logging.getLogger('tiercache.tiers.nvme').info('tiercache-info-line')\n"
        "logging.getLogger('tiercache.tiers.nvme').debug('tiercache-debug-line')\n"
        "logging.getLogger('vllm.x').info('vllm-info-line')\n"
    )
    r = _run(code)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "vllm-info-line" in r.stdout, (r.stdout[-2000:], r.stderr[-2000:])
    assert r.stdout.count("tiercache-info-line") == 1  # vLLM's stream and format, once
    assert "tiercache-debug-line" not in r.stdout + r.stderr  # vLLM's level: INFO


def test_a_users_own_logging_configuration_is_left_alone() -> None:
    """A root handler set before (the user's): tiercache's logger takes nothing of vLLM's,
    and its lines go to the user's handler, once."""
    code = (
        "import logging, sys\n"
        "logging.basicConfig(stream=sys.stderr, level=logging.INFO, format='ROOT %(message)s')\n"
        + _CONFIGURE
        + "assert logging.getLogger('tiercache').handlers == []\n"
        "logging.getLogger('tiercache.cache').info('tiercache-info-line')\n"
    )
    r = _run(code)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stderr.count("ROOT tiercache-info-line") == 1, r.stderr[-2000:]
    assert "tiercache-info-line" not in r.stdout
