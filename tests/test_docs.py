"""The README and docs/ against the code: every metric the code registers and every config
option is documented (and nothing else is), every TOML block parses and tiercache configs
validate, every shell block passes `bash -n`, and no machine path or work narration appears."""

from __future__ import annotations

import re
import subprocess
import tomllib
from pathlib import Path

import pytest

from tiercache import CacheConfig
from tiercache import config as config_module
from tiercache.tiers import available_kinds, tier_class
from tiercache.transfer.stats import PrometheusMetrics

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _blocks(lang: str) -> list[tuple[str, str]]:
    out = []
    for path in DOCS:
        for m in re.finditer(rf"^```{lang}\n(.*?)^```", path.read_text(), re.S | re.M):
            out.append((path.name, m.group(1)))
    return out


def _section(text: str, heading: str) -> str:
    """The text under `heading` up to the next heading of the same or a higher level."""
    level = len(heading) - len(heading.lstrip("#"))
    start = text.index(heading + "\n") + len(heading) + 1
    end = re.search(rf"^#{{1,{level}}} ", text[start:], re.M)
    return text[start : start + end.start()] if end else text[start:]


def _first_column(table: str) -> set[str]:
    return set(re.findall(r"^\| `([^`]+)` \|", table, re.M))


def test_metrics_reference_lists_every_registered_metric() -> None:
    documented = _first_column(_section((ROOT / "docs/operations.md").read_text(), "## Metrics"))
    registered = set()
    for family in PrometheusMetrics().registry.collect():
        registered.add(family.name + "_total" if family.type == "counter" else family.name)
    assert registered, "no metric registered"
    assert documented == registered


def test_configuration_reference_lists_every_option() -> None:
    ref = _section((ROOT / "docs/configuration.md").read_text(), "## Reference")
    expected = {
        "### Top level": config_module._TOP_KEYS,
        "### Every tier": config_module._TIER_COMMON_KEYS,
        "### `[telemetry]`": config_module._TELEMETRY_KEYS,
        "### `[deadlines]`": config_module._DEADLINE_KEYS,
        "### `[loading]`": config_module._LOADING_KEYS,
    }
    for kind in available_kinds():
        expected[f'### `kind = "{kind}"`'] = set(tier_class(kind).OPTIONS)
    for heading, keys in expected.items():
        assert _first_column(_section(ref, heading)) == set(keys), heading


@pytest.mark.parametrize(("name", "block"), _blocks("toml"))
def test_toml_blocks_parse_and_configs_validate(name: str, block: str) -> None:
    data = tomllib.loads(block)
    if "tiers" in data:  # a tiercache config (a vLLM one gets block_size and namespace)
        CacheConfig.load(data)


@pytest.mark.parametrize(("name", "block"), _blocks("(?:sh|bash)"))
def test_shell_blocks_parse(name: str, block: str) -> None:
    proc = subprocess.run(["bash", "-n"], input=block, capture_output=True, text=True)
    assert proc.returncode == 0, f"{name}: {proc.stderr}\n{block}"


MACHINE_PATH = re.compile(r"(/work/|/root/|/home/\w|/tmp/(?!\w*\.json)|\.\./shared|\.venv\S*/bin/)")
NARRATION = re.compile(
    r"(\bissue \d+|\bissue-\d+|\bthis session|\bwork period|\bsessions? (get|got|ran)"
    r"|\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,12}\b)"
)


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_no_machine_paths_or_narration(path: Path) -> None:
    text = path.read_text()
    if path.name == "README.md":  # its Development section names the checkout's venv
        text = text[: text.index("## Development")]
    if path.name == "development.md":
        text = MACHINE_PATH.sub("", text.replace(".venv", "VENV"))
    bad = [m.group(0) for m in MACHINE_PATH.finditer(text)]
    bad += [m.group(0) for m in NARRATION.finditer(text)]
    assert not bad, f"{path.name}: {sorted(set(bad))}"


def test_relative_links_resolve() -> None:
    for path in DOCS:
        for target in re.findall(r"\]\(([^)#:\s]+)(?:#[^)]*)?\)", path.read_text()):
            assert (path.parent / target).exists(), f"{path.name} links to missing {target}"
