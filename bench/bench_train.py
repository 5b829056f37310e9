"""Benchmark drafter training (the train stage) on this machine: tokens/s and the split of a step.

    .venv/bin/python bench/bench_train.py [--samples 40] [--steps 6] [--seq-len 2048] [--batch-tokens 4096]
                                          [--configs offline-fp32,offline-bf16,offline-fp32-dense,online-fp32,online-bf16]
                                          [--repeat 1]

Setup (once, in a temporary run, not timed): the first --samples ShareGPT conversations become
generate output (their own assistant turns), then the real stages run on them: prepare (SmolLM2's
chat template, loss mask on assistant tokens, --seq-len tokens at most), vocab (8192 tokens) and
extract (SmolLM2 hidden states, aux layers [2, 15, 27]).

Each configuration is one `run_train` of --steps + 1 optimizer steps into a fresh train/ folder,
SmolLM2 dimensions (H 576, draft vocabulary 8192, 3 TTT steps), rows of --seq-len tokens,
--batch-tokens per step; every step is logged, the first one (warm-up) is left out. tokens/s
counts real (unpadded) tokens over wall-clock time between the first and last logged step; the
split is the mean over the measured steps of data (reading + packing, or the target's forward in
online mode), forward, backward and optimizer (clip + AdamW + schedule) time.

The machine is shared: wall-clock figures fall with the neighbours' load (printed). tokens per
CPU-second (this process's CPU time over the same steps, all threads) depends far less on it;
times the thread count it estimates the tokens/s of an otherwise idle machine (an upper bound:
it assumes the threads scale perfectly).

Configurations:
    offline-fp32          extract store, float32 (what `precision: auto` picks on a CPU without AMX)
    offline-bf16          extract store, bf16 autocast
    offline-fp32-dense    as offline-fp32 but TTT attention over the dense [L, (k+1)L] mask
                          (ttt_forward(attn_block=None)), i.e. before the block-sparse attention
    online-fp32           target in-process (its forward in float32), drafter float32
    online-bf16           target in-process (its forward in bfloat16, `dtype: auto`), drafter float32
    demo-before           the demo's training settings (configs/demo.yaml: rows of 2,048, 4,096 tokens a
                          step, loss on every token, precision auto), with the step as it was before
                          issue 24: SDPA attention and the loss over the whole micro-batch
                          (train.attention=sdpa, train.loss_chunk_tokens=0)
    demo-after            the same with the defaults (attention auto, which is sdpa on a CPU; chunked loss)
    cpu400-before         configs/smollm2-cpu-400.yaml's: two one-thread ranks (train.processes=2) of
                          1,024 tokens each, rows of 1,024, init_layer 29, loss on every token; before
    cpu400-after          the same, after
(--seq-len and --batch-tokens apply to the first five; the recipe rows carry their own. With
train.processes=2 the tok/CPU-s column counts rank 0's CPU time only. --repeat N runs the list
N times in turn, so that before and after see the same neighbours.)
"""

import argparse
import functools
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from draftsmith.config import load_config  # noqa: E402
from draftsmith.extract.stage import run_extract  # noqa: E402
from draftsmith.model.eagle3 import Eagle3Drafter  # noqa: E402
from draftsmith.prepare import run_prepare  # noqa: E402
from draftsmith.rundir import RunDir, fingerprint  # noqa: E402
from draftsmith.target import target_info  # noqa: E402
from draftsmith.train.stage import run_train  # noqa: E402
from draftsmith.vocab import run_vocab  # noqa: E402

from _sharegpt import sharegpt_conversations  # noqa: E402

PEER_TOKENS_PER_S = 600  # speculators 0.9.0 on this CPU (FACTS.md)
DEMO = ["train.seq_len=2048", "train.batch_tokens=4096", "train.loss_on=all"]
CPU400 = ["train.seq_len=1024", "train.batch_tokens=1024", "train.loss_on=all", "train.processes=2", "train.init_layer=29"]
BEFORE = ["train.attention=sdpa", "train.loss_chunk_tokens=0"]
CONFIGS = {
    "offline-fp32": dict(mode="offline", precision="fp32"),
    "offline-bf16": dict(mode="offline", precision="bf16"),
    "offline-fp32-dense": dict(mode="offline", precision="fp32", dense=True),
    "online-fp32": dict(mode="online", precision="fp32", dtype="float32"),
    "online-bf16": dict(mode="online", precision="fp32", dtype="bfloat16"),
    "demo-before": dict(mode="offline", precision="auto", sets=DEMO + BEFORE),
    "demo-after": dict(mode="offline", precision="auto", sets=DEMO),
    "cpu400-before": dict(mode="offline", precision="auto", sets=CPU400 + BEFORE),
    "cpu400-after": dict(mode="offline", precision="auto", sets=CPU400),
}


def sharegpt_generate(run: RunDir, n: int) -> None:
    """The first n ShareGPT conversations with a user and an assistant turn, as generate output."""
    records = [{"id": sid, "messages": msgs, "finish_reasons": ["stop"] * sum(m["role"] == "assistant" for m in msgs)}
               for sid, msgs in sharegpt_conversations(n)]
    text = "".join(json.dumps(r) + "\n" for r in records)
    (run.stage_dir("generate") / "samples.jsonl").write_text(text)
    info = target_info("smollm2-135m")
    run.write_manifest("generate", fingerprint=fingerprint(text), settings={},
                       inputs={"target": info.name, "target_fingerprint": info.fingerprint},
                       counts={"done": n, "total": n, "unit": "samples"}, started=time.time(), outputs=["samples.jsonl"])


def build_run(path: Path, n: int, seq_len: int) -> RunDir:
    run = RunDir(path).ensure()
    sharegpt_generate(run, n)
    cfg = load_config(None, [f"prepare.max_length={seq_len}", "vocab.draft_vocab_size=8192"])
    run_prepare(run, cfg)
    run_vocab(run, cfg)
    run_extract(run, cfg)
    return run


def measure(run: RunDir, name: str, spec: dict, steps: int, seq_len: int, batch_tokens: int) -> dict:
    shutil.rmtree(run.path / "train", ignore_errors=True)
    sets = [f"train.mode={spec['mode']}", f"train.precision={spec['precision']}", f"train.max_steps={steps + 1}",
            f"train.seq_len={seq_len}", f"train.batch_tokens={batch_tokens}", "train.log_every_s=1e-6",
            "train.checkpoint_every=100000", "vocab.draft_vocab_size=8192", "train.warmup_steps=1"]
    if "dtype" in spec:
        sets.append(f"dtype={spec['dtype']}")
    sets += spec.get("sets", [])  # a recipe's settings: after the defaults above, so they win
    original = Eagle3Drafter.ttt_forward
    if spec.get("dense"):
        Eagle3Drafter.ttt_forward = functools.partialmethod(original, attn_block=None)
    try:
        run_train(run, load_config(None, sets))
    finally:
        Eagle3Drafter.ttt_forward = original
    rows = [json.loads(x) for x in (run.path / "train" / "metrics.jsonl").read_text().splitlines()]
    first, last = rows[0], rows[-1]
    measured = rows[1:]
    n_steps = last["step"] - first["step"]
    split = {k: sum(r["step_time_s"][k] * (r["step"] - p["step"]) for p, r in zip(rows, rows[1:])) / n_steps
             for k in ("data", "forward", "backward", "optimizer")}
    tokens = last["tokens"] - first["tokens"]
    seconds = last["elapsed_s"] - first["elapsed_s"]
    cpu = last["cpu_s"] - first["cpu_s"]
    return {"config": name, **spec, "steps": n_steps, "tokens": tokens, "seconds": seconds, "cpu_seconds": cpu,
            "tokens_per_s": tokens / seconds, "tokens_per_cpu_s": tokens / cpu, "step_s": seconds / n_steps, "split_s": split,
            "loss_first": first["loss"], "loss_last": last["loss"], "logged_steps": len(measured)}


def cpu_line() -> str:
    model = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: None)()
    return (f"{model}, {os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} threads), "
            f"AMX: {amx}, AVX512-BF16: {'avx512_bf16' in open('/proc/cpuinfo').read()}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=40)
    ap.add_argument("--steps", type=int, default=6, help="measured optimizer steps per configuration (+1 warm-up)")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch-tokens", type=int, default=4096)
    ap.add_argument("--configs", default="offline-fp32,offline-bf16,offline-fp32-dense,online-fp32,online-bf16")
    ap.add_argument("--workdir", type=Path, default=None, help="keep the run here (default: a temporary folder)")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ap.add_argument("--repeat", type=int, default=1, help="run the configurations this many times in turn")
    args = ap.parse_args()
    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in names if c not in CONFIGS]
    if unknown:
        ap.error(f"unknown configuration(s) {unknown}; choose from {list(CONFIGS)}")

    tmp = None
    if args.workdir is None:
        tmp = tempfile.mkdtemp(prefix="bench-train-")
        workdir = Path(tmp)
    else:
        workdir = args.workdir
    try:
        t0 = time.time()
        run_path = workdir / "run"
        if (run_path / "extract" / "manifest.json").is_file():
            run = RunDir(run_path)
        else:
            run = build_run(run_path, args.samples, args.seq_len)
        prep = run.read_manifest("prepare")["counts"]
        setup_s = time.time() - t0
        load0 = os.getloadavg()[0]
        results = [measure(run, name, CONFIGS[name], args.steps, args.seq_len, args.batch_tokens)
                   for _ in range(args.repeat) for name in names]
        load1 = os.getloadavg()[0]

        print()
        print(f"# drafter training, SmolLM2-135M target: H 576, draft vocab 8192, 3 TTT steps, rows of {args.seq_len}, "
              f"{args.batch_tokens} tokens/step")
        print(f"# {cpu_line()}; load average {load0:.1f} -> {load1:.1f}")
        print(f"# data: {prep['samples']} ShareGPT conversations, {prep['tokens']:,} tokens, "
              f"{prep['masked_tokens'] / prep['tokens']:.0%} loss-masked (setup {setup_s:.0f}s, not timed)")
        head = (f"| {'configuration':<20} | {'tokens/s':>8} | {'vs peer':>7} | {'tok/CPU-s':>9} | {'step s':>6} | {'data':>5} | "
                f"{'fwd':>5} | {'bwd':>5} | {'optim':>5} |")
        print(head)
        print("|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|")
        for r in results:
            s = r["split_s"]
            print(f"| {r['config']:<20} | {r['tokens_per_s']:>8,.0f} | {r['tokens_per_s'] / PEER_TOKENS_PER_S:>6.2f}x | "
                  f"{r['tokens_per_cpu_s']:>9,.0f} | "
                  f"{r['step_s']:>6.2f} | {s['data']:>5.2f} | {s['forward']:>5.2f} | {s['backward']:>5.2f} | {s['optimizer']:>5.2f} |")
        print(f"(peer: speculators 0.9.0 on this CPU, bf16 autocast, seq 2048: about {PEER_TOKENS_PER_S} tokens/s; "
              f"{args.steps} measured steps per row after one warm-up step)")
        if args.json:
            args.json.write_text(json.dumps({"cpu": cpu_line(), "load": [load0, load1], "results": results}, indent=2))
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
