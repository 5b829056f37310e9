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
the first format, and two measures of noise: the largest difference between two seeds of one format
(training's randomness), and a 95% interval of the difference from a paired bootstrap over the
prompts (each resample draws prompts with replacement and computes both formats' tau, seeds pooled,
on the same prompts: the evaluation set's sampling). A format is "within noise" when that interval
holds 0 or its difference is no larger than the seed spread. Written to
OUT/store_quality.json. --report-only reads finished runs in OUT again without running anything.
"""

import argparse
import json
import os
import random
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
    run_draftsmith(args.config, run, ["--from", start], sets)
    return run


def run_draftsmith(config: Path, run: Path, stages: list[str], sets: list[str]) -> None:
    """`draftsmith run CONFIG --run RUN STAGES --set ...`, its output in RUN.log beside the run; exits on failure."""
    cmd = [sys.executable, "-m", "draftsmith", "run", str(config), "--run", str(run), *stages]
    for s in sets:
        cmd += ["--set", s]
    print(f"--- {run.name}: {' '.join(cmd[2:])}", flush=True)
    t0 = time.time()
    with open(run.parent / f"{run.name}.log", "a") as logf:
        rc = subprocess.run(cmd, cwd=ROOT, stdout=logf, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        sys.exit(f"{run.name}: draftsmith run exited {rc}; see {run.parent / (run.name + '.log')}")
    print(f"    done in {time.time() - t0:.0f}s", flush=True)


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


def prompt_counts(run: Path) -> dict[str, tuple[int, int]]:
    """Per prompt id: (drafts, accepted tokens) from the evaluation's answers.jsonl."""
    out = {}
    for line in (run / "eval" / "answers.jsonl").read_text().splitlines():
        r = json.loads(line)
        out[r["id"]] = (r["num_drafts"], r["num_accepted_tokens"])
    return out


def paired_bootstrap(a: list[dict], b: list[dict], rounds: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% interval of tau(b) - tau(a) over resampled prompts; a and b: per seed, {id: (drafts, accepted)}."""
    ids = sorted(set.intersection(*(set(c) for c in a + b)))
    rng = random.Random(seed)

    def tau(runs, pick):
        drafts = sum(c[i][0] for c in runs for i in pick)
        return 1 + sum(c[i][1] for c in runs for i in pick) / drafts if drafts else 1.0

    diffs = sorted(tau(b, pick) - tau(a, pick) for pick in ([rng.choice(ids) for _ in ids] for _ in range(rounds)))
    return diffs[int(0.025 * rounds)], diffs[int(0.975 * rounds) - 1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path, required=True)
    p.add_argument("--base", type=Path, required=True, help="A run with generate, prepare and vocab done.")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--formats", nargs="+", default=["bf16", "fp8"])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    p.add_argument("--set", nargs="*", default=[], help="Overrides for every variant, as draftsmith's --set.")
    p.add_argument("--report-only", action="store_true", help="Only read the finished runs in --out.")
    args = p.parse_args()
    args.config, args.base, args.out = args.config.resolve(), args.base.resolve(), args.out.resolve()
    for stage in UPSTREAM:
        if not (args.base / stage / "manifest.json").is_file():
            sys.exit(f"{args.base}: stage {stage} is not done (no {stage}/manifest.json)")

    results: dict[str, list[dict]] = {}
    for fmt in args.formats:
        for seed in args.seeds:
            run = args.out / f"{fmt}-s{seed}" if args.report_only else run_variant(args, fmt, seed, args.seeds[0])
            row = {**read_variant(run), "counts": prompt_counts(run)}
            results.setdefault(fmt, []).append({"seed": seed, **row})

    first = args.formats[0]
    means = {f: sum(r["tau"] for r in rows) / len(rows) for f, rows in results.items()}
    noise = max(max(r["tau"] for r in rows) - min(r["tau"] for r in rows) for rows in results.values())
    r0 = results[first][0]
    print(f"\nstore formats judged by vLLM: {r0['prompts']} {r0['source']} prompts from offset {r0['offset']}, "
          f"K={r0['k']}, {r0['max_tokens']} tokens, {r0['train_steps']} training steps, {r0['store_tokens']:,} tokens stored")
    print("| format | bytes/token | x first | seed | tau | per position | mean tau | vs first | 95% interval (prompts) | within noise |")
    print("| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | --- | --- |")
    intervals = {}
    for fmt, rows in results.items():
        bpt = rows[0]["bytes_per_token"]
        ratio = bpt / results[first][0]["bytes_per_token"]
        d = means[fmt] - means[first]
        lo, hi = intervals[fmt] = paired_bootstrap([r["counts"] for r in results[first]], [r["counts"] for r in rows])
        within = fmt == first or lo <= 0 <= hi or abs(d) <= noise
        for i, r in enumerate(rows):
            pos = " / ".join(f"{a:.2f}" for a in r["per_position"])
            tail = (f"{means[fmt]:.3f} | {d:+.3f} | {lo:+.3f} .. {hi:+.3f} | {'yes' if within else 'no'}" if i == 0 else " | | | ")
            print(f"| {fmt if i == 0 else ''} | {bpt:,.0f} | {ratio:.3f}x | {r['seed']} | {r['tau']:.3f} | {pos} | {tail} |")
    print(f"noise: largest seed-to-seed difference within one format {noise:.3f}; "
          f"paired bootstrap over {len(results[first][0]['counts'])} prompts, 2,000 resamples")
    for rows in results.values():
        for r in rows:
            r.pop("counts")
    out = {"formats": results, "mean_tau": means, "noise": noise, "bootstrap_95": intervals, "sets": args.set,
           "config": str(args.config)}
    (args.out / "store_quality.json").write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
