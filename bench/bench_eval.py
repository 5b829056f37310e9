"""Evaluate a finished run's drafter with both engines: acceptance length and speedup, local vs vLLM.

    .venv/bin/python bench/bench_eval.py --run runs/demo [--limit 80] [--max-tokens 128] [--k 3]

Reads RUN/export (the drafter) and RUN/export/config.yaml (the target and dtype the run used) and
evaluates the export on MT-bench first turns at temperature 0 with K draft tokens, once per engine,
each in its own temporary run folder (RUN/eval is left alone):

- local: draftsmith's speculative decoding with the transformers target in-process (`dtype` of the
  run, `auto` unless it set one, which picks float32 or bfloat16 by what is fast on the machine),
  baseline = the same target decoding one token per forward, right after each prompt;
- vllm: a vLLM server with the drafter (`dtype`, `auto` = bfloat16; --enforce-eager), baseline = a
  second server with the same settings and no drafting; one request at a time, counts from /metrics
  around each request.
--dtype sets both (e.g. float32: both engines then follow the same greedy path, and their acceptance
lengths should match to the last digit).

Prints, per engine, acceptance length, acceptance per position, tokens/s with and without drafting
and the speedup, plus how often the two engines produced the same answer. Tokens/s are per request
(one at a time), prefill included. The numbers are only meaningful on a quiet machine: check
`uptime` first; each engine's baseline runs at a different moment from its drafting run.
"""

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from draftsmith import DraftsmithError  # noqa: E402
from draftsmith.config import load_config  # noqa: E402
from draftsmith.eval.stage import run_eval  # noqa: E402
from draftsmith.rundir import RunDir  # noqa: E402


def engine_run(src: RunDir, dest: Path) -> RunDir:
    """A fresh run folder holding only what eval reads: run.json, export/ and train/metrics.jsonl."""
    dest.mkdir(parents=True)
    shutil.copy2(src.path / "run.json", dest / "run.json")
    shutil.copytree(src.path / "export", dest / "export")
    metrics = src.path / "train" / "metrics.jsonl"
    if metrics.is_file():
        (dest / "train").mkdir()
        shutil.copy2(metrics, dest / "train" / "metrics.jsonl")
    return RunDir(dest)


def fmt(x, spec=".2f"):
    return "n/a" if x is None else format(x, spec)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", required=True, type=Path, help="A run whose export stage is done (e.g. the demo's).")
    ap.add_argument("--prompts", default="mt-bench")
    ap.add_argument("--limit", type=int, default=None, help="How many prompts (default all 80).")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    ap.add_argument("--engines", default="local,vllm")
    ap.add_argument("--dtype", default=None, help="dtype of both engines (default: the run's; auto = bf16 for vLLM).")
    ap.add_argument("--threads", type=int, default=None, help="torch threads for the local engine.")
    ap.add_argument("--out", type=Path, default=None, help="Also write the reports here (JSON).")
    ap.add_argument("--keep", action="store_true", help="Keep the temporary run folders (answers, server logs).")
    args = ap.parse_args()

    src = RunDir(args.run)
    if src.read_manifest("export") is None:
        raise SystemExit(f"{args.run}: no finished export stage (run the pipeline first, e.g. draftsmith demo)")
    base_cfg = src.path / "export" / "config.yaml"
    sets = ["eval.prompts=" + args.prompts, f"eval.max_tokens={args.max_tokens}",
            f"eval.num_speculative_tokens={args.k}", "eval.temperature=0", "eval.baseline=true", "eval.offset=0", "eval.server=null"]
    if args.limit:
        sets.append(f"eval.limit={args.limit}")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)

    tmp = Path(tempfile.mkdtemp(prefix="bench-eval-"))
    reports, answers = {}, {}
    try:
        for engine in args.engines.split(","):
            more = [f"eval.engine={engine}"] + ([f"dtype={args.dtype}"] if args.dtype else [])
            cfg = load_config(base_cfg if base_cfg.is_file() else None, sets + more)
            run = engine_run(src, tmp / engine)
            t0 = time.time()
            run_eval(run, cfg)
            wall = time.time() - t0
            reports[engine] = json.loads((run.path / "eval" / "report.json").read_text())
            reports[engine]["bench_wall_s"] = round(wall, 1)
            answers[engine] = [json.loads(x) for x in (run.path / "eval" / "answers.jsonl").read_text().splitlines()]
    except DraftsmithError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if args.keep:
            print(f"run folders kept in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)

    r0 = next(iter(reports.values()))
    print(f"\n{args.run}: {r0['prompts']} prompts of {args.prompts}, K={args.k}, temperature 0, "
          f"max_tokens {args.max_tokens}, target {r0['target']}")
    print(f"{'engine':<8} {'dtype':<9} {'tau':>5}  {'per position':<18} {'tok/s':>7} {'plain':>7} {'speedup':>7} "
          f"{'same as plain':>13} {'wall s':>7}")
    for engine, r in reports.items():
        same = r.get("greedy_same_as_baseline")
        print(f"{engine:<8} {str(r.get('dtype')):<9} {fmt(r['acceptance_length']):>5}  "
              f"{', '.join(fmt(a) for a in r['acceptance_per_position']):<18} {fmt(r['tokens_per_s'], '.1f'):>7} "
              f"{fmt(r['baseline_tokens_per_s'], '.1f'):>7} {fmt(r['speedup']):>7} "
              f"{(f'{same[0]}/{same[1]}' if same else 'n/a'):>13} {r['bench_wall_s']:>7}")
    if "local" in answers and "vllm" in answers:
        same = sum(a["token_ids"] == b["token_ids"] for a, b in zip(answers["local"], answers["vllm"]))
        lt, vt = reports["local"]["acceptance_length"], reports["vllm"]["acceptance_length"]
        print(f"identical answers local vs vLLM: {same}/{len(answers['local'])}; "
              f"acceptance length vLLM/local = {fmt(vt / lt if lt and vt else None, '.3f')}")
        srv = reports["vllm"].get("server") or {}
        print(f"vLLM {srv.get('vllm_version')}, server args: {' '.join(srv.get('args') or [])}")
    if args.out:
        args.out.write_text(json.dumps(reports, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
