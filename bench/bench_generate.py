"""Benchmark: `generate` (backend openai) against a bare asyncio + httpx loop on the same server.

Both send the same chat requests (ShareGPT first turns, temperature 0, the same max_tokens) with
the same concurrency to one vLLM server, and count output tokens from the server's `usage`.
Runs alternate (bare, generate, generate, bare, ...) after one discarded warm-up, so that drift in
a shared machine's load hits both sides alike; the ratio of medians decides, and the per-repeat
(paired) ratios are printed to show the noise. The generate side is timed around the whole
`run_generate` call (prompt loading, fingerprints, file writes and manifest included).

    .venv/bin/python bench/bench_generate.py                      # starts vLLM (SmolLM2) itself
    .venv/bin/python bench/bench_generate.py --server http://127.0.0.1:8000/v1

Pass bar: generate reaches at least 90 % of the bare loop's output tokens/s (median over repeats).
"""

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from draftsmith.config import load_config
from draftsmith.generate.stage import run_generate
from draftsmith.prompts import load_prompts
from draftsmith.rundir import RunDir
from draftsmith.target import load_tokenizer, target_info
from draftsmith.vllm_server import VLLMServer


def pick_prompts(n: int, max_prompt_tokens: int, target: str):
    """The first n ShareGPT first turns whose chat prompt fits the server's context."""
    tok = load_tokenizer(target_info(target))
    out = []
    for p in load_prompts("sharegpt", limit=4 * n, first_turn_only=True, min_chars=16, skip_invalid=True):
        text = tok.apply_chat_template(p.first_turn_messages(), tokenize=False,
                                       add_generation_prompt=True)
        if len(tok(text, add_special_tokens=False)["input_ids"]) <= max_prompt_tokens:
            out.append(p)
        if len(out) == n:
            return out
    raise SystemExit(f"only {len(out)} ShareGPT prompts fit in {max_prompt_tokens} tokens")


async def bare_loop(url: str, model: str, prompts, max_tokens: int, concurrency: int) -> tuple[int, float]:
    """(output tokens, seconds): the simplest client that does the same work."""
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def one(p) -> int:
            async with sem:
                body = {"model": model, "messages": p.first_turn_messages(),
                        "max_tokens": max_tokens, "temperature": 0.0}
                r = await client.post(url + "/chat/completions", json=body)
                r.raise_for_status()
                return r.json()["usage"]["completion_tokens"]

        t0 = time.perf_counter()
        tokens = await asyncio.gather(*(one(p) for p in prompts))
        return sum(tokens), time.perf_counter() - t0


def generate_once(url: str, prompts_file: Path, n: int, max_tokens: int, concurrency: int, workdir: Path, i: int) -> tuple[int, float, float]:
    """(output tokens, seconds around run_generate, the stage's own generation seconds)."""
    cfg = load_config(None, [
        "target=smollm2-135m", f"generate.prompts={prompts_file}", "generate.backend=openai",
        f"generate.servers={json.dumps([url])}", f"generate.limit={n}", f"generate.max_tokens={max_tokens}",
        "generate.temperature=0", f"generate.concurrency={concurrency}",
    ])
    t0 = time.perf_counter()
    m = run_generate(RunDir(workdir / f"gen{i}"), cfg)
    return m["counts"]["completion_tokens"], time.perf_counter() - t0, m["summary"]["seconds"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server", help="an OpenAI base URL serving SmolLM2; default: start vLLM here")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3, help="measured runs per side (after one warm-up each)")
    ap.add_argument("--eager", action="store_true", help="start vLLM with --enforce-eager (starts in ~1 min instead of 2-4)")
    args = ap.parse_args()

    prompts = pick_prompts(args.prompts, 2048 - args.max_tokens - 16, "smollm2-135m")
    work = Path(tempfile.mkdtemp(prefix="bench-generate-"))
    # Same prompts for both sides: generate reads them from this file (ids and texts as picked).
    prompts_file = work / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps({"id": p.id, "messages": p.first_turn_messages()}) + "\n"
                                    for p in prompts))

    server = None
    if args.server:
        url = args.server.rstrip("/")
    else:
        server = VLLMServer(target_info("smollm2-135m").path, log_path=work / "vllm.log",
                            extra_args=["--enforce-eager"] if args.eager else []).start()
        url = server.base_url
        print(f"vLLM started in {server.startup_s:.0f}s ({url}, log {server.log_path})")
    try:
        model = httpx.get(url + "/models", timeout=30).json()["data"][0]["id"]
        print(f"{len(prompts)} ShareGPT first turns, max_tokens {args.max_tokens}, temperature 0, concurrency {args.concurrency}")
        tok, sec = asyncio.run(bare_loop(url, model, prompts, args.max_tokens, args.concurrency))
        print(f"warm-up bare      {tok:6d} tokens {sec:6.1f}s {tok / sec:7.1f} tok/s (discarded)")
        tok, sec, _ = generate_once(url, prompts_file, len(prompts), args.max_tokens, args.concurrency, work, 0)
        print(f"warm-up generate  {tok:6d} tokens {sec:6.1f}s {tok / sec:7.1f} tok/s (discarded)")
        bare, gen, gen_stage = [], [], []
        for r in range(args.repeats):
            for side in (("bare", "generate") if r % 2 == 0 else ("generate", "bare")):
                cpu0 = time.process_time()  # the client's own CPU time (all threads of this process)
                if side == "bare":
                    tok, sec = asyncio.run(bare_loop(url, model, prompts, args.max_tokens, args.concurrency))
                    bare.append(tok / sec)
                    print(f"run {r + 1} bare      {tok:6d} tokens {sec:6.1f}s {tok / sec:7.1f} tok/s "
                          f"| client CPU {time.process_time() - cpu0:.2f}s")
                else:
                    tok, sec, stage_sec = generate_once(url, prompts_file, len(prompts), args.max_tokens, args.concurrency, work, r + 1)
                    gen.append(tok / sec)
                    gen_stage.append(tok / stage_sec)
                    print(f"run {r + 1} generate  {tok:6d} tokens {sec:6.1f}s {tok / sec:7.1f} tok/s "
                          f"| client CPU {time.process_time() - cpu0:.2f}s "
                          f"(generation phase alone {stage_sec:.1f}s, {tok / stage_sec:.1f} tok/s)")
        b, g, gs = statistics.median(bare), statistics.median(gen), statistics.median(gen_stage)
        ratio = g / b
        # Each repeat's two runs are adjacent in time: their ratio cancels most of the machine's load drift.
        paired = [x / y for x, y in zip(gen, bare)]
        print(f"median bare {b:.1f} tok/s | generate {g:.1f} tok/s whole call ({gs:.1f} generation phase)")
        print(f"paired ratios (same repeat): {', '.join(f'{x:.3f}' for x in paired)}; median {statistics.median(paired):.3f}")
        print(f"ratio generate/bare = {ratio:.3f} (whole call), {gs / b:.3f} (generation phase); bar 0.90: "
              f"{'PASS' if ratio >= 0.9 else 'FAIL'}")
    finally:
        if server is not None:
            server.stop()
    sys.exit(0 if ratio >= 0.9 else 1)


if __name__ == "__main__":
    main()
