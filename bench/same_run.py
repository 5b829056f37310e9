"""Two runs of the same fixed-size recipe, file by file: do two commits of draftsmith make the same bytes?

    .venv/bin/python bench/same_run.py RUN_A RUN_B

Every data file of the two run folders by sha256, leaving out what holds times or paths by design (manifests,
logs, journals, configs, reports, servers' logs, checkpoints' step folders); a safetensors file that differs is
compared by its tensors and its metadata as a mapping (its header's key order is not data), a JSON or JSONL file
without its clocks; eval's acceptance length of each. Used to show that a refactor changed no behaviour
(docs/experiments/house.md).
"""

import hashlib
import json
import sys
from pathlib import Path

import torch
from safetensors import safe_open

TIMED = {"manifest.json", "stage.log", "progress.jsonl", "config.yaml", "heartbeat.json", "pipeline.json",
         "estimate.json", "metrics.jsonl", "README.md", "report.md", "report.json", "provenance.json", "run.json",
         "shard.json", "state.json", "answers.jsonl", "acceptance.png",
         "engine.json"}  # eval's servers: their ports, paths and start-up seconds


def data_files(root: Path) -> dict[str, Path]:
    return {str(p.relative_to(root)): p for p in sorted(root.rglob("*"))
            if p.is_file() and p.name not in TIMED and not p.name.startswith("progress.") and p.suffix != ".log"
            and "lock" not in p.name and "checkpoints" not in p.parts}


def same_tensors(a: Path, b: Path) -> bool:
    with safe_open(str(a), "pt") as fa, safe_open(str(b), "pt") as fb:
        return (fa.metadata() == fb.metadata() and set(fa.keys()) == set(fb.keys())
                and all(torch.equal(fa.get_tensor(k), fb.get_tensor(k)) for k in fa.keys()))


# keys whose values are clocks, in JSON files that are otherwise data (export/config.json's provenance: when it was
# exported, how long validation took)
CLOCK_KEYS = {"exported", "seconds", "elapsed_s", "finished", "started", "tokens_per_s"}


def without_clocks(x):
    if isinstance(x, dict):
        return {k: without_clocks(v) for k, v in x.items() if k not in CLOCK_KEYS}
    return [without_clocks(v) for v in x] if isinstance(x, list) else x


def same_json(a: Path, b: Path) -> bool:
    """The same JSON (a .jsonl file: line by line) once the clocks are left out."""
    def read(p: Path) -> list:
        lines = p.read_text().splitlines() if p.suffix == ".jsonl" else [p.read_text()]
        return [without_clocks(json.loads(x)) for x in lines if x.strip()]
    return read(a) == read(b)


def main(a: Path, b: Path) -> int:
    fa, fb = data_files(a), data_files(b)
    same, differ = 0, []
    for name in sorted(set(fa) | set(fb)):
        if name not in fa or name not in fb:
            differ.append(f"only in {a if name in fa else b}: {name}")
        elif hashlib.sha256(fa[name].read_bytes()).digest() == hashlib.sha256(fb[name].read_bytes()).digest():
            same += 1
        elif name.endswith(".safetensors") and same_tensors(fa[name], fb[name]):
            same += 1
        elif name.endswith((".json", ".jsonl")) and same_json(fa[name], fb[name]):
            same += 1
        else:
            differ.append(f"differs: {name}")
    print("\n".join(differ))
    print(f"{same} data files the same, {len(differ)} not")
    for r in (a, b):
        rep = json.loads((r / "eval" / "report.json").read_text())
        print(f"{r}: acceptance length {rep['acceptance_length']:.4f}, per position "
              f"{[round(x, 4) for x in rep['acceptance_per_position']]}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2])))
