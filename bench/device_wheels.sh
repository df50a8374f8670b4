#!/usr/bin/env bash
# The wheels bench/device_check.sh installs on a GPU machine that has PyTorch but no network
# and none of tiercache's storage dependencies (the device tool's machines: Python 3.12,
# x86-64). Run here, from the repository root, where pip reaches the package index; the
# files land in .whl/ (ignored by git), which a device run carries and device_check.sh
# installs. PY_VERSION: the target's Python (default 3.12).
set -euo pipefail
PY_VERSION=${PY_VERSION:-3.12}
mkdir -p .whl
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>.git/info/exclude
plats=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 \
    manylinux2014_x86_64 manylinux1_x86_64; do
    plats+=(--platform "$p")
done
# lmdb and zstandard (compiled), redis (pure Python): what the image lacks.
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" \
    --implementation cp "${plats[@]}" -d .whl lmdb zstandard redis
ls .whl
