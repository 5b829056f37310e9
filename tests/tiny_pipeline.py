"""A whole pipeline at toy sizes on the tiny random target: the inputs that the reliability tests
(test_kill_anywhere.py, test_disk.py) run every stage on, and ways to compare two runs' outputs."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import build_tiny_target

TRAIN_STEPS = 150
THREADS = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}  # tiny models: one thread is fastest on shared cores


def build_talkative_target(path: Path) -> Path:
    """The tiny random Llama of conftest, with the embeddings of whitespace-only tokens zeroed.

    Greedy decoding of the random model otherwise settles on whitespace, which prepare (rightly)
    drops as an empty answer; with those rows at zero (the LM head is tied) their logits are 0
    and some visible token wins."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    build_tiny_target(path)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    blank = [i for i in range(len(tok)) if i not in tok.all_special_ids and not tok.decode([i]).strip()]
    with torch.no_grad():
        model.get_input_embeddings().weight[blank] = 0
    model.save_pretrained(path)
    return path


def write_prompts(path: Path, n: int) -> Path:
    """n conversations (messages JSONL) of different lengths; every third has two user turns."""
    words = "the sea and the sky speak of numbers letters code poems and a helpful assistant".split()
    with open(path, "w") as f:
        for i in range(n):
            q = f"question {i}: " + " ".join(words[: 2 + (i * 7) % len(words)])
            msgs = [{"role": "user", "content": q}]
            if i % 3 == 0:
                msgs += [{"role": "assistant", "content": "an old answer"}, {"role": "user", "content": f"follow-up {i}"}]
            f.write(json.dumps({"id": f"p{i}", "messages": msgs}) + "\n")
    return path


def write_config(path: Path, target: Path, prompts: Path) -> Path:
    """A config for the whole pipeline at toy sizes (each stage takes about a second)."""
    import yaml

    cfg = {
        "target": str(target),
        "generate": {"prompts": str(prompts), "max_tokens": 24, "batch_size": 4},
        "prepare": {"max_length": 128},
        "vocab": {"draft_vocab_size": 64},
        "extract": {"shard_size": 8, "batch_tokens": 64},
        "train": {"max_steps": TRAIN_STEPS, "seq_len": 64, "batch_tokens": 128, "warmup_steps": 2, "lr": 3e-3,
                  "checkpoint_every": 7, "keep_checkpoints": 2, "log_every_s": 0.05},
        "eval": {"prompts": str(prompts), "limit": 2, "max_tokens": 12},
    }
    path.write_text(yaml.safe_dump(cfg))
    return path


def stage_files(run: Path, stage: str, pattern: str) -> dict[str, bytes]:
    d = run / stage
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.glob(pattern))}


def load_weights(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path))


def assert_same_weights(a: dict, b: dict) -> None:
    import torch

    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")
