"""How fast is `draftsmith status` on a big run?

Builds a run with 10,000 sample files across extract shards (plus a 10,000-line generate output and
long progress journals, as after hours of work), then times `draftsmith status --json` as a user
runs it (a fresh process each time) and the in-process call. Prints medians over several runs.

    .venv/bin/python bench/bench_status.py [--samples 10000] [--repeats 7]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from draftsmith.rundir import RunDir
from draftsmith.status import run_status


def build_run(root: Path, samples: int, shard: int = 1000) -> RunDir:
    run = RunDir(root / "run").ensure()
    now = time.time()
    for stage in ("generate", "prepare", "extract"):
        d = run.stage_dir(stage)
        # A journal as after ~14 h at one line every 2 s: 25,000 lines.
        lines = [{"ev": "start", "t": now - 50_000, "pid": 1, "host": "elsewhere", "total": samples,
                  "unit": "samples", "done": 0, "stall_after_s": 300}]
        lines += [{"ev": "p", "t": now - 50_000 + 2 * i, "done": i * samples // 25_000, "pt": now - 50_000 + 2 * i,
                   "total": samples} for i in range(25_000)]
        (d / "progress.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    row = json.dumps({"id": "x" * 12, "messages": [{"role": "user", "content": "y" * 2000}]}) + "\n"
    (run.path / "generate" / "samples.jsonl").write_text(row * samples)
    (run.path / "prepare" / "samples.jsonl").write_text(row * samples)
    for start in range(0, samples, shard):
        d = run.path / "extract" / f"rows_{start}-{start + shard}"
        d.mkdir(parents=True)
        for i in range(start, min(samples, start + shard)):
            (d / f"{i}.safetensors").write_bytes(b"\0" * 64)
        (d / "shard.json").write_text("{}")
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=10_000)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run = build_run(Path(tmp), args.samples)
        st = run_status(run.path)
        ext = next(s for s in st["stages"] if s["name"] == "extract")
        assert ext["on_disk"] == args.samples, ext
        cli_times, fn_times = [], []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            p = subprocess.run([sys.executable, "-m", "draftsmith", "status", str(run.path), "--json"],
                               capture_output=True, text=True)
            cli_times.append(time.perf_counter() - t0)
            assert p.returncode == 0, p.stderr
            t0 = time.perf_counter()
            run_status(run.path)
            fn_times.append(time.perf_counter() - t0)
        cli, fn = statistics.median(cli_times), statistics.median(fn_times)
        print(f"run with {args.samples} sample files in {args.samples // 1000} shards, 3 journals of 25,001 lines")
        print(f"draftsmith status --json (new process each time), median of {args.repeats}: {cli:.3f} s")
        print(f"run_status() in process, median of {args.repeats}:                  {fn:.3f} s")
        print(f"budget 0.5 s: {'OK' if cli < 0.5 else 'OVER'} ({cli / 0.5:.2f} of budget)")


if __name__ == "__main__":
    main()
