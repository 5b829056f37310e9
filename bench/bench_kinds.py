"""Drafters of each kind served by vLLM, side by side with plain decoding: acceptance and speedup, several passes.

    .venv/bin/python bench/bench_kinds.py --config configs/smollm2-cpu-e2e.yaml \
        --prompts runs/kinds/prompts/val-mtbench.jsonl --prompts runs/kinds/prompts/val-sharegpt.jsonl \
        --passes 3 --dtype float32 --drafter eagle3=runs/k-eagle3/export:3 --drafter peagle=runs/k-peagle/export:3,5 \
        --out runs/kinds/val.json

One vLLM server without drafting and one per (drafter, K) are started once (the serving config of each export
from draftsmith.export.speculative_config: EAGLE-3 chain drafting, P-EAGLE's parallel drafting), with the
settings `draftsmith eval --engine vllm` uses (`dtype`, eval.vllm_args: --enforce-eager). Then every pass sends
the prompts, one request at a time at temperature 0, to each server in turn, the order rotated from pass to pass,
so that the machine's drift falls on every server alike; with several prompt sets (--prompts repeated), each pass
sends every set, and the figures are kept per set. Per server, set and pass: output tokens / the requests'
wall seconds (prefill included); per drafter: the speedup over the plain server in the same pass, its mean and
range over the passes, and from the servers' /metrics the acceptance length and acceptance per position.

Prints one table and writes the figures as JSON (--out). Meaningful only on a quiet machine (`uptime` first).
"""

import argparse
import json
import statistics
import sys
import time
from contextlib import ExitStack, closing
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from draftsmith.config import load_config  # noqa: E402
from draftsmith.eval.vllm import VLLMChat, counter_delta, vllm_server_args  # noqa: E402
from draftsmith.export import load_exported, speculative_config  # noqa: E402
from draftsmith.prompts import context_tokens_needed, load_prompts  # noqa: E402
from draftsmith.target import load_tokenizer, target_info  # noqa: E402
from draftsmith.vllm_server import VLLMServer, context_limit, max_model_len, vllm_python  # noqa: E402


def parse_drafter(text: str) -> tuple[str, Path, list[int]]:
    """NAME=EXPORT_DIR[:K1,K2,...] -> (name, folder, K values; default the export's own)."""
    name, _, rest = text.partition("=")
    folder, _, ks = rest.partition(":")
    if not name or not folder:
        sys.exit(f"--drafter {text!r}: expected NAME=EXPORT_DIR[:K1,K2]")
    folder = Path(folder)
    _, info = load_exported(folder)
    return name, folder, [int(k) for k in ks.split(",")] if ks else [info["num_speculative_tokens"]]


def one_pass(chat: VLLMChat, prompts, max_tokens: int, K: int) -> dict:
    """Every prompt once: tokens, seconds, and the speculative counters' deltas (K > 0)."""
    tokens, seconds = 0, 0.0
    before = chat.counters() if K else None
    for p in prompts:
        choice, s = chat.chat(p.first_turn_messages(), max_tokens, 0.0, 0, p.id)
        tokens += int(choice["usage"].get("completion_tokens", 0))
        seconds += s
    out = {"tokens": tokens, "seconds": round(seconds, 3), "tokens_per_s": tokens / seconds}
    if K:
        out.update(counter_delta(before, chat.counters(), K))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="the recipe (target, eval.vllm_args)")
    ap.add_argument("--drafter", action="append", required=True, help="NAME=EXPORT_DIR[:K1,K2] (repeatable)")
    ap.add_argument("--prompts", action="append", required=True,
                    help="a prompt file or set name (first turns are sent); repeatable")
    ap.add_argument("--limit", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--dtype", default="float32", help="the servers' dtype (float32: the fast one on a CPU without "
                    "AMX, and the one local and vLLM acceptance agree in)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    cfg = load_config(args.config, [f"dtype={args.dtype}"])
    info = target_info(cfg.target, cfg.trust_remote_code)
    sets = {name: load_prompts(name, limit=args.limit, first_turn_only=True) for name in args.prompts}
    tokenizer = load_tokenizer(info.path, cfg.trust_remote_code)
    needed = max(context_tokens_needed(ps, tokenizer, args.max_tokens, limit=context_limit(info.path))
                 for ps in sets.values())
    python = vllm_python(cfg.vllm_python)
    entries = [("plain", None, 0)] + [(f"{name} K={k}", folder, k) for name, folder, ks in map(parse_drafter,
                                                                                              args.drafter) for k in ks]
    results = {s: {name: {"passes": [], "export": str(folder) if folder else None, "K": k}
                   for name, folder, k in entries} for s in sets}
    t0 = time.time()
    with ExitStack() as stack:
        chats, commands = {}, {}
        for name, folder, k in entries:
            spec = speculative_config(folder.resolve(), k) if folder else None
            srv = stack.enter_context(VLLMServer(info.path, extra_args=vllm_server_args(cfg, spec),
                                                 python=python, max_model_len=max_model_len(info.path, needed),
                                                 startup_timeout_s=cfg.vllm_startup_timeout_s,
                                                 say=lambda m: print(m, flush=True)))
            chats[name] = stack.enter_context(closing(VLLMChat(srv.url, 600.0 + args.max_tokens).connect()))
            one_pass(chats[name], next(iter(sets.values()))[:1], 4, k)  # warm-up: one-time costs out of the timings
            commands[name] = srv.command()
            print(f"{name}: server up ({time.time() - t0:.0f} s)", flush=True)
        names = [n for n, _, _ in entries]
        for i in range(args.passes):
            order = names[i % len(names):] + names[:i % len(names)]
            for set_name, prompts in sets.items():
                for name in order:
                    r = one_pass(chats[name], prompts, args.max_tokens, results[set_name][name]["K"])
                    results[set_name][name]["passes"].append(r)
                    print(f"pass {i + 1}: {set_name}: {name}: {r['tokens_per_s']:.1f} tokens/s", flush=True)
    for set_name, by_server in results.items():
        for name in by_server:
            by_server[name]["server_command"] = commands[name]
        report(set_name, by_server, args)
    print(f"({(time.time() - t0) / 60:.1f} minutes)")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"limit": args.limit, "max_tokens": args.max_tokens, "dtype": args.dtype,
                                        "passes": args.passes, "sets": results,
                                        "wall_s": round(time.time() - t0, 1)}, indent=2) + "\n")


def report(set_name: str, results: dict, args) -> None:
    """One table for one prompt set; adds tau, acceptance per position and the speedups to `results`."""
    plain = [p["tokens_per_s"] for p in results["plain"]["passes"]]
    print(f"\n{set_name}: {args.limit} prompts, {args.max_tokens} tokens, temperature 0, {args.passes} passes, "
          f"dtype {args.dtype}; plain {statistics.mean(plain):.1f} tokens/s ({min(plain):.1f}-{max(plain):.1f})")
    # a drafting step (K drafts and the verification) costs tau / speedup plain decoding steps
    print("| drafter | tau | acceptance per position | tokens/s | speedup (mean) | speedup range "
          "| step, in plain steps |")
    print("| --- | ---: | --- | ---: | ---: | --- | ---: |")
    for name, r in results.items():
        if name == "plain":
            continue
        ps, K = r["passes"], r["K"]
        drafts = sum(p["num_drafts"] for p in ps)
        tau = 1 + sum(p["num_accepted_tokens"] for p in ps) / drafts
        per_pos = [sum(p["accepted_per_pos"][j] for p in ps) / drafts for j in range(K)]
        speedups = [p["tokens_per_s"] / q for p, q in zip(ps, plain)]
        r.update(tau=tau, acceptance_per_position=per_pos, speedups=speedups, speedup=statistics.mean(speedups))
        print(f"| {name} | {tau:.3f} | {' / '.join(f'{x:.2f}' for x in per_pos)} | "
              f"{statistics.mean(p['tokens_per_s'] for p in ps):.1f} | {r['speedup']:.3f} | "
              f"{min(speedups):.3f}-{max(speedups):.3f} | {tau / r['speedup']:.2f} |")


if __name__ == "__main__":
    main()
