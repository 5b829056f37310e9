"""The demo sizes itself to the machine: calibration, the cost model, the plan kept across attempts,
and the estimate of what is left."""

import json

import pytest

from draftsmith.demo import (DEMO_BUDGET_S, MIN_PROMPTS, TRAIN_OVERHEAD_S, Calibration, calibrate, demo_config, explain, plan_demo, remaining_line,
                             size_demo, user_sized)
from draftsmith.config import load_config
from draftsmith.export import run_export
from draftsmith.rundir import RunDir
from draftsmith.speedup import choice

REFERENCE = Calibration(batch_tokens_per_s=96.0, single_tokens_per_s=15.1, seconds=7.0)  # the README's demo machine


def test_the_cost_model_reproduces_the_reference_run_and_scales_down_to_the_budget():
    cfg = demo_config([])
    plan = size_demo(cfg, REFERENCE, with_vllm=False)
    # on the machine the model was fitted on, the recipe's sizes fit the budget as they are
    assert (plan.prompts, plan.questions) == (cfg.generate.limit, cfg.eval.limit)
    assert plan.total_s <= DEMO_BUDGET_S and plan.expected_s["train"] == 60 * cfg.train.max_minutes + TRAIN_OVERHEAD_S
    half = Calibration(batch_tokens_per_s=REFERENCE.batch_tokens_per_s / 2,
                       single_tokens_per_s=REFERENCE.single_tokens_per_s / 2, seconds=10.0)
    slower = size_demo(cfg, half, with_vllm=False)
    # a machine at half the pace: fewer prompts and questions, together; the same minutes of training
    assert slower.prompts < cfg.generate.limit and slower.questions < cfg.eval.limit
    assert slower.total_s == pytest.approx(DEMO_BUDGET_S, rel=0.03)
    assert slower.prompts / cfg.generate.limit == pytest.approx(slower.questions / cfg.eval.limit, rel=0.1)
    assert slower.expected_s["train"] == plan.expected_s["train"]
    fast = Calibration(batch_tokens_per_s=1000.0, single_tokens_per_s=200.0, seconds=1.0)
    assert (size_demo(cfg, fast, False).prompts, size_demo(cfg, fast, False).questions) == (192, 16)  # never upsized
    slow = Calibration(batch_tokens_per_s=5.0, single_tokens_per_s=1.0, seconds=60.0)
    assert size_demo(cfg, slow, True).prompts == MIN_PROMPTS and "eval-vllm" in size_demo(cfg, slow, True).expected_s


def test_the_plan_is_kept_for_the_next_attempt_and_user_sizes_win(tmp_path, monkeypatch):
    import draftsmith.demo as demo

    calls = []
    monkeypatch.setattr(demo, "calibrate", lambda cfg: calls.append(1) or REFERENCE)
    run = RunDir(tmp_path / "run")
    first = plan_demo(run, demo_config([]), with_vllm=False, user_sized=False)
    again = plan_demo(run, demo_config([]), with_vllm=False, user_sized=False)
    assert calls == [1] and (again.prompts, again.questions) == (first.prompts, first.questions)
    assert json.loads((run.path / "demo.json").read_text())["prompts"] == first.prompts
    assert user_sized(["generate.limit=10"]) and not user_sized(["train.lr=1e-3"])
    assert plan_demo(run, demo_config([]), with_vllm=False, user_sized=True) is None


def test_what_is_left_follows_the_pace_of_the_finished_stages():
    plan = size_demo(demo_config([]), REFERENCE, with_vllm=True)
    e = plan.expected_s
    line = remaining_line(plan, {"generate": 2 * e["generate"]})  # generate took twice the estimate
    left = 2 * (e["extract"] + e["eval"] + e["eval-vllm"]) + e["train"]  # training is the clock's, at any pace
    assert f"about {left / 60:.0f} min left" in line and "2.0x" in line
    skipped = remaining_line(plan, {"generate": None})  # up to date: no evidence of pace
    assert "1.0x" in skipped
    # half a group done: what its finished stages took comes off the group's share
    g = e["generate"]
    half = remaining_line(plan, {"generate": g, "prepare": 1.0, "vocab": 1.0})
    left = e["extract"] - 2.0 + e["train"] + e["eval"] + e["eval-vllm"]
    assert f"about {left / 60:.0f} min left" in half and "1.0x" in half
    # training taking its clock says nothing of the machine's pace
    trained = remaining_line(plan, {"generate": g, "prepare": 1.0, "vocab": 1.0, "extract": e["extract"] - 2.0,
                                    "train": 3 * e["train"], "export": 1.0})
    assert "1.0x" in trained and f"about {(e['eval'] + e['eval-vllm']) / 60:.0f} min left" in trained


@pytest.mark.integration
def test_calibration_times_the_real_decoding(tiny_target):
    c = calibrate(demo_config([f"target={tiny_target}"]))
    assert c.batch_tokens_per_s > c.single_tokens_per_s > 0 and c.seconds > 0


def test_the_last_lines_say_what_the_numbers_mean(tmp_path, monkeypatch, tiny_target, drafter_checkpoint):
    """The demo ends with what tau and speedup mean on this machine: a drafting step's cost in plain steps is
    tau / speedup (measured, not assumed), the break-even tau is that cost, and where the drafter and reports are."""
    run = RunDir(tmp_path / "run").ensure()
    monkeypatch.setattr("draftsmith.demo.current_evals", lambda r: ["eval", "eval-vllm"])  # this drafter's reports
    # the vLLM report holds the validation tau beside both engines' (eval/agreement.py)
    agreement = {"validation": {"acceptance_length": 1.45, "acceptance_length_se": 0.03, "samples": 12},
                 "vllm_gap": 0.14, "vllm_gap_se": 0.05, "vllm_tolerance": 0.10,
                 "local_gap": 0.19, "local_gap_se": 0.05, "local_tolerance": 0.10,
                 "outputs": {"prompts": 16, "identical": 4, "prefix_share": 0.41},
                 "differences": ["prompts: eval's `mt-bench` is not the training distribution (`sharegpt`); "
                                 "validation predicts prompts like the training ones"],
                 "verdict": "vllm tau 1.31 is 0.14 under ..."}
    for folder, engine, tau, speedup in (("eval", "local", 1.26, 0.70), ("eval-vllm", "vllm", 1.31, 0.95),
                                         ("eval-old", "vllm", 3.0, 9.9)):  # an earlier drafter's: not explained
        (run.path / folder).mkdir()
        (run.path / folder / "report.json").write_text(json.dumps(
            {"engine": engine, "num_speculative_tokens": 3, "acceptance_length": tau, "speedup": speedup,
             "acceptance_length_se": 0.04,
             **({"agreement": agreement} if folder == "eval-vllm" else {})}))
    drafter_checkpoint(run.path / "train" / "final", str(tiny_target))  # the served line reads the real export
    run_export(run, load_config(None, [f"target={tiny_target}"]))
    text = explain(run)
    assert '"method": "eagle3", "num_speculative_tokens": 3' in text  # the served line names the kind and K
    assert "1.0 when every guess of the drafter is rejected, 4 when all 3 are accepted" in text
    assert "local engine, K = 3: tau 1.26 ± 0.04, 0.70x (slower than plain decoding): a drafting step" in text
    assert "K chosen by speed" not in text  # no report has a table
    assert "costs 1.80 plain steps here, so drafting pays only above tau 1.80" in text  # 1.26 / 0.70
    assert "costs 1.38 plain steps" in text  # 1.31 / 0.95
    assert str(run.path / "export") in text and str(run.path / "eval-vllm" / "report.md") in text
    assert "3.00" not in text and "eval-old" not in text
    # the three measurements and what their gaps mean
    assert "- validation: tau 1.45 ± 0.03 on 12 held-out training answers" in text
    assert ("- local engine: tau 1.26 ± 0.04 on the eval prompts (-0.19 ± 0.05 against validation, beyond its "
            "tolerance 0.10);") in text
    assert "- vllm engine: tau 1.31 ± 0.04 on the eval prompts (-0.14 ± 0.05" in text
    # the engines' agreement is a measured share, never a claim that they verify the same drafts
    assert "identical answers on 4 of 16 prompts (on average the first 41% of an answer agrees)" in text
    assert "verify the same drafts" not in text
    assert "Prompts: eval's `mt-bench` is not the training distribution" in text
    # the verdict is printed even when the prompts differ (it used to be replaced by the distribution line)
    assert "Eval's verdict: vllm tau 1.31 is 0.14 under ..." in text
    monkeypatch.setattr("draftsmith.demo.current_evals", lambda r: [])
    assert explain(RunDir(tmp_path / "empty").ensure()) == ""


def test_the_last_lines_name_the_k_found_fastest_and_serve_it(tmp_path, monkeypatch, tiny_target,
                                                              drafter_checkpoint):
    """eval.num_speculative_tokens auto: the demo's vLLM eval at the trained K predicts K = 1 faster, the pipeline
    measures K = 1 (eval-vllm-k1), and the closing lines give that measurement and serve at K = 1."""
    run = RunDir(tmp_path / "run").ensure()
    monkeypatch.setattr("draftsmith.demo.current_evals", lambda r: ["eval-vllm", "eval-vllm-k1"])
    for folder, per_pos, tau, speedup in (("eval-vllm", [0.25, 0.05, 0.01], 1.31, 0.95),
                                          ("eval-vllm-k1", [0.25], 1.25, 1.03)):
        report = {"engine": "vllm", "num_speculative_tokens": len(per_pos), "acceptance_length": tau,
                  "speedup": speedup, "acceptance_per_position": per_pos, "machine": "CPU"}
        (run.path / folder).mkdir()
        (run.path / folder / "report.json").write_text(json.dumps({**report, "k_choice": choice(report, [], False)}))
    drafter_checkpoint(run.path / "train" / "final", str(tiny_target))
    run_export(run, load_config(None, [f"target={tiny_target}"]))
    text = explain(run)
    assert "vllm engine, K = 1: tau 1.25" in text and "vllm engine, K = 3: tau 1.31" in text
    assert ("K chosen by speed (vllm engine): best K = 1: 1.03x plain decoding (measured), measured in "
            "eval-vllm-k1/. Serve it at K = 1.") in text
    assert '"num_speculative_tokens": 1' in text


def test_a_plan_made_by_another_cost_model_is_made_again(tmp_path, monkeypatch):
    """A demo.json written before the cost model's groups changed (extract+train as one) would leave a group
    no stage ever finishes: the plan is calibrated again."""
    import draftsmith.demo as demo

    run = RunDir(tmp_path / "run")
    run.ensure()
    (run.path / "demo.json").write_text(json.dumps({
        "prompts": 165, "questions": 37, "calibration": {"batch_tokens_per_s": 90, "single_tokens_per_s": 14, "seconds": 5},
        "expected_s": {"generate": 300, "extract+train": 400, "eval": 300}}))
    calls = []
    monkeypatch.setattr(demo, "calibrate", lambda cfg: calls.append(1) or REFERENCE)
    plan = plan_demo(run, demo_config([]), with_vllm=False, user_sized=False)
    assert calls == [1] and set(plan.expected_s) == {"generate", "extract", "train", "eval"}
