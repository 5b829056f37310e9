"""`draftsmith run`: stages in order, skipped when their inputs and settings are unchanged, rerun
(with every later stage) when one changes; --from/--until; the demo recipe is the one shipped.

A tiny random target keeps each whole-pipeline run to seconds; killing a `run` and starting it
again is tested in test_kill_anywhere.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from draftsmith import DraftsmithError
from draftsmith.config import load_config
from draftsmith.demo import demo_recipe_text
from draftsmith.pipeline import planned_stages, run_pipeline
from draftsmith.rundir import RunDir
from draftsmith.stages import names as stage_names

STAGES = stage_names()

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [
    "Write a short poem about the sea.",
    "How can I help you today?",
    "def add(a, b): what does it return?",
    "Count from one to ten.",
    "Name three colours of the sky.",
]


@pytest.fixture()
def recipe(lively_target, tmp_path) -> Path:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": t}]}) + "\n"
                               for i, t in enumerate(PROMPTS)))
    cfg = {
        "target": str(lively_target), "dtype": "float32",
        "generate": {"backend": "local", "prompts": str(prompts), "max_tokens": 12, "batch_size": 3},
        "prepare": {"max_length": 64},
        "vocab": {"draft_vocab_size": 64},
        "train": {"max_steps": 3, "batch_tokens": 128, "seq_len": 64, "warmup_steps": 1, "checkpoint_every": 2},
        "eval": {"prompts": str(prompts), "limit": 2, "max_tokens": 8, "num_speculative_tokens": 2, "baseline": False},
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def finished(run: RunDir) -> dict[str, float]:
    """When each stage's manifest was written (a rerun rewrites it; a skip leaves it)."""
    return {s: m["finished"] for s in STAGES if (m := run.read_manifest(s)) is not None}


def test_run_skips_current_stages_and_reruns_changed_ones(recipe, tmp_path, cli):
    run = RunDir(tmp_path / "run")
    run_pipeline(run, load_config(recipe))
    first = finished(run)
    assert list(first) == list(STAGES), "every stage completed"
    assert json.loads((run.path / "pipeline.json").read_text())["finished"] is True

    # unchanged: every stage skipped, nothing rewritten (through the CLI, as a user sees it)
    p = cli("run", str(recipe), "--run", str(run.path), check=True)
    assert p.stdout.count("up to date, skipped") == len(STAGES), p.stdout
    # the thread rule, read from what runs now, taken by the CLI and again before each later stage
    assert p.stdout.count("torch thread") == len(STAGES) and "/proc/stat" in p.stdout, p.stdout
    assert finished(run) == first

    # a training setting: train and everything after it rerun, the data stages are kept
    run_pipeline(run, load_config(recipe, ["train.lr=0.003"]))
    second = finished(run)
    for s in ("generate", "prepare", "vocab", "extract"):
        assert second[s] == first[s], s
    for s in ("train", "export", "eval"):
        assert second[s] > first[s], s

    # an evaluation setting: only eval reruns
    run_pipeline(run, load_config(recipe, ["train.lr=0.003", "eval.max_tokens=6"]))
    third = finished(run)
    assert {s for s in STAGES if third[s] != second[s]} == {"eval"}

    # a changed input file: generate reads the prompts again, and every later stage reruns
    prompts = Path(load_config(recipe).generate.prompts)
    prompts.write_text(prompts.read_text().replace("three colours", "four colours"))
    run_pipeline(run, load_config(recipe, ["train.lr=0.003", "eval.max_tokens=6"]))
    fourth = finished(run)
    assert all(fourth[s] > third[s] for s in STAGES), (third, fourth)
    sample = [json.loads(line) for line in (run.path / "generate" / "samples.jsonl").read_text().splitlines()]
    assert any("four colours" in r["messages"][0]["content"] for r in sample)


def test_run_from_until(recipe, tmp_path):
    cfg = load_config(recipe)
    run = RunDir(tmp_path / "run")
    with pytest.raises(DraftsmithError, match="generate"):  # train needs the data stages first
        run_pipeline(run, cfg, from_stage="train")
    run_pipeline(run, cfg, until_stage="vocab")
    assert set(finished(run)) == {"generate", "prepare", "vocab"}
    assert json.loads((run.path / "pipeline.json").read_text())["stages"] == ["generate", "prepare", "vocab"]
    run_pipeline(run, cfg, from_stage="extract", until_stage="train")
    assert set(finished(run)) == {"generate", "prepare", "vocab", "extract", "train"}
    # a finished store of the other format is not replaced by `run` unless asked (the default
    # changed from bf16 to fp8; a resumed run must not delete days of extraction)
    assert run.read_manifest("extract")["settings"]["store_format"] == "fp8"
    store = {p: p.read_bytes() for p in (run.path / "extract").rglob("*.safetensors")}
    with pytest.raises(DraftsmithError, match=r"holds a finished fp8 store, but extract.store_format is bf16.*overwrite=true"):
        run_pipeline(run, load_config(recipe, ["extract.store_format=bf16"]), from_stage="extract", until_stage="train")
    assert {p: p.read_bytes() for p in (run.path / "extract").rglob("*.safetensors")} == store and store
    with pytest.raises(DraftsmithError, match="--from eval comes after --until train"):
        planned_stages(cfg, "eval", "train")
    with pytest.raises(DraftsmithError, match="--from extract: not a stage of this run"):
        planned_stages(load_config(recipe, ["train.mode=online"]), "extract")


def test_demo_recipe_is_configs_demo_yaml():
    """`draftsmith demo` runs the packaged recipe; configs/demo.yaml is the same file for `run`."""
    shipped = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"
    assert demo_recipe_text() == shipped.read_text()
    cfg = load_config(shipped)
    assert cfg.target == "smollm2-135m" and cfg.generate.backend == "local" and cfg.eval.prompts == "mt-bench"


def test_extra_engine_evaluates_into_its_own_folder(recipe, tmp_path):
    """The demo's second evaluation (vLLM when installed) goes to eval-<engine>/, beside eval/; status
    lists it and `run` skips it when current. The local engine stands in for vLLM here (the vLLM
    engine itself is tested in test_evaluate_vllm.py)."""
    from draftsmith.journal import fmt_duration
    from draftsmith.pipeline import summarize
    from draftsmith.status import render_table, run_status

    run = RunDir(tmp_path / "run")
    cfg = load_config(recipe, [f"generate.limit={len(PROMPTS)}"])  # every prompt; the estimate needs the count
    run_pipeline(run, cfg, extra_engines=("local",))
    report = json.loads((run.path / "eval-local" / "report.json").read_text())
    assert report["engine"] == "local" and report["prompts"] == 2
    assert json.loads((run.path / "pipeline.json").read_text())["stages"][-1] == "eval-local"
    status = run_status(run.path)
    rows = {s["name"]: s for s in status["stages"]}
    assert rows["eval-local"]["state"] == "done" and rows["eval-local"]["on_disk"] == 2
    # each stage's estimate (RUN/estimate.json, written as `run` started) beside what it took
    assert "--hardware cpu --devices 1" in status["estimate"]
    for name in planned_stages(cfg):
        assert rows[name]["estimate_s"] >= 0 and rows[name]["elapsed_s"] is not None, name
    assert sum(rows[name]["estimate_s"] for name in planned_stages(cfg)) > 0
    table = render_table(status)
    assert f"(est. {fmt_duration(rows['train']['estimate_s'])})" in table and "est.: what `draftsmith run`" in table
    assert summarize(run).count("local engine: acceptance length") == 2
    before = run.read_manifest("eval-local")["finished"]
    run_pipeline(run, cfg, extra_engines=("local",))
    assert run.read_manifest("eval-local")["finished"] == before


def test_auto_k_measures_the_k_found_fastest_in_the_same_engine(recipe, tmp_path):
    """eval.num_speculative_tokens auto: the last evaluation serves the trained K; when its table finds another K
    faster, `run` evaluates that K in the same engine into <folder>-k<K> (draftsmith/speedup.py), and a rerun skips
    both."""
    from draftsmith.pipeline import confirm_stage, eval_folder

    run = RunDir(tmp_path / "run")
    cfg = load_config(recipe, ["eval.num_speculative_tokens=auto", "eval.baseline=true"])
    run_pipeline(run, cfg, extra_engines=("local",))
    report = json.loads((run.path / "eval-local" / "report.json").read_text())
    kc = report["k_choice"]
    assert report["num_speculative_tokens"] == kc["measured_k"] == cfg.train.ttt_steps
    stages = json.loads((run.path / "pipeline.json").read_text())["stages"]
    if kc["best_k"] != kc["measured_k"]:
        confirm = f"eval-local-k{kc['best_k']}"
        assert stages[-1] == confirm and run.read_manifest(confirm) is not None
        measured = json.loads((run.path / confirm / "report.json").read_text())
        assert measured["num_speculative_tokens"] == kc["best_k"] and measured["k_choice"]["measured_k"] == kc["best_k"]
        assert confirm_stage(run, cfg, confirm) is None  # a confirmation is not confirmed again
        before = run.read_manifest(confirm)["finished"]
        run_pipeline(run, cfg, extra_engines=("local",))
        assert run.read_manifest(confirm)["finished"] == before
    else:
        assert stages[-1] == "eval-local" and not list(run.path.glob("eval-local-k*"))
    assert eval_folder("eval-vllm-k2", "local") == ("vllm", 2) and eval_folder("eval", "vllm") == ("vllm", None)
    assert eval_folder("eval-k1", "local") == ("local", 1)
    assert confirm_stage(run, load_config(recipe), "eval-local") is None  # K given: nothing to choose


def test_local_generate_reruns_when_the_dtype_changes(recipe, tmp_path):
    """The local backend's greedy answers depend on the dtype it decodes in, so a dtype change is a
    changed setting for generate (and so for every later stage)."""
    run = RunDir(tmp_path / "run")
    run_pipeline(run, load_config(recipe), until_stage="prepare")
    first = finished(run)
    run_pipeline(run, load_config(recipe), until_stage="prepare")
    assert finished(run) == first
    run_pipeline(run, load_config(recipe, ["dtype=bfloat16"]), until_stage="prepare")
    second = finished(run)
    assert second["generate"] > first["generate"] and second["prepare"] > first["prepare"]


def test_summary_reports_only_evaluations_of_the_current_drafter(recipe, tmp_path):
    """An eval-<engine>/ report left from an earlier drafter is not printed as this run's result."""
    from draftsmith.pipeline import summarize

    run = RunDir(tmp_path / "run")
    run_pipeline(run, load_config(recipe), extra_engines=("local",))
    assert summarize(run).count("acceptance length") == 2
    run_pipeline(run, load_config(recipe, ["train.lr=0.003"]))  # a new drafter; eval-local/ not redone
    text = summarize(run)
    assert text.count("acceptance length") == 1 and "eval-local" not in text


def test_each_stage_hands_its_gpu_memory_back_before_the_next_starts(tmp_path, monkeypatch):
    """CUDA patched in: `run` empties PyTorch's cache after every stage, before the next one starts (the Llama-8B
    recipe's eval server found 35 of 79 GB free while the trained target's blocks stayed cached)."""
    import torch

    from test_stages import record_stage_runs

    calls = record_stage_runs(monkeypatch)  # each record's run function, recorded
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    run_pipeline(RunDir(tmp_path / "run"), load_config(None, ["train.mode=offline"]))
    assert calls == [c for s in STAGES for c in (s, "empty_cache")]


def test_the_runs_estimate_is_of_this_machines_gpus_or_said_missing(recipe, tmp_path, monkeypatch, capsys):
    """save_expectation: a node of 8 H200s gets the h200 profile on 8 devices; a GPU without a profile gets one line
    and no estimate.json (an earlier one removed: status must not show another config's estimate)."""
    from draftsmith import pipeline
    from draftsmith.estimate import read_run_estimate

    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    cfg = load_config(recipe, [f"generate.limit={len(PROMPTS)}"])
    monkeypatch.setattr(pipeline, "gpu_names", lambda: ["NVIDIA H200"] * 8)
    pipeline.save_expectation(run, cfg)
    saved = json.loads((run.path / "estimate.json").read_text())
    assert saved["hardware"] == "NVIDIA H200" and saved["devices"] == 8
    assert set(read_run_estimate(run)["stages"]) == set(planned_stages(cfg))
    monkeypatch.setattr(pipeline, "gpu_names", lambda: ["NVIDIA L4"])
    pipeline.save_expectation(run, cfg)
    assert not (run.path / "estimate.json").exists() and read_run_estimate(run) is None
    assert "no estimate beside the stages in status: NVIDIA L4 has no profile" in capsys.readouterr().out
    # a config the estimate refuses: its line, and still no file
    monkeypatch.setattr(pipeline, "gpu_names", lambda: None)
    pipeline.save_expectation(run, load_config(recipe))  # no generate.limit
    assert not (run.path / "estimate.json").exists()
    assert "no estimate beside the stages in status: generate.limit: set it" in capsys.readouterr().out


def test_the_runs_estimate_plans_with_the_answers_lengths_once_generate_has_some(recipe, tmp_path, monkeypatch):
    """Before generate has answers, the estimate plans with generate.planned_answer_tokens (a reasoning recipe's:
    0.85 x max_tokens was ~3x high for Kimi-K2.5), else 0.85 x max_tokens; once generate wrote some, with their own
    mean prompt and answer lengths (a resumed run's status estimate follows what the target really answers)."""
    from draftsmith import pipeline

    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    monkeypatch.setattr(pipeline, "gpu_names", lambda: ["NVIDIA H200"] * 8)

    def saved(*sets):
        pipeline.save_expectation(run, load_config(recipe, [f"generate.limit={len(PROMPTS)}", *sets]))
        return json.loads((run.path / "estimate.json").read_text())

    plain = saved("generate.max_tokens=1000")
    assert plain["assumptions"]["answer_tokens"] == 850 and "0.85 x generate.max_tokens" in plain["command"]
    planned = saved("generate.max_tokens=1000", "generate.planned_answer_tokens=300")
    assert planned["assumptions"]["answer_tokens"] == 300 and "(planned: generate.planned_answer_tokens)" in \
        planned["command"]
    assert planned["stages"]["generate"]["seconds"] < plain["stages"]["generate"]["seconds"]
    (run.path / "generate").mkdir()
    rows = [{"id": f"p{i}", "prompt_tokens": 40, "completion_tokens": 100 + 20 * i} for i in range(5)]
    (run.path / "generate" / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"torn')
    measured = saved("generate.max_tokens=1000", "generate.planned_answer_tokens=300")
    assert measured["assumptions"] == {"prompt_tokens": 40, "answer_tokens": 140}
    assert "(the mean of 5 answers generate wrote)" in measured["command"]
