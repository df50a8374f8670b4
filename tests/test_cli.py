"""The `tiercache` command line: the demo on its embedded config, and one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from tiercache.cli import main


def test_demo_json(tmp_path) -> None:
    r = CliRunner().invoke(
        main, ["demo", "--requests", "60", "--json", "--dir", str(tmp_path / "d")]
    )
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["requests"] == 60 and out["mismatched"] == 0
    assert out["verified"] == out["hit_blocks"] > 0
    assert 0 < out["hit_rate"] < 1 and out["memcpy_gbps_same_run"] > 0
    assert "cpu" in out["tiers"]


def test_demo_is_deterministic(tmp_path) -> None:
    runs = [
        json.loads(
            CliRunner()
            .invoke(main, ["demo", "--requests", "40", "--json", "--dir", str(tmp_path / str(i))])
            .stdout
        )
        for i in range(2)
    ]
    assert runs[0]["hit_blocks"] == runs[1]["hit_blocks"]
    assert runs[0]["tiers"]["cpu"]["hits"] == runs[1]["tiers"]["cpu"]["hits"]


def test_demo_with_user_config(tmp_path) -> None:
    p = tmp_path / "c.toml"
    p.write_text('block_size = 16\nnamespace = "x"\n[[tiers]]\nkind = "cpu"\nblocks = 64\n')
    r = CliRunner().invoke(main, ["demo", "--requests", "20", "--config", str(p)])
    assert r.exit_code == 0, r.output
    assert "verified" in r.output


def test_errors_are_one_line(tmp_path) -> None:
    p = tmp_path / "c.toml"
    p.write_text('[[tiers]]\nkind = "tape"\nblocks = 4\n')
    r = CliRunner().invoke(main, ["demo", "--requests", "5", "--config", str(p)])
    assert r.exit_code == 2
    (line,) = r.output.strip().splitlines()
    assert line.startswith("tiercache: error: tiers[0].kind: unknown tier kind 'tape'")


def test_console_script_entry_point(tmp_path) -> None:
    exe = Path(sys.executable).with_name("tiercache")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "tiercache"]
    r = subprocess.run(
        [*cmd, "demo", "--requests", "10", "--json", "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONHASHSEED": "123"},
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["mismatched"] == 0
    h = subprocess.run([*cmd, "--help"], capture_output=True, text=True, timeout=60)
    assert "Example" in h.stdout and "demo" in h.stdout
