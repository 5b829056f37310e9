#!/usr/bin/env bash
# The wheels bench/device_check.sh carries to the GPU machine, which has no network and no pydantic
# (../shared/FACTS.md): pydantic and what it needs, typing-extensions included (pip --target resolves
# from the carried folder alone, and pydantic may want a newer one than the machine has), for CPython 3.12
# (the GPU machine) and for this machine's Python (the CPU rehearsal in tests/test_device_check.py installs from the same folder with
# --no-index, so a wheel missing here fails here, not on the GPU). About 5 MB in bench/device/wheels/
# (ignored by git; the `run` tool's `carry` takes it along).
#     bash bench/device/fetch_wheels.sh [PYTHON]
set -euo pipefail
# the interpreter is resolved before the cd below: a caller's relative path (setup.sh passes .venv/bin/python) is
# relative to the caller's directory
PY=$(realpath "${1:-$(dirname "$0")/../../.venv/bin/python}")
cd "$(dirname "$0")"
mkdir -p wheels
# pydantic with its dependencies as pip resolves them (its exact pydantic-core pin included)
"$PY" -m pip download --quiet --only-binary=:all: --python-version 3.12 \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d wheels pydantic
"$PY" -m pip download --quiet --only-binary=:all: -d wheels pydantic   # this machine's own Python
ls -l wheels
