"""The README's quickstart config is valid, it stays short, and its commands are the CI's."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from tiercache import CacheConfig

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_readme_quickstart_config_validates() -> None:
    block = re.search(r"```toml\n(.*?)```", README, re.S)
    assert block is not None
    config = CacheConfig.from_mapping(tomllib.loads(block.group(1)))
    assert [t.kind for t in config.tiers] == ["cpu", "nvme"]


def test_readme_is_a_front_door() -> None:
    assert len(README.splitlines()) <= 300


def test_ci_runs_the_readme_test_command_verbatim() -> None:
    commands = re.findall(r"```sh\n(.*?)\n```", README, re.S)
    test_cmd = next(c for c in commands if c.startswith("python3 -m venv") and "[test]" in c)
    assert "pytest" in test_cmd
    assert test_cmd in (ROOT / ".ci" / "run").read_text()
