#!/usr/bin/env bash
# The GPU check (issues 39, 55), one command on the GPU machine as it is (Python 3.12, torch with CUDA,
# transformers; no vLLM, pydantic or gguf; no network):
#     bash bench/device_check.sh "$OUT"            (the device tool: carry bench/device/wheels)
# 1. an import probe; what is missing is installed from bench/device/wheels (--no-index), never the network;
# 2. the parts of bench/device_check.py, each in its own process under its own timeout, each writing
#    OUT/<part>.json as its checks end: every stage on the device (a tiny random target built there), then
#    online training; DDP and FSDP2 through a process group with a save and a resume; flex against SDPA
#    for every GPU recipe's drafter; a real training step's peak memory beside the fake-tensor one;
#    training tokens/s at Llama-8B widths; a soak of the Kimi-K2.5 MLA and Llama-8B drafters at their
#    widths through the real data path; extraction's host side on connector files in /dev/shm;
# 3. one summary line, and OUT/device_check.json with every figure. 540 s of parts at most: under 10 minutes.
# Without CUDA it runs the same parts at CPU sizes (the rehearsal, tests/test_device_check.py).
# Exit status: 0 when every part passed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-/tmp/draftsmith-device-check}}
PY=${PYTHON:-python3}
WHEELS=${DEVICE_WHEELS:-bench/device/wheels}
mkdir -p "$OUT"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/draftsmith-device-check.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
export PYTHONUNBUFFERED=1

missing=$("$PY" bench/device_check.py probe) || exit 1
if [ -n "$missing" ]; then
    echo "device check: installing $missing from $WHEELS (no index)"
    if "$PY" -m pip --version >/dev/null 2>&1; then
        "$PY" -m pip install --quiet --no-warn-conflicts --no-index --find-links "$WHEELS" --target "$WORK/site" $missing
    else  # an environment made without pip (uv): a wheel is a zip laid out for site-packages
        "$PY" -c "import glob, sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sorted(glob.glob(sys.argv[2] + '/*.whl'))]" "$WORK/site" "$WHEELS"
    fi
    if ! PYTHONPATH="$WORK/site" "$PY" -c "import pydantic" 2>/dev/null; then
        echo "device check: the carried wheels do not provide $missing for $("$PY" -V) (bash bench/device/fetch_wheels.sh)" >&2
        exit 1
    fi
fi
export PYTHONPATH="$WORK/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"

status=0
# part:seconds, 9 minutes at most together (the GPU machine's command limit is 10). DEVICE_PARTS picks some (the
# suite's rehearsal, tests/test_device_check.py, leaves out `online` and `ranks`, which its other tests cover);
# DEVICE_TIMEOUT_SCALE stretches the limits for a slow CPU's full rehearsal (e.g. 4)
for part in ${DEVICE_PARTS:-pipeline:130 online:40 ranks:90 flex:80 memory:45 speed:30 soak:95 extract:30}; do
    name=${part%%:*}
    limit=$(( ${part##*:} * ${DEVICE_TIMEOUT_SCALE:-1} ))
    echo "== $name (at most ${limit}s)"
    timeout --kill-after=10 "$limit" "$PY" bench/device_check.py "$name" --out "$OUT" --work "$WORK" || status=1
    ran="${ran:-}${ran:+ }$name"
done
"$PY" bench/device_check.py summary --out "$OUT" --parts "$ran" || status=1
exit $status
