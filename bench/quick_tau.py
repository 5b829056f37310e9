"""Acceptance length in seconds, for comparing training recipes: replay greedy decoding offline.

At temperature 0 a drafter's acceptance on a prompt is fixed by the target's greedy answer: at each
verification step the drafter, given the target's hidden states up to the last verified token,
drafts K tokens; the leading ones equal to the answer's next tokens are accepted, the target adds
one of its own, and the next step starts after them. So once the target's greedy answers and their
hidden states are on disk (an extract store of held-out prompts), one training-time-test forward
per answer gives every position's K-token chain at once (Eagle3Drafter.ttt_forward, tested equal
to cached chain drafting), and walking the answer step by step gives the tau that `eval --engine
local` measures in float32 with the same answers, without decoding anything.

    # once: greedy answers of MT-bench questions 81-120 (first turns, 128 tokens) and their states
    .venv/bin/python bench/quick_tau.py build --run runs/mtbench-81-120
    # a validation set to choose knobs on: MT-bench 121-160, or any prompt file
    .venv/bin/python bench/quick_tau.py build --run runs/val-mtbench --offset 40
    # per drafter (an export folder, or a run whose export/ it uses)
    .venv/bin/python bench/quick_tau.py score --states runs/mtbench-81-120 --drafter runs/cpu

These prompts are evaluation prompts: the store is for scoring only, never for training (the
recipes' training sets are checked against them in tests/test_recipes.py).
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from draftsmith.export import load_exported  # noqa: E402
from draftsmith.extract.store import ExtractStore  # noqa: E402
from draftsmith.target import target_info  # noqa: E402
from draftsmith.train.drafter import read_target_weights  # noqa: E402

EVAL_SET = """\
# The greedy answers the target gives to held-out prompts (first turns), as eval asks them.
target: smollm2-135m
generate:
  backend: local
  prompts: {prompts}
  limit: {limit}
  offset: {offset}
  first_turn_only: true
  max_tokens: {max_tokens}
  temperature: 0.0
  batch_size: 8
"""
STORE = """\
extract:
  store_format: bf16        # scoring states as close to the engines' as the store holds them
"""
LAYERS = """\
  layers: {layers}          # the auxiliary layers of the drafters it will score
"""


def build(args) -> None:
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(EVAL_SET.format(prompts=json.dumps(args.prompts), limit=args.limit, offset=args.offset,
                                max_tokens=args.max_tokens))
        f.write(STORE)
        if args.layers:
            f.write(LAYERS.format(layers=json.dumps([int(x) for x in args.layers.split(",")])))
    cmd = [sys.executable, "-m", "draftsmith", "run", f.name, "--run", args.run, "--until", "extract"]
    print("$", " ".join(cmd), flush=True)
    sys.exit(subprocess.call(cmd, cwd=ROOT))


def walk(correct: torch.Tensor, start: int, end: int) -> tuple[int, int, list[int]]:
    """correct [K, L] bool: correct[k, i] = step k's draft at index i equals the answer's token.

    The target's first answer token (index `start`) comes from the prefill; each verification
    step then starts at the latest verified token p, whose chain sits at index p - 1. Returns
    (verification steps, tokens they produced, accepted count per draft position)."""
    K = correct.shape[0]
    steps = produced = 0
    per_pos = [0] * K
    p = start
    while p < end:
        m = 0
        while m < K and p + 1 + m < end and bool(correct[m, p - 1]):
            m += 1
        for k in range(m):
            per_pos[k] += 1
        steps += 1
        produced += m + 1
        p += m + 1
    return steps, produced, per_pos


@torch.no_grad()
def score(args) -> dict:
    store = ExtractStore(args.states)
    folder = Path(args.drafter)
    if (folder / "export").is_dir():
        folder = folder / "export"
    info = target_info(args.target)
    if info.fingerprint != store.meta.get("target_fingerprint"):
        sys.exit(f"{store.dir}: extracted from another target than {args.target}")
    embed, _, _ = read_target_weights(info, log=lambda *a: None)
    drafter, exported = load_exported(folder, target_info=info, embed_weight=embed, dtype=torch.float32)
    if list(exported["aux_layers"]) != list(store.layers):
        sys.exit(f"{folder}: drafter reads layers {exported['aux_layers']}, the store holds {store.layers}")
    K = args.k
    t0 = time.time()
    steps = produced = 0
    per_pos = [0] * K
    counts = {}  # store index -> (verification steps, accepted drafts): for paired comparisons over prompts
    first = min(args.offset, len(store))
    n_prompts = min(len(store) - first, args.limit or len(store))
    for i in range(first, first + n_prompts):
        s = store[i]
        ids = s["input_ids"].long()[None]  # [1, L]
        L = ids.shape[1]
        aux = s["aux_hidden"].float().reshape(1, L, -1)  # stored bf16 [L, 3, H] -> [1, L, 3H]
        answer = s["loss_mask"].bool().nonzero().flatten()
        if answer.numel() == 0:
            continue
        start, end = int(answer[0]), int(answer[-1]) + 1
        if args.max_tokens:
            end = min(end, start + args.max_tokens)
        logits = drafter.ttt_forward(ids, aux, K, attn_block=None)  # K x [1, L, Dv]
        correct = torch.zeros(K, L, dtype=torch.bool)
        for k, lg in enumerate(logits):
            pred = lg[0].argmax(-1)
            pred = pred + drafter.d2t[pred]
            n = L - 2 - k
            if n > 0:
                correct[k, :n] = pred[:n] == ids[0, 2 + k:]
        a, b, c = walk(correct, start, end)
        counts[i] = (a, b - a)
        steps, produced = steps + a, produced + b
        per_pos = [x + y for x, y in zip(per_pos, c)]
    out = {"tau": produced / steps, "per_position": [round(x / steps, 4) for x in per_pos],
           "verification_steps": steps, "tokens": produced, "prompts": n_prompts, "k": K,
           "drafter": str(folder), "seconds": round(time.time() - t0, 1)}
    print(json.dumps(out), flush=True)
    return {**out, "counts": counts}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="greedy answers + hidden states of held-out prompts")
    b.add_argument("--run", required=True)
    b.add_argument("--prompts", default="mt-bench",
                   help="as generate.prompts: a packaged set or a JSONL file (e.g. compare.py's prompts/val-sharegpt.jsonl)")
    b.add_argument("--offset", type=int, default=0, help="skip the first N prompts (40: MT-bench 121-160, validation)")
    b.add_argument("--limit", type=int, default=40)
    b.add_argument("--max-tokens", type=int, default=128)
    b.add_argument("--layers", default=None, help="aux layer ids, e.g. 2,15,29 (default: the target's default)")
    s = sub.add_parser("score", help="replay greedy speculative decoding for a drafter")
    s.add_argument("--states", required=True, help="a run built by `build` (its extract/)")
    s.add_argument("--drafter", required=True, nargs="+", help="export folder(s), or run(s) with export/")
    s.add_argument("--k", type=int, default=3)
    s.add_argument("--target", default="smollm2-135m")
    s.add_argument("--max-tokens", type=int, default=None, help="replay only the first N answer tokens")
    s.add_argument("--limit", type=int, default=None, help="only the first N samples of the store")
    s.add_argument("--offset", type=int, default=0, help="skip the store's first N samples (e.g. a run's training prompts)")
    args = ap.parse_args()
    if args.cmd == "build":
        build(args)
    else:
        for d in args.drafter:
            score(argparse.Namespace(states=args.states, drafter=d, k=args.k, target=args.target,
                                     max_tokens=args.max_tokens, limit=args.limit, offset=args.offset))


if __name__ == "__main__":
    main()
