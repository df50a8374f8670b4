"""The AMX tile priming of the vLLM adapters (`tiercache/connectors/amx.py`, issue 36): it
runs only for a CPU engine with a 16-bit KV cache on a host whose CPU flags name `amx_tile`,
and nowhere else. /proc/cpuinfo is injected as text or as a file (tests/data/cpuinfo-*.txt),
so this runs on any host; the engine restart it protects is `tests/vllm/test_amx_restart.py`
(AMX hosts only)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tiercache.connectors import amx

# Trimmed from real /proc/cpuinfo: a Sapphire Rapids (AMX) and an AMD EPYC (none).
SAPPHIRE_RAPIDS = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu vme de pse avx512f avx512_bf16 amx_bf16 avx512_fp16 amx_tile amx_int8 arch_lbr
bugs\t\t: spectre_v1
"""
EPYC = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 9R14 96-Core Processor
flags\t\t: fpu vme de pse avx512f avx512_bf16 avx512vl
bugs\t\t: sysret_ss_attrs
"""
# A flag that only contains the name, and the name outside the flags line, are not AMX.
LOOKALIKES = """processor\t: 0
model name\t: amx_tile lookalike
flags\t\t: fpu amx_tile_x xamx_tile amx_bf16
"""
ARM = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes sve\n"


@pytest.mark.parametrize(
    ("cpuinfo", "expected"),
    [(SAPPHIRE_RAPIDS, True), (EPYC, False), (LOOKALIKES, False), (ARM, False), ("", False)],
)
def test_host_has_amx_reads_the_flags_line(cpuinfo: str, expected: bool) -> None:
    assert amx.host_has_amx(cpuinfo) is expected


DATA = Path(__file__).parent / "data"


@pytest.mark.parametrize(
    ("fixture", "expected"),
    [("cpuinfo-sapphire-rapids.txt", True), ("cpuinfo-epyc.txt", False)],
)
def test_host_has_amx_reads_the_file_it_is_pointed_at(
    fixture: str, expected: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whole /proc/cpuinfo files (an 8480+ guest with `amx_tile` and `amx_bf16`, and this
    project's AMD EPYC CI/dev hosts, two processors each) read from disk by the default path:
    the answer follows the file, so a default that never reads it cannot pass both."""
    text = (DATA / fixture).read_text()
    assert amx.host_has_amx(text) is expected
    monkeypatch.setattr(amx, "CPUINFO", DATA / fixture)
    assert amx.host_has_amx() is expected
    assert amx.needs_tile_config("cpu", torch.bfloat16) is expected


def test_host_has_amx_reads_proc_cpuinfo_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Path("/proc/cpuinfo") == amx.CPUINFO
    reads: list[Path] = []
    real = Path.read_text

    def spy(self: Path, *a: object, **kw: object) -> str:
        reads.append(self)
        return real(self, *a, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(Path, "read_text", spy)
    try:
        text = real(Path("/proc/cpuinfo"))
    except OSError:
        assert amx.host_has_amx() is False  # unreadable: no AMX claimed
        return
    assert amx.host_has_amx() is amx.host_has_amx(text)
    assert reads == [Path("/proc/cpuinfo")]  # the default read it, once; given text, nothing


def test_host_has_amx_is_false_where_cpuinfo_cannot_be_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(amx, "CPUINFO", tmp_path / "missing")
    assert amx.host_has_amx() is False


@pytest.mark.parametrize(
    "kv_dtype", [torch.bfloat16, torch.float16, "bfloat16", "float16", "torch.bfloat16", "half"]
)
def test_needed_on_a_cpu_engine_with_16_bit_kv_on_an_amx_host(kv_dtype: object) -> None:
    assert amx.needs_tile_config("cpu", kv_dtype, SAPPHIRE_RAPIDS)  # type: ignore[arg-type]
    assert amx.needs_tile_config(torch.device("cpu"), kv_dtype, SAPPHIRE_RAPIDS)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("device", "kv_dtype", "cpuinfo"),
    [
        ("cuda", torch.bfloat16, SAPPHIRE_RAPIDS),  # a GPU engine: no vLLM-cpu kernel
        ("cuda:1", "bfloat16", SAPPHIRE_RAPIDS),
        ("cpu", torch.float32, SAPPHIRE_RAPIDS),  # fp32 KV: another attention kernel
        ("cpu", "float32", SAPPHIRE_RAPIDS),
        ("cpu", "auto", SAPPHIRE_RAPIDS),
        ("cpu", "fp8_e4m3", SAPPHIRE_RAPIDS),  # 8-bit KV
        ("cpu", torch.uint8, SAPPHIRE_RAPIDS),
        ("cpu", torch.int8, SAPPHIRE_RAPIDS),  # a canonical int8 view is no KV dtype
        ("cpu", torch.bfloat16, EPYC),  # no AMX on the host
        ("cpu", torch.bfloat16, ARM),
    ],
)
def test_not_needed_elsewhere(device: str, kv_dtype: object, cpuinfo: str) -> None:
    assert not amx.needs_tile_config(device, kv_dtype, cpuinfo)  # type: ignore[arg-type]


def test_prime_runs_one_bf16_matmul_only_where_needed(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[torch.dtype, tuple[int, ...]]] = []
    real = torch.matmul

    def spy(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        calls.append((a.dtype, tuple(a.shape)))
        return real(a, b)

    monkeypatch.setattr(torch, "matmul", spy)
    assert amx.prime_amx_tiles("cpu", torch.bfloat16, SAPPHIRE_RAPIDS) is True
    assert calls == [(torch.bfloat16, (128, 128))]
    # fp16 KV primes with the same bf16 matmul: what configures the tiles.
    assert amx.prime_amx_tiles("cpu", "float16", SAPPHIRE_RAPIDS) is True
    assert calls == [(torch.bfloat16, (128, 128))] * 2
    for device, kv_dtype, cpuinfo in [
        ("cpu", torch.bfloat16, EPYC),
        ("cpu", torch.float32, SAPPHIRE_RAPIDS),
        ("cuda", torch.bfloat16, SAPPHIRE_RAPIDS),
    ]:
        assert amx.prime_amx_tiles(device, kv_dtype, cpuinfo) is False
    assert len(calls) == 2  # nothing ran where it is not needed


def test_not_needed_reads_no_cpuinfo_for_a_gpu_or_fp32_engine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Cost nothing elsewhere: /proc/cpuinfo is read only for a CPU engine with 16-bit KV."""
    reads: list[object] = []
    monkeypatch.setattr(amx, "host_has_amx", lambda cpuinfo=None: reads.append(cpuinfo) or True)
    assert not amx.needs_tile_config("cuda", torch.bfloat16)
    assert not amx.needs_tile_config("cpu", torch.float32)
    assert reads == []
    assert amx.needs_tile_config("cpu", torch.bfloat16)
    assert reads == [None]
