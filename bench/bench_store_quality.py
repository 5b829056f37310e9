"""Acceptance of drafters trained on each store format, judged by vLLM: does a smaller store cost tau?

    .venv/bin/python bench/bench_store_quality.py --config configs/smollm2-cpu-400.yaml --base runs/s400 \\
        --out runs/store-quality [--formats bf16 fp8] [--seeds 0 1] [--set train.max_steps=150 ...]

--base is a run whose generate, prepare and vocab are done (e.g. `draftsmith run CONFIG --run runs/s400
--until vocab`). For each format and seed a run OUT/<format>-s<seed> gets hard links to those three
stages (and, after the first seed, to that format's store), then `draftsmith run --from extract` (or
`--from train`) with extract.store_format=<format>, train.seed=<seed> and the --set overrides, so
every drafter sees the same samples, the same steps and the same evaluation; only the store format and
the seed differ. The evaluation is the config's (put a validation slice in --set, e.g.
eval.offset=0 eval.limit=40 for MT-bench questions 1-40: choosing a default is choosing a knob).

Printed: bytes per token of each store (extract's manifest: bytes written / tokens), vLLM-measured
acceptance length and per-position acceptance for each seed, the mean per format, its difference to
the first format, and the noise: the largest difference between two seeds of one format. A format is
"within noise" when |mean - first format's mean| <= that noise. Written to OUT/store_quality.json.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
UPSTREAM = ("generate", "prepare", "vocab")


def link_tree(src: Path, dst: Path) -> None:
    """A copy made of hard links: the stores are written by rename, so no run changes another's files."""
    if dst.exists():
        return
    shutil.copytree(src, dst, copy_function=os.link)


def run_variant(args, fmt: str, seed: int, first_seed: int) -> Path:
    run = args.out / f"{fmt}-s{seed}"
    run.mkdir(parents=True, exist_ok=True)
    for stage in UPSTREAM:
        link_tree(args.base / stage, run / stage)
    start = "extract"
    if seed != first_seed:
        link_tree(args.out / f"{fmt}-s{first_seed}" / "extract", run / "extract")
        start = "train"
    sets = [f"extract.store_format={fmt}", f"train.seed={seed}", *args.set]
    cmd = [sys.executable, "-m", "draftsmith", "run", str(args.config), "--run", str(run), "--from", start]
    for s in sets:
        cmd += ["--set", s]
    print(f"--- {run.name}: {' '.join(cmd[2:])}", flush=True)
    t0 = time.time()
    with open(run.parent / f"{run.name}.log", "a") as logf:
        rc = subprocess.run(cmd, cwd=ROOT, stdout=logf, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        sys.exit(f"{run.name}: draftsmith run exited {rc}; see {run.parent / (run.name + '.log')}")
    print(f"    done in {time.time() - t0:.0f}s", flush=True)
    return run


def read_variant(run: Path) -> dict:
    ext = json.loads((run / "extract" / "manifest.json").read_text())
    train = json.loads((run / "train" / "manifest.json").read_text())
    report = json.loads((run / "eval" / "report.json").read_text())
    c = ext["counts"]
    return {"bytes_per_token": c["bytes"] / c["tokens"], "store_tokens": c["tokens"],
            "extract_s": round(ext["finished"] - ext["started"], 1),
            "train_steps": train["counts"]["done"], "train_minutes": train["counts"].get("train_minutes"),
            "tau": report["acceptance_length"], "per_position": report["acceptance_per_position"],
            "prompts": report["prompts"], "offset": report["offset"], "source": report["prompts_source"],
            "max_tokens": report["max_tokens"], "k": report["num_speculative_tokens"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path, required=True)
    p.add_argument("--base", type=Path, required=True, help="A run with generate, prepare and vocab done.")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--formats", nargs="+", default=["bf16", "fp8"])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    p.add_argument("--set", nargs="*", default=[], help="Overrides for every variant, as draftsmith's --set.")
    args = p.parse_args()
    args.config, args.base, args.out = args.config.resolve(), args.base.resolve(), args.out.resolve()
    for stage in UPSTREAM:
        if not (args.base / stage / "manifest.json").is_file():
            sys.exit(f"{args.base}: stage {stage} is not done (no {stage}/manifest.json)")

    results: dict[str, list[dict]] = {}
    for fmt in args.formats:
        for seed in args.seeds:
            row = read_variant(run_variant(args, fmt, seed, args.seeds[0]))
            results.setdefault(fmt, []).append({"seed": seed, **row})

    first = args.formats[0]
    means = {f: sum(r["tau"] for r in rows) / len(rows) for f, rows in results.items()}
    noise = max(max(r["tau"] for r in rows) - min(r["tau"] for r in rows) for rows in results.values())
    r0 = results[first][0]
    print(f"\nstore formats judged by vLLM: {r0['prompts']} {r0['source']} prompts from offset {r0['offset']}, "
          f"K={r0['k']}, {r0['max_tokens']} tokens, {r0['train_steps']} training steps, {r0['store_tokens']:,} tokens stored")
    print("| format | bytes/token | x first | seed | tau | per position | mean tau | vs first | within noise |")
    print("| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | --- |")
    for fmt, rows in results.items():
        bpt = rows[0]["bytes_per_token"]
        ratio = bpt / results[first][0]["bytes_per_token"]
        d = means[fmt] - means[first]
        for i, r in enumerate(rows):
            pos = " / ".join(f"{a:.2f}" for a in r["per_position"])
            tail = (f"{means[fmt]:.3f} | {d:+.3f} | {'yes' if abs(d) <= noise else 'no'}" if i == 0 else " | | ")
            print(f"| {fmt if i == 0 else ''} | {bpt:,.0f} | {ratio:.3f}x | {r['seed']} | {r['tau']:.3f} | {pos} | {tail} |")
    print(f"noise (largest seed-to-seed difference within one format): {noise:.3f}")
    out = {"formats": results, "mean_tau": means, "noise": noise, "sets": args.set, "config": str(args.config)}
    (args.out / "store_quality.json").write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
