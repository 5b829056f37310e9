"""draftsmith and the peer toolkit (speculators 0.9.0) side by side on this machine, in one run folder.

    .venv/bin/python bench/peer/compare.py --out runs/peer-vs-us --train-minutes 44 \\
        [--config configs/smollm2-cpu-400.yaml] [--set generate.answers_per_prompt=1 ...] \\
        [--peer-train-minutes M] [--sets validation | test | val-mtbench | ...]
    # equal end to end: draftsmith trains for what is left of the peer's whole pipeline's time
    .venv/bin/python bench/peer/compare.py --out runs/e2e --train-minutes fit --peer-train-minutes 44 \\
        --config configs/smollm2-cpu-e2e.yaml --sets test

Both pipelines take the same prompts (the config's generate selection: for the 400-prompt recipe the
first 400 ShareGPT first turns of 8-2,000 characters) and run end to end on this machine:

  draftsmith  `draftsmith run CONFIG --run OUT/ours --until export` with train.max_minutes = --train-minutes
              (and the --set overrides): generate through its own vLLM server, prepare, vocab,
              extract, train, export
  peer        bench/peer/peer_pipeline.py on OUT/ours/generate/samples.jsonl (its prompts; the peer
              writes its own answers): regenerate, prepare-data, hidden states through vLLM, train
              for --peer-train-minutes (default: the same as ours), drafter folder
              (install first: bash bench/peer/setup_peer.sh)

With `--train-minutes fit` the order changes so that both pipelines take the same end-to-end
time: draftsmith up to its store, the peer's whole pipeline, then draftsmith's training for the
peer's end-to-end seconds less draftsmith's generate..extract and FIT_OVERHEAD_S (loading, export).

then both drafters are judged by the same vLLM-CPU server settings (`draftsmith eval --engine vllm
--drafter`, K = 3, temperature 0, 128 tokens, one request at a time), on each prompt set of --sets;
the plain target (no drafter) is measured once per set, beside draftsmith's drafter, and is the
baseline of both speedups.

Prompt sets (first turns; none is in the training prompts):
  validation  val-mtbench: MT-bench questions 121-160 (the packaged set holds 81-160);
              val-sharegpt: the 40 ShareGPT prompts after the test ones (the config's filters,
              texts that are no training prompt's)
  test        test-mtbench: MT-bench 81-120; test-sharegpt: the first 40 ShareGPT prompts after the
              training ones whose text is no training prompt's (ShareGPT repeats "continue" and the
              like). Report these once, when every knob is chosen.

Resumable: a finished part is not redone (draftsmith's stages by their fingerprints, the peer's
pipeline when OUT/peer/peer.json says done, an evaluation when its report is there). OUT/machine.json
records the CPU it started on; a run continued on another machine is refused, since a ratio only
counts when both sides ran on the same one. Printed: minutes per stage, extraction tokens/s, bytes
per token, training tokens/s, end-to-end minutes, tau and speedup per set, each as draftsmith / peer;
written to OUT/compare.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(ROOT))

from draftsmith.config import load_config  # noqa: E402
from draftsmith.prompts import load_prompts  # noqa: E402

SETS = {"validation": ("val-mtbench", "val-sharegpt"), "test": ("test-mtbench", "test-sharegpt")}
SETS.update({name: (name,) for names in list(SETS.values()) for name in names})  # or one set alone
EVAL_PROMPTS = 40
EVAL_ARGS = ["--engine", "vllm", "-k", "3", "--temperature", "0", "--max-tokens", "128"]


def machine() -> dict:
    """What a comparison's numbers depend on: the CPU model, its flags that matter to torch, the cores."""
    model, flags = platform.processor(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    keep = sorted(f for f in flags if f.startswith(("amx", "avx512_bf16", "avx512f", "avx2", "avx512_fp16")))
    return {"cpu": model, "flags": keep, "cores": os.cpu_count()}


def check_machine(out: Path) -> dict:
    here, f = machine(), out / "machine.json"
    if f.is_file():
        first = json.loads(f.read_text())
        if first != here:
            sys.exit(f"{f}: this comparison was started on {first['cpu']} ({first['cores']} cores, {first['flags']}); "
                     f"this machine is {here['cpu']} ({here['cores']} cores, {here['flags']}): start a new --out")
    else:
        f.write_text(json.dumps(here, indent=2))
    return here


def prompt_sets(cfg, out: Path) -> dict[str, Path]:
    """The four evaluation prompt files (JSONL, one first turn each), written once."""
    g = cfg.generate
    if g.seed is not None or g.offset:
        sys.exit("compare.py: the ShareGPT slices follow the training prompts in file order; "
                 "the config's generate.seed and generate.offset must be unset")
    d = out / "prompts"
    d.mkdir(parents=True, exist_ok=True)
    n = g.limit or 0

    # ShareGPT repeats short first turns ("continue", ...): an evaluation prompt whose text is a
    # training prompt's is skipped, so the slices are the first 40 and the next 40 of the prompts
    # after the training ones with a text of their own
    opts = dict(skip_invalid=g.skip_invalid, first_turn_only=True, min_chars=g.min_chars, max_chars=g.max_chars)
    seen = {p.turns[0].strip() for p in load_prompts(g.prompts, limit=n, **opts)}
    fresh = []
    for p in load_prompts(g.prompts, limit=8 * EVAL_PROMPTS, offset=n, **opts):
        if p.turns[0].strip() not in seen:
            seen.add(p.turns[0].strip())
            fresh.append(p)
    chosen = {"test-mtbench": load_prompts("mt-bench", limit=EVAL_PROMPTS, offset=0, first_turn_only=True),
              "val-mtbench": load_prompts("mt-bench", limit=EVAL_PROMPTS, offset=EVAL_PROMPTS, first_turn_only=True),
              "test-sharegpt": fresh[:EVAL_PROMPTS], "val-sharegpt": fresh[EVAL_PROMPTS:2 * EVAL_PROMPTS]}
    files = {}
    for name, prompts in chosen.items():
        if len(prompts) != EVAL_PROMPTS:
            sys.exit(f"compare.py: {name}: {len(prompts)} prompts, expected {EVAL_PROMPTS}")
        files[name] = d / f"{name}.jsonl"
        if not files[name].is_file():
            rows = [{"id": p.id, "messages": ([{"role": "system", "content": p.system}] if p.system else [])
                     + [{"role": "user", "content": p.turns[0]}]} for p in prompts]
            files[name].write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return files


def run_logged(cmd: list[str], log: Path, what: str) -> None:
    print(f"--- {what}: {' '.join(map(str, cmd))}  (log: {log})", flush=True)
    t0 = time.time()
    with open(log, "a") as f:
        rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        tail = log.read_text(errors="replace").strip().splitlines()[-1:] or ["(no output)"]
        sys.exit(f"{what} failed (exit {rc}): {tail[0]}  (log: {log})")
    print(f"    {what}: {time.time() - t0:.0f}s", flush=True)


def draftsmith_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "draftsmith", *args]


def ours_numbers(run: Path) -> dict:
    """Per stage: wall seconds (from each manifest's started/finished) and throughputs."""
    st = {}
    for s in ("generate", "prepare", "vocab", "extract", "train", "export"):
        m = json.loads((run / s / "manifest.json").read_text())
        st[s] = {"wall_s": round(m["finished"] - m["started"], 1), "counts": m["counts"]}
    g, e, t = st["generate"]["counts"], st["extract"]["counts"], st["train"]["counts"]
    return {
        "stages": {k: v["wall_s"] for k, v in st.items()},
        "total_s": round(sum(v["wall_s"] for v in st.values()), 1),
        "generated_tokens": g.get("completion_tokens"),
        "generate_tokens_per_s": g.get("completion_tokens", 0) / st["generate"]["wall_s"],
        "extract_tokens": e["tokens"], "extract_tokens_per_s": e["tokens"] / st["extract"]["wall_s"],
        "bytes_per_token": e["bytes"] / e["tokens"],
        "train_tokens": t["tokens"], "train_tokens_per_s": t["tokens"] / st["train"]["wall_s"],
        "train_steps": t["done"], "drafter": str(run / "export"),
    }


def peer_numbers(peer: Path) -> dict:
    r = json.loads((peer / "peer.json").read_text())
    s = r["stages"]
    # the peer's regenerate and prepare together do what draftsmith's generate + prepare + vocab do
    return {
        "stages": {k: v["wall_s"] for k, v in s.items()},
        "total_s": round(sum(v["wall_s"] for v in s.values()), 1),
        "generated_tokens": s["regenerate"]["tokens"],
        "generate_tokens_per_s": s["regenerate"]["tokens"] / s["regenerate"]["wall_s"],
        "extract_tokens": s["extract"]["tokens"], "extract_tokens_per_s": s["extract"]["tokens"] / s["extract"]["wall_s"],
        "bytes_per_token": s["extract"]["bytes_per_token"],
        "train_tokens": s["train"]["tokens"], "train_tokens_per_s": s["train"]["tokens"] / s["train"]["wall_s"],
        "train_steps": s["train"]["steps"], "drafter": r["drafter"],
    }


def evaluate(args, who: str, drafter: str, set_name: str, prompts: Path, baseline: bool) -> dict:
    run = args.out / "eval" / f"{set_name}-{who}"
    report = run / "eval" / "report.json"
    sets = ["--set", f"eval.baseline={'true' if baseline else 'false'}"]
    cmd = draftsmith_cmd("eval", "--run", str(run), "--config", str(args.config), "--drafter", drafter,
                         "--prompts", str(prompts), "--offset", "0", "--limit", str(EVAL_PROMPTS), *EVAL_ARGS, *sets)
    run.mkdir(parents=True, exist_ok=True)
    run_logged(cmd, run.parent / f"{run.name}.log", f"eval {who} on {set_name}")
    return json.loads(report.read_text())


# Seconds of draftsmith's train and export stages outside train.max_minutes' clock: loading the
# drafter, the store and the first micro-batch before the first step, the last checkpoint, export.
# On the 2-core CPU with SmolLM2 these took 40-60 s; the end-to-end minutes printed are measured.
FIT_OVERHEAD_S = 60.0


def fitted_train_minutes(ours_run: Path, peer_total_s: float) -> float:
    """train.max_minutes that makes draftsmith's whole pipeline take the peer's end-to-end time."""
    before = 0.0
    for stage in ("generate", "prepare", "vocab", "extract"):
        m = json.loads((ours_run / stage / "manifest.json").read_text())
        before += m["finished"] - m["started"]
    left = (peer_total_s - before - FIT_OVERHEAD_S) / 60
    if left <= 1:
        sys.exit(f"compare.py: draftsmith's stages before training took {before / 60:.1f} min of the peer's "
                 f"{peer_total_s / 60:.1f}: no time is left to train")
    print(f"    draftsmith trains for {left:.1f} min: the peer's {peer_total_s / 60:.1f} min end to end, less "
          f"{before / 60:.1f} min of generate..extract and {FIT_OVERHEAD_S / 60:.0f} min of loading and export", flush=True)
    return left


def run_ours(args, ours_run: Path, stages: list[str], sets: list[str]) -> None:
    cmd = draftsmith_cmd("run", str(args.config), "--run", str(ours_run), *stages)
    for s in sets:
        cmd += ["--set", s]
    run_logged(cmd, args.out / "ours.log", "draftsmith pipeline")


def run_peer(args, ours_run: Path, peer_dir: Path, minutes: float, limit: int | None) -> None:
    done = peer_dir / "peer.json"
    if done.is_file() and json.loads(done.read_text()).get("status") == "done":
        return
    shutil.rmtree(peer_dir, ignore_errors=True)  # the peer's pipeline starts from an empty folder
    run_logged([sys.executable, str(HERE / "peer_pipeline.py"), "--prompts", str(ours_run / "generate" / "samples.jsonl"),
                "--out", str(peer_dir), "--train-minutes", str(minutes), "--limit", str(limit)],
               args.out / "peer.log", "peer pipeline")


def ratio(a, b) -> str:
    return f"{a / b:.2f}x" if a is not None and b else "n/a"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--train-minutes", required=True,
                   help="draftsmith's train.max_minutes, or `fit`: whatever makes its whole pipeline take the peer's "
                        "end-to-end time (then --peer-train-minutes is required)")
    p.add_argument("--peer-train-minutes", type=float, default=None, help="the peer's training wall clock (default: --train-minutes)")
    p.add_argument("--config", type=Path, default=ROOT / "configs" / "smollm2-cpu-400.yaml")
    p.add_argument("--set", nargs="*", default=[], help="draftsmith overrides, as its --set")
    p.add_argument("--sets", choices=sorted(SETS), default="validation")
    args = p.parse_args()
    fit = args.train_minutes == "fit"
    if fit and args.peer_train_minutes is None:
        p.error("--train-minutes fit needs --peer-train-minutes (the peer's clock sets both budgets)")
    if not fit:
        try:
            args.train_minutes = float(args.train_minutes)
        except ValueError:
            p.error(f"--train-minutes: a number of minutes or `fit`, not {args.train_minutes!r}")
    args.out, args.config = args.out.resolve(), args.config.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    mach = check_machine(args.out)
    cfg = load_config(args.config, args.set)
    files = prompt_sets(cfg, args.out)
    ours_run, peer_dir = args.out / "ours", args.out / "peer"

    if fit:
        # draftsmith up to its store, then the peer's whole pipeline (on draftsmith's prompts), then
        # draftsmith's training for what is left of the peer's end-to-end time
        run_ours(args, ours_run, ["--until", "extract"], args.set)
        run_peer(args, ours_run, peer_dir, args.peer_train_minutes, cfg.generate.limit)
        minutes = fitted_train_minutes(ours_run, peer_numbers(peer_dir)["total_s"])
        sets = [*args.set, f"train.max_minutes={minutes:.2f}"]
        run_ours(args, ours_run, ["--from", "train", "--until", "export"], sets)
    else:
        sets = [f"train.max_minutes={args.train_minutes}", *args.set]
        run_ours(args, ours_run, ["--until", "export"], sets)
        run_peer(args, ours_run, peer_dir, args.peer_train_minutes if args.peer_train_minutes is not None
                 else args.train_minutes, cfg.generate.limit)
    ours, peer = ours_numbers(ours_run), peer_numbers(peer_dir)

    evals: dict[str, dict] = {}
    for name in SETS[args.sets]:
        mine = evaluate(args, "draftsmith", ours["drafter"], name, files[name], baseline=True)
        theirs = evaluate(args, "peer", peer["drafter"], name, files[name], baseline=False)
        base = mine.get("baseline_tokens_per_s")
        evals[name] = {"draftsmith": {"tau": mine["acceptance_length"], "per_position": mine["acceptance_per_position"],
                                      "tokens_per_s": mine["tokens_per_s"], "speedup": mine.get("speedup")},
                       "peer": {"tau": theirs["acceptance_length"], "per_position": theirs["acceptance_per_position"],
                                "tokens_per_s": theirs["tokens_per_s"],
                                "speedup": theirs["tokens_per_s"] / base if base else None},
                       "baseline_tokens_per_s": base}

    rows = [("end to end, minutes", ours["total_s"] / 60, peer["total_s"] / 60, ".1f"),
            ("answers: generated tokens", ours["generated_tokens"], peer["generated_tokens"], ",.0f"),
            ("answers: tokens/s (stage wall)", ours["generate_tokens_per_s"], peer["generate_tokens_per_s"], ".0f"),
            ("extract: tokens/s (stage wall)", ours["extract_tokens_per_s"], peer["extract_tokens_per_s"], ".0f"),
            ("extract: bytes/token", ours["bytes_per_token"], peer["bytes_per_token"], ",.0f"),
            ("train: tokens/s (stage wall)", ours["train_tokens_per_s"], peer["train_tokens_per_s"], ".0f"),
            ("train: tokens", ours["train_tokens"], peer["train_tokens"], ",.0f")]
    for name, e in evals.items():
        rows.append((f"tau, {name}", e["draftsmith"]["tau"], e["peer"]["tau"], ".3f"))
        rows.append((f"speedup vs plain, {name}", e["draftsmith"]["speedup"], e["peer"]["speedup"], ".2f"))
    print(f"\n{mach['cpu']}, {mach['cores']} cores, flags {' '.join(mach['flags'])}; load average {os.getloadavg()[0]:.1f}")
    print("| measure | draftsmith | peer | draftsmith / peer |")
    print("| --- | ---: | ---: | ---: |")
    for label, a, b, spec in rows:
        print(f"| {label} | {format(a, spec) if a is not None else 'n/a'} | {format(b, spec) if b is not None else 'n/a'} | {ratio(a, b)} |")
    print("stage minutes, draftsmith: " + ", ".join(f"{k} {v / 60:.1f}" for k, v in ours["stages"].items()))
    print("stage minutes, peer: " + ", ".join(f"{k} {v / 60:.1f}" for k, v in peer["stages"].items()))
    for name, e in evals.items():
        print(f"{name}: per position draftsmith {e['draftsmith']['per_position']}, peer {e['peer']['per_position']}; "
              f"plain {e['baseline_tokens_per_s']:.1f} tok/s")
    (args.out / "compare.json").write_text(json.dumps({"machine": mach, "config": str(args.config), "sets": sets,
                                                       "ours": ours, "peer": peer, "evals": evals}, indent=2))


if __name__ == "__main__":
    main()
