"""The stage registry (draftsmith/stages.py): every place that lists the stages reads it, so that a
stage added as one record is run by `run` in its place, shown and counted by `status`, makes a folder a
run, is timed by the demo's cost model, and has its command; and each record's references resolve."""

from __future__ import annotations

import dataclasses
import inspect
import json
import time
from pathlib import Path

import pytest

from draftsmith import DraftsmithError, stages
from draftsmith.cli import add_stage_command, app, main
from draftsmith.config import load_config
from draftsmith.demo import Calibration, expected_seconds, stage_groups
from draftsmith.estimate import HARDWARE, CostContext, StageCost, cost_context, estimate, estimate_config, target_shape
from draftsmith.pipeline import planned_stages, run_pipeline
from draftsmith.rundir import RunDir
from draftsmith.stages import COMMON, Count, Option, Stage
from draftsmith.status import render_table, run_status

REPO = Path(__file__).resolve().parents[1]



def cost_quantize(c: CostContext) -> StageCost:
    """The fake stage's cost: the exported drafter read in bf16 and written at one byte a parameter."""
    return StageCost({"tokens": 0, "disk": c.trainable, "memory": 2 * c.trainable, "seconds": 5.0},
                     rates={"quantize": c.trainable / 5.0})


# a stage between export and eval: what a new stage adds is this record and its module
FAKE = Stage(name="quantize", run="tests.fake_stage:run_quantize", section="export",
             inputs=("export/model.safetensors",), outputs=("quantize/parts.jsonl",),
             count=Count("lines", "parts.jsonl", same_unit=True), estimate=f"{__name__}:cost_quantize",
             help="Quantize the exported drafter.", examples=("draftsmith quantize --run runs/r1",),
             demo_group="train",
             options=(*COMMON,
                      Option(("--dtype",), str, "Dtype of the parts (export.dtype).", key="export.dtype"),
                      Option(("--bits", "-b"), int, "Bits per weight.", arg="bits")),
             summary="tests.fake_stage:summary")


@pytest.fixture()
def with_fake(monkeypatch):
    order = list(stages.REGISTRY.values())
    order.insert(order.index(stages.REGISTRY["eval"]), FAKE)
    monkeypatch.setattr(stages, "REGISTRY", {s.name: s for s in order})
    return FAKE


def test_a_new_record_is_planned_shown_counted_and_timed(with_fake, tmp_path):
    cfg = load_config(None, ["train.mode=offline"])
    assert planned_stages(cfg) == ["generate", "prepare", "vocab", "extract", "train", "export", "quantize", "eval"]
    assert planned_stages(cfg, from_stage="quantize") == ["quantize", "eval"]
    assert "quantize" in stage_groups()["train"]

    run = tmp_path / "run"
    (run / "quantize").mkdir(parents=True)  # a folder holding only the new stage's is a run
    assert RunDir(run).is_run()
    (run / "quantize" / "parts.jsonl").write_text('{"a": 1}\n{"a": 2}\n{"a": 3')  # the last line not yet whole
    st = run_status(run)
    assert [r["name"] for r in st["stages"]] == [*planned_stages(cfg)]
    row = next(r for r in st["stages"] if r["name"] == "quantize")
    assert row["on_disk"] == 2 and row["bytes_on_disk"] > 0


def record_stage_runs(monkeypatch) -> list[str]:
    """Every record's run function replaced by one that appends the stage's name to the list returned."""
    calls: list[str] = []

    def stage(name):
        def fn(run, cfg):
            calls.append(name)
            return {"finished": time.time() + 1}
        return fn

    by_ref = {s.run: stage(s.name) for s in stages.REGISTRY.values()}
    load = stages.load  # any other reference (a stage's cost) still resolves
    monkeypatch.setattr(stages, "load", lambda ref: by_ref[ref] if ref in by_ref else load(ref))
    return calls


def test_run_runs_a_new_record_in_its_place(with_fake, tmp_path, monkeypatch):
    calls = record_stage_runs(monkeypatch)
    run_pipeline(RunDir(tmp_path / "run"), load_config(None, ["train.mode=online"]))
    assert calls == ["generate", "prepare", "vocab", "train", "export", "quantize", "eval"]
    assert json.loads((tmp_path / "run" / "pipeline.json").read_text())["stages"] == calls


def test_every_stage_has_its_command_with_its_records_help():
    commands = {c.name or c.callback.__name__: c for c in app.registered_commands}
    own = {"run", "demo", "estimate", "status", "watch"}  # the commands over all stages
    assert set(commands) - own == set(stages.names())
    for s in stages.REGISTRY.values():
        assert commands[s.name].help == s.help and commands[s.name].epilog == s.epilog
        assert all(line.split()[0] in ("draftsmith", "torchrun", "vllm", "(the") for line in s.examples)


def test_a_new_record_gets_its_command_with_its_options(with_fake, tmp_path, monkeypatch, capsys):
    calls = []

    def run_quantize(run, cfg, bits=None):
        calls.append((run.path, cfg.export.dtype, bits))
        return {"parts": bits}

    refs = {FAKE.run: run_quantize, FAKE.summary: lambda run, manifest: f"quantized to {manifest['parts']} bits"}
    monkeypatch.setattr(stages, "load", refs.__getitem__)
    monkeypatch.setattr(app, "registered_commands", list(app.registered_commands))  # the fake's command not kept
    add_stage_command(FAKE)

    main(["quantize", "--run", str(tmp_path / "r"), "--dtype", "float16", "-b", "4", "--set", "export.dtype=float32"])
    assert calls == [(tmp_path / "r", "float16", 4)]  # the option's key wins over --set, as for every stage
    assert capsys.readouterr().out == "quantized to 4 bits\n"
    main(["quantize", "--run", str(tmp_path / "r")])
    assert calls[1] == (tmp_path / "r", "bfloat16", None)  # not given: the config's default, the function's
    capsys.readouterr()

    main(["quantize", "--help"])
    out = capsys.readouterr().out
    assert "Quantize the exported drafter." in out and "-b, --bits <int>" in out and "Bits per weight." in out
    with pytest.raises(SystemExit) as e:
        main(["quantize", "--run", str(tmp_path / "r"), "--bits", "four"])
    assert e.value.code == 2
    assert "Invalid value for '--bits' / '-b'" in capsys.readouterr().err


def test_a_record_without_the_common_options_or_with_an_option_going_nowhere_is_refused():
    with pytest.raises(ValueError, match="quantize: its options must include RUN, CONFIG and SETS"):
        Stage(**{**FAKE.__dict__, "options": (Option(("--bits",), int, "Bits.", arg="bits"),)})
    with pytest.raises(ValueError, match="option --bits needs a `key` or an `arg`"):
        Stage(**{**FAKE.__dict__, "options": (*COMMON, Option(("--bits",), int, "Bits."))})


@pytest.mark.parametrize("name", stages.names())
def test_each_records_references_resolve(name):
    s = stages.get(name)
    fn = s.run_function()
    assert fn.__name__ == f"run_{name}"
    assert list(inspect.signature(fn).parameters)[:2] == ["run", "cfg"]
    cost = stages.load(s.estimate)
    assert cost.__name__ == f"cost_{name}"
    shape = target_shape(REPO / "configs" / "targets" / "llama-3.1-8b-instruct.json", attention="gqa")
    context = cost_context(load_config(REPO / "configs" / "llama-8b-1xh100.yaml"), shape, HARDWARE["h100"], 1, 100, 200)
    row = cost(context).row
    assert {"tokens", "disk", "memory", "seconds"} <= set(row) and row["seconds"] > 0 and row["disk"] > 0
    assert hasattr(load_config(None), s.section)
    assert all(p.split("/")[0] in stages.REGISTRY for p in (*s.inputs, *s.outputs))
    assert all(p.split("/")[0] == name for p in s.outputs)
    if s.summary:
        assert stages.load(s.summary).__module__ == s.module  # in the stage's own module
    assert {o.key.split(".")[0] for o in s.options if o.key} <= {s.section}
    run_args = inspect.signature(fn).parameters
    assert all(o.arg in run_args for o in s.options if o.arg)


@pytest.mark.parametrize("mode", ["offline", "online"])
def test_estimate_costs_the_stages_run_runs_in_its_order(mode):
    shape = target_shape(REPO / "configs" / "targets" / "llama-3.1-8b-instruct.json", attention="gqa")
    cfg = load_config(REPO / "configs" / "llama-8b-1xh100.yaml", [f"train.mode={mode}"])
    e = estimate(cfg, shape, HARDWARE["h100"], 1, prompt_tokens=100, answer_tokens=200)
    assert list(e["stages"]) == planned_stages(cfg) == list(stages.planned(cfg))
    assert ("extract" in e["stages"]) == (mode == "offline")


def test_a_new_records_cost_is_its_row_in_the_estimate_while_it_runs(with_fake, monkeypatch):
    """estimate_config calls each planned record's own cost: the fake stage's row sits in its place, counts in the
    totals and brings its rates; a record whose `runs` is false is not costed at all."""
    target = REPO / "configs" / "targets" / "llama-3.1-8b-instruct.json"
    cfg = load_config(REPO / "configs" / "llama-8b-1xh100.yaml")
    e = estimate_config(cfg, "h100", 1, target, 100, 200)
    assert list(e["stages"]) == planned_stages(cfg) and list(e["stages"])[-2:] == ["quantize", "eval"]
    trainable = e["drafter_params"]
    assert e["stages"]["quantize"] == {"tokens": 0, "disk": trainable, "memory": 2 * trainable, "seconds": 5.0}
    assert e["tokens_per_s"]["quantize"] == trainable / 5.0
    assert e["total"]["disk"] == sum(s["disk"] for s in e["stages"].values())

    stages.REGISTRY["quantize"] = dataclasses.replace(FAKE, runs=lambda cfg: False)
    load = stages.load
    monkeypatch.setattr(stages, "load", lambda ref: pytest.fail(f"{ref}: costed") if ref == FAKE.estimate
                        else load(ref))
    without = estimate_config(cfg, "h100", 1, target, 100, 200)
    assert "quantize" not in without["stages"] and "quantize" not in without["tokens_per_s"]
    assert without["total"]["disk"] == e["total"]["disk"] - trainable
    assert without["stages"] == {k: v for k, v in e["stages"].items() if k != "quantize"}


def test_a_second_evaluation_is_an_eval_and_an_unknown_name_is_refused():
    assert stages.get("eval-vllm") is stages.REGISTRY["eval"]
    with pytest.raises(DraftsmithError, match="bogus: not a stage"):
        stages.get("bogus")


def test_status_notes_a_journal_and_files_that_disagree_for_stages_counting_the_same_unit(with_fake):
    row = {"name": "quantize", "state": "running", "done": 5, "total": 9, "unit": "parts", "rate_per_s": None,
           "eta_s": None, "elapsed_s": None, "heartbeat_age_s": None, "pid": None, "on_disk": 3,
           "bytes_on_disk": 10, "error": None}
    note = "quantize: the journal says 5 parts done, the files on disk hold 3"
    assert note in render_table({"run": "r", "stages": [row]})
    other = {**row, "name": "vocab"}  # vocab counts its files, not the samples its journal counts
    assert "the journal says" not in render_table({"run": "r", "stages": [other]})


def test_every_stage_is_in_a_group_the_demos_cost_model_times():
    timed = expected_seconds(100, 10, Calibration(batch_tokens_per_s=100.0, single_tokens_per_s=10.0, seconds=1.0),
                             with_vllm=True, train_minutes=1.0)
    assert set(stage_groups()) == set(timed)
    assert sorted(n for members in stage_groups().values() for n in members) == sorted([*stages.names(), "eval-vllm"])
