"""eval's report: the records aggregated, RUN/eval/report.json, report.md and acceptance.png.

The only module of draftsmith that imports matplotlib.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, never a window: before pyplot is imported
import matplotlib.pyplot as plt  # noqa: E402

from draftsmith.acceptance import acceptance, fmt as fmt_tau  # noqa: E402
from draftsmith.speedup import summary as speedup_summary  # noqa: E402
from draftsmith.rundir import atomic_path, atomic_write_json, atomic_write_text  # noqa: E402

ANSWERS, REPORT_JSON, REPORT_MD, PLOT = "answers.jsonl", "report.json", "report.md", "acceptance.png"


def machine_summary(gpu: str | None = None) -> str:
    """The machine a report was measured on, in words: `gpu` (its name and count) when it ran on GPUs, else the
    CPU's model and cores."""
    if gpu:
        return gpu
    model = "CPU"
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), model)
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores"


def aggregate(records: list[dict], K: int) -> dict:
    drafts = sum(r["num_drafts"] for r in records)
    accepted = sum(r["num_accepted_tokens"] for r in records)
    per_pos = [sum(r["accepted_per_pos"][j] for r in records) for j in range(K)]
    tokens = sum(r["output_tokens"] for r in records)
    seconds = sum(r["seconds"] for r in records)
    with_base = [r for r in records if r.get("baseline")]
    b_tokens = sum(r["baseline"]["output_tokens"] for r in with_base)
    b_seconds = sum(r["baseline"]["seconds"] for r in with_base)
    tps = tokens / seconds if seconds > 0 else None
    b_tps = b_tokens / b_seconds if with_base and b_seconds > 0 else None
    same = [r["baseline"]["same_tokens"] for r in with_base if r["baseline"].get("same_tokens") is not None]
    _, se = acceptance((r["num_drafts"], r["num_accepted_tokens"]) for r in records)
    return {
        "prompts": len(records),
        "acceptance_length": (1 + accepted / drafts) if drafts else None,
        # one standard error, the delta method over prompts (draftsmith/acceptance.py)
        "acceptance_length_se": se,
        "acceptance_per_position": [c / drafts for c in per_pos] if drafts else [None] * K,
        "tokens_per_s": tps,
        "baseline_tokens_per_s": b_tps,
        "speedup": tps / b_tps if tps and b_tps else None,
        "num_drafts": drafts,
        "num_draft_tokens": sum(r["num_draft_tokens"] for r in records),
        "num_accepted_tokens": accepted,
        "num_accepted_tokens_per_pos": per_pos,
        "output_tokens": tokens,
        "seconds": round(seconds, 3),
        # of seconds, the drafter's passes: an engine that times them (local), on every record
        "draft_seconds": (round(sum(r["draft_seconds"] for r in records), 3)
                          if records and all("draft_seconds" in r for r in records) else None),
        "baseline_output_tokens": b_tokens if with_base else None,
        "baseline_seconds": round(b_seconds, 3) if with_base else None,
        "greedy_same_as_baseline": (sum(same), len(same)) if same else None,
        "finish_reasons": {k: sum(1 for r in records if r["finish_reason"] == k)
                           for k in sorted({r["finish_reason"] for r in records})},
    }


def read_train_metrics(path: Path) -> list[dict]:
    """[{step, split, loss: [per TTT step], acc: [per TTT step], tau}] from train/metrics.jsonl: `split` is
    "train" for a window of training steps, "validation" for a validation pass (train/report.py); tau its
    acceptance length or None. Lines without a step are skipped. `loss` and `acc` may be numbers or lists
    (train writes lists), or `loss_{k}` / `acc_{k}` keys."""
    def per_step(rec: dict, name: str) -> list[float] | None:
        v = rec.get(name)
        if isinstance(v, (int, float)):
            return [float(v)]
        if isinstance(v, list):
            return [float(x) if isinstance(x, (int, float)) else float("nan") for x in v]
        found = sorted((int(m.group(1)), float(x)) for k, x in rec.items()
                       if (m := re.fullmatch(rf"{name}_?(\d+)", k)) and isinstance(x, (int, float)))
        return [x for _, x in found] or None

    rows = []
    if not path.is_file():
        return rows
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(rec, dict) or not isinstance(rec.get("step"), (int, float)):
            continue
        tau = rec.get("acceptance_length")
        rows.append({"step": rec["step"], "split": "validation" if rec.get("split") == "validation" else "train",
                     "loss": per_step(rec, "loss"), "acc": per_step(rec, "acc"),
                     "tau": float(tau) if isinstance(tau, (int, float)) else None})
    return rows


def write_plot(path: Path, report: dict, rows: list[dict]) -> None:
    """The acceptance per position of the report; with training rows (read_train_metrics) also the training
    loss and accuracy per TTT step, and the acceptance length on the fitted batches beside the validation
    one (the figure that predicts serving) over the steps."""
    train_rows = [r for r in rows if r["split"] == "train"]
    val_rows = [r for r in rows if r["split"] == "validation" and r["tau"] is not None]
    panels = 1 + (3 if train_rows else 0)
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 4), squeeze=False)
    ax = axes[0][0]
    acc = [a or 0.0 for a in report["acceptance_per_position"]]
    ax.bar(range(1, len(acc) + 1), acc, color="tab:blue")
    for i, a in enumerate(acc):
        ax.text(i + 1, a + 0.01, f"{a:.2f}", ha="center", va="bottom", fontsize=9)
    ax.set_ylim(0, 1.05)
    ax.set_xticks(range(1, len(acc) + 1))
    ax.set_xlabel("draft position")
    ax.set_ylabel("share of drafts accepted up to here")
    tau = report.get("acceptance_length")
    ax.set_title(f"{report['engine']}: K={report['num_speculative_tokens']}, T={report['temperature']}, "
                 f"tau={tau:.2f}" if tau else f"{report['engine']}: no drafts")
    if train_rows:
        for ax, key, title in ((axes[0][1], "loss", "training loss per TTT step"),
                               (axes[0][2], "acc", "training accuracy per TTT step")):
            n = max((len(r[key]) for r in train_rows if r[key]), default=0)
            for k in range(n):
                pts = [(r["step"], r[key][k]) for r in train_rows if r[key] and len(r[key]) > k]
                ax.plot([s for s, _ in pts], [v for _, v in pts], label=f"TTT step {k}")
            ax.set_xlabel("optimizer step")
            ax.set_title(title)
            if n:
                ax.legend()
        ax = axes[0][3]
        pts = [(r["step"], r["tau"]) for r in train_rows if r["tau"] is not None]
        ax.plot([s for s, _ in pts], [t for _, t in pts], label="training batches", color="tab:gray")
        if val_rows:
            ax.plot([r["step"] for r in val_rows], [r["tau"] for r in val_rows], "o-", label="validation (held out)",
                    color="tab:green")
        if tau:
            ax.axhline(tau, ls="--", color="tab:blue", label=f"{report['engine']} (eval prompts)")
        ax.set_xlabel("optimizer step")
        ax.set_title("acceptance length (chain, K = trained steps)")
        ax.legend()
    fig.tight_layout()
    try:
        with atomic_path(path) as tmp:
            fig.savefig(tmp, format="png", dpi=100)
    finally:
        plt.close(fig)


def fmt_value(x, spec: str = ".2f") -> str:
    return "n/a" if x is None else format(x, spec)


def report_markdown(report: dict) -> str:
    acc = report["acceptance_per_position"]
    same = report.get("greedy_same_as_baseline")
    lines = [
        f"# draftsmith eval: {report['target']}",
        "",
        f"Engine `{report['engine']}`, K = {report['num_speculative_tokens']}, temperature {report['temperature']}, "
        f"max {report['max_tokens']} tokens, {report['prompts']} prompts from `{report['prompts_source']}`, "
        f"dtype {report.get('dtype')}.",
        "",
        "| metric | value |",
        "| --- | --- |",
        f"| acceptance length (tau = 1 + accepted/drafts; ± one standard error over prompts) | "
        f"{fmt_tau(report['acceptance_length'], report.get('acceptance_length_se'), '.3f')} |",
        f"| acceptance per position | {', '.join(fmt_value(a) for a in acc)} |",
        f"| tokens/s with drafting | {fmt_value(report['tokens_per_s'], '.1f')} |",
        f"| tokens/s plain decoding | {fmt_value(report['baseline_tokens_per_s'], '.1f')} |",
        f"| speedup | {fmt_value(report['speedup'])} |",
        f"| drafts / accepted tokens | {report['num_drafts']} / {report['num_accepted_tokens']} |",
        f"| output tokens | {report['output_tokens']} |",
    ]
    if same:
        lines.append(f"| greedy output identical to plain decoding | {same[0]} of {same[1]} prompts |")
    for key, what in (("server", "Server"), ("baseline_server", "Baseline server (no drafting)")):
        srv = report.get(key)
        if srv:
            where = f"`{srv['url']}`" if srv.get("url") else "started by draftsmith"
            args = f", arguments `{' '.join(srv['args'])}`" if srv.get("args") else ""
            log = f", log `{srv['log']}`" if srv.get("log") else ""
            lines += ["", f"{what}: vLLM {srv.get('vllm_version')}, {where}{args}{log}; one request at a time."]
    lines += k_choice_markdown(report.get("k_choice"))
    lines += agreement_markdown(report.get("agreement"), report["num_speculative_tokens"])
    lines += ["", f"Plot: `{PLOT}`. Per-prompt results: `{ANSWERS}`.", ""]
    return "\n".join(lines)


def k_choice_markdown(kc: dict | None) -> list[str]:
    """report.md's section of the speedup at each K (draftsmith/speedup.py)."""
    if not kc:
        return []
    lines = ["", "## K chosen by speed", "",
             f"Measured at K = {kc['measured_k']}; smaller K predicted from the same drafts (the first k positions' "
             "acceptance) and the measured cost of a drafting step: "
             + ("less one timed draft pass per draft fewer." if kc.get("draft_pass") is not None else
                "taken to grow linearly from one plain step (k = 0) to the measured one, which is optimistic where "
                "much of a step does not scale with K (vLLM-CPU).")
             + " A prediction to confirm by serving that K (`eval.num_speculative_tokens: auto` in `draftsmith run` "
             "does); draftsmith/speedup.py.", "",
             "| K | tokens per step (± 1 SE) | step cost (plain steps) | speedup |", "| ---: | ---: | ---: | ---: |"]
    for r in kc["table"]:
        mark = "**" if r["k"] == kc["best_k"] else ""
        lines.append(f"| {mark}{r['k']}{mark} | {fmt_tau(r['tokens_per_step'], r.get('tokens_per_step_se'), '.3f')} "
                     f"| {r['step_cost']:.3f} | {mark}{r['speedup']:.2f}x{mark} |")
    lines += ["", speedup_summary(kc) + "."]
    if kc.get("split"):
        sp = kc["split"]
        lines.append(f"Measured split of a drafting step: {sp['draft_pass']:.3f} plain steps per draft pass, "
                     f"{sp['verification']:.3f} per verification (prefill and sampling included).")
    if kc.get("serve"):
        lines += ["", f"Serve at K = {kc['best_k']}: `--speculative-config '{json.dumps(kc['serve'])}'`"]
    return lines


def agreement_markdown(ag: dict | None, K: int) -> list[str]:
    """report.md's section of the three measurements (eval/agreement.py)."""
    if not ag:
        return []
    lines = ["", "## Validation, local engine, vLLM", "",
             f"Acceptance length at K = {K} of the same drafter three ways: on held-out training samples at the end of "
             "training (T=0), and decoding these prompts with each engine.", "",
             "| measurement | acceptance length (± 1 SE) | per position | where |", "| --- | ---: | --- | --- |"]
    v = ag.get("validation")
    if v:
        tau = fmt_tau(v["acceptance_length"], v.get("acceptance_length_se"), ".3f")
        lines.append(f"| validation (predicted) | {tau} | "
                     f"{', '.join(fmt_value(a) for a in v['acceptance_per_position'])} | {v.get('samples')} held-out "
                     f"samples at step {v.get('step')} |")
    else:
        lines.append(f"| validation (predicted) | n/a | | {ag.get('note', '')} |")
    for name in ("local", "vllm"):
        m = ag.get(name)
        lines.append(f"| {name} engine | {fmt_tau(m['acceptance_length'], m.get('acceptance_length_se'), '.3f')} | "
                     f"{', '.join(fmt_value(a) for a in m.get('acceptance_per_position') or [])} | `{m['folder']}/` |"
                     if m else f"| {name} engine | not measured on these prompts | | |")
    for name in ("vllm", "local"):
        if ag.get(f"{name}_gap") is not None:
            lines.append(f"- validation - {name}: {fmt_tau(ag[f'{name}_gap'], ag.get(f'{name}_gap_se'), '+.3f')}, "
                         f"a finding beyond {ag[f'{name}_tolerance']:.3f} (two combined standard errors, at least "
                         f"the calibrated {ag['calibrated_gap']})")
    if ag.get("engines_gap") is not None:
        lines.append(f"- local - vllm: {fmt_tau(ag['engines_gap'], ag.get('engines_gap_se'), '+.3f')}")
    if ag.get("outputs"):
        o = ag["outputs"]
        lines.append(f"- the two engines' outputs: identical on {o['identical']} of {o['prompts']} prompts; "
                     f"on average the first {o['prefix_share']:.0%} of an answer's tokens agree")
    lines += ["", (f"**{ag['verdict']}**" if ag.get("verdict") else
                   "No engine differs from the prediction by more than its tolerance.")]
    if ag.get("differences") and not ag.get("verdict"):
        lines += ["", "Found different: " + "; ".join(ag["differences"]) + "."]
    return lines


def write_report(d: Path, report: dict, train_metrics: Path) -> None:
    """report.json, report.md and acceptance.png (with the training curves of `train_metrics`) into `d`."""
    atomic_write_json(d / REPORT_JSON, report)
    atomic_write_text(d / REPORT_MD, report_markdown(report))
    write_plot(d / PLOT, report, read_train_metrics(train_metrics))
