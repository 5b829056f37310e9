"""Training levers side by side on validation sets: one store, one row per lever, seeds, paired noise.

    .venv/bin/python bench/bench_levers.py --config configs/smollm2-cpu-400.yaml --base runs/s400 \\
        --out runs/levers --states runs/val-mtbench runs/val-sharegpt \\
        --row base= --row ttt5="train.ttt_steps=5" --row top1="train.loss_kl=0.5 train.loss_top1=0.5" ... \\
        [--seeds 0 1] [--set train.max_steps=150 ...] [--k 3] [--report-only]

--base is a run whose generate, prepare, vocab and extract are done; every row trains on that same
store. For each row and seed a run OUT/<row>-s<seed> gets hard links to those four stages, then
`draftsmith run --from train --until export` with train.seed=<seed>, the common --set overrides and the
row's own (space-separated), so rows differ only in what they name. A row whose export is there is not
trained again (--report-only trains nothing).

--states are validation stores built by `bench/quick_tau.py build` (greedy answers of held-out prompts
and their hidden states, e.g. MT-bench 121-160 with --offset 40, or compare.py's
prompts/val-sharegpt.jsonl): each drafter is scored on each by replaying greedy speculative decoding
(quick_tau.score: what `eval --engine local` measures, in seconds instead of a server's minutes).
Choose knobs here; judge the chosen recipe with vLLM and report it on the test sets once.

Printed per row and set: tau per seed, the mean, its difference to the first row, the largest seed-to-seed
difference of the row, and a 95% interval of the difference from a paired bootstrap over the prompts
(seeds pooled); then training steps, minutes and tokens/s from each run's train manifest, since a lever
that costs time per step is only better at equal time if it wins with the steps that time buys.
Written to OUT/levers_<row>_..._k<K>.json, named after the rows compared, so a later report on fewer or
other rows (e.g. --report-only with two of them) never replaces a fuller one.
"""

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

import quick_tau  # noqa: E402  (bench/, beside this script)
from bench_store_quality import link_tree, paired_bootstrap, run_draftsmith  # noqa: E402

UPSTREAM = ("generate", "prepare", "vocab", "extract")


def parse_row(text: str) -> tuple[str, list[str]]:
    name, _, sets = text.partition("=")
    if not name or "/" in name:
        sys.exit(f"--row {text!r}: expected NAME=\"key=value key=value\" (NAME= for no change)")
    return name, sets.split()


def report_path(out: Path, names: list[str], k: int) -> Path:
    """One report file per comparison: the rows in their order (the first is the baseline) and K."""
    return out / f"levers_{'_'.join(names)}_k{k}.json"


def train_row(args, name: str, sets: list[str], seed: int) -> Path:
    run = args.out / f"{name}-s{seed}"
    if (run / "export" / "manifest.json").is_file() or args.report_only:
        return run
    run.mkdir(parents=True, exist_ok=True)
    for stage in UPSTREAM:
        link_tree(args.base / stage, run / stage)
    run_draftsmith(args.config, run, ["--from", "train", "--until", "export"], [f"train.seed={seed}", *args.set, *sets])
    return run


def score_row(args, run: Path) -> dict:
    """Per validation store: quick_tau.score's result (tau, per position, per-prompt counts)."""
    cache = run / "levers_scores.json"
    done = json.loads(cache.read_text()) if cache.is_file() else {}
    for states in args.states:
        key = f"{states.name}:k{args.k}"
        if key not in done:
            r = quick_tau.score(argparse.Namespace(states=str(states), drafter=str(run / "export"), k=args.k,
                                                   target="smollm2-135m", max_tokens=None, limit=None, offset=0))
            r["counts"] = {str(i): list(c) for i, c in r["counts"].items()}
            done[key] = r
    cache.write_text(json.dumps(done))
    return {s.name: done[f"{s.name}:k{args.k}"] for s in args.states}


def train_facts(run: Path) -> dict:
    c = json.loads((run / "train" / "manifest.json").read_text())["counts"]
    minutes = c.get("train_minutes")
    return {"steps": c["done"], "minutes": minutes, "tokens": c["tokens"],
            "tokens_per_s": c["tokens"] / (minutes * 60) if minutes else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path, required=True)
    p.add_argument("--base", type=Path, required=True, help="A run with generate, prepare, vocab and extract done.")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--states", type=Path, nargs="+", required=True, help="Validation stores (quick_tau.py build).")
    p.add_argument("--row", action="append", required=True, help='NAME="key=value ..." (the first row is the baseline)')
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    p.add_argument("--set", nargs="*", default=[], help="Overrides for every row, as draftsmith's --set.")
    p.add_argument("--k", type=int, default=3, help="Draft tokens per verification step in the replay.")
    p.add_argument("--report-only", action="store_true", help="Only read and score the finished runs in --out.")
    args = p.parse_args()
    args.config, args.base, args.out = args.config.resolve(), args.base.resolve(), args.out.resolve()
    args.states = [s.resolve() for s in args.states]
    rows = [parse_row(r) for r in args.row]
    for stage in UPSTREAM:
        if not (args.base / stage / "manifest.json").is_file():
            sys.exit(f"{args.base}: stage {stage} is not done (no {stage}/manifest.json)")
    for s in args.states:
        if not (s / "extract" / "manifest.json").is_file():
            sys.exit(f"{s}: not a validation store (no extract/manifest.json; build it with bench/quick_tau.py build)")
    args.out.mkdir(parents=True, exist_ok=True)

    results: dict[str, list[dict]] = {}
    for name, sets in rows:
        for seed in args.seeds:
            run = train_row(args, name, sets, seed)
            if not (run / "export" / "manifest.json").is_file():
                continue  # --report-only and not trained
            results.setdefault(name, []).append({"seed": seed, "sets": sets, **train_facts(run),
                                                 "scores": score_row(args, run)})
    base = rows[0][0]
    if base not in results:
        sys.exit(f"the baseline row {base} has no finished run in {args.out}")
    summary = {}
    for vs in args.states:
        v = vs.name
        print(f"\n{v}: replayed greedy decoding, K={args.k}; baseline {base}")
        print("| row | tau per seed | mean | vs baseline | seed spread | 95% interval (prompts) | steps | min | tok/s |")
        print("| --- | --- | ---: | ---: | ---: | --- | ---: | ---: | ---: |")
        b_mean = sum(r["scores"][v]["tau"] for r in results[base]) / len(results[base])
        b_counts = [{i: tuple(c) for i, c in r["scores"][v]["counts"].items()} for r in results[base]]
        for name, runs in results.items():
            taus = [r["scores"][v]["tau"] for r in runs]
            mean = sum(taus) / len(taus)
            counts = [{i: tuple(c) for i, c in r["scores"][v]["counts"].items()} for r in runs]
            lo, hi = paired_bootstrap(b_counts, counts) if name != base else (0.0, 0.0)
            spread = max(taus) - min(taus)
            summary.setdefault(name, {})[v] = {"taus": taus, "mean": mean, "diff": mean - b_mean, "spread": spread,
                                               "bootstrap_95": [lo, hi]}
            steps = "/".join(str(r["steps"]) for r in runs)
            mins = "/".join(f"{r['minutes']:.1f}" if r["minutes"] else "?" for r in runs)
            tps = "/".join(f"{r['tokens_per_s']:.0f}" if r["tokens_per_s"] else "?" for r in runs)
            print(f"| {name} | {' / '.join(f'{t:.3f}' for t in taus)} | {mean:.3f} | {mean - b_mean:+.3f} | "
                  f"{spread:.3f} | {lo:+.3f} .. {hi:+.3f} | {steps} | {mins} | {tps} |")
    for runs in results.values():
        for r in runs:
            for sc in r["scores"].values():
                sc.pop("counts", None)
    out = {"rows": results, "summary": summary, "baseline": base, "sets": args.set, "k": args.k,
           "config": str(args.config), "base": str(args.base), "states": [str(s) for s in args.states]}
    path = report_path(args.out, [name for name, _ in rows], args.k)
    path.write_text(json.dumps(out, indent=2))
    print(f"\nwritten: {path}")


if __name__ == "__main__":
    main()
