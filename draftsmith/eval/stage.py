"""`eval`: how much does the exported drafter speed up the target?

An *engine* decodes every prompt with speculative decoding (and, for the speedup, plainly) and
yields one record per prompt (eval/engine.py); this stage appends the records to
RUN/eval/answers.jsonl as they come (so `status` counts them and a rerun resumes), then
aggregates them into RUN/eval/report.json, report.md and acceptance.png (eval/report.py).

Engines (the table ENGINES): `local`, draftsmith's own speculative decoding of the transformers
target (eval/local.py), and `vllm`, a vLLM server serving the target with the exported drafter,
counted from its /metrics (eval/vllm.py).

The report holds its tau beside the validation tau training left in the export and the other engine's tau on the
same prompts (eval/agreement.py); when one falls short of the prediction, the log says so in one line with what
was found different. Evaluating the run's own export rewrites its model card (card.py) with every report.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterator

import torch

from draftsmith import DraftsmithError, kinds
from draftsmith.card import write_card
from draftsmith.eval.agreement import agreement, differences, measured, output_agreement, predicted
from draftsmith.eval.engine import ENGINE_INFO, RECORD_KEYS, EngineContext, read_engine_info, resume_records
from draftsmith.eval.local import local_engine
from draftsmith.eval.report import (ANSWERS, PLOT, REPORT_JSON, REPORT_MD, aggregate, fmt_value, machine_summary,
                                    write_report)
from draftsmith.eval.vllm import BASELINE_FILE, BASELINE_LOG, SERVER_LOG, VLLM_ONLY, vllm_engine, vllm_server_args
from draftsmith.export import CONFIG_FILE, exported_k, speculative_config
from draftsmith.progress import Progress
from draftsmith.prompts import Prompt, load_prompts
from draftsmith.rundir import RunDir, append_json_line, folder_sha256, read_json_object
from draftsmith.speedup import choice as k_choice, summary as k_summary
from draftsmith.stage import StageBook, stage_run, upstream
from draftsmith.host import pick_device, pick_dtype
from draftsmith.target import chat_template_sha256, load_tokenizer, target_info

STAGE = "eval"

ENGINES: dict[str, Callable[[EngineContext], Iterator[dict]]] = {"local": local_engine, "vllm": vllm_engine}


@stage_run(STAGE)
def run_eval(run: RunDir, cfg, *, warmup: bool = True, folder: str = STAGE) -> dict:
    """Decode eval.prompts with eval.engine and write RUN/eval/ (answers, report, plot).
    Resumes from answers.jsonl when the settings and the export are unchanged. Returns the manifest.
    `folder` names the stage folder (the demo evaluates a second engine into eval-vllm/).

        the drafter, target and prompts, checked -> the book (up to date: done) -> the answers not yet
        written -> the report (K's choice, agreement) -> the model card"""
    eval_cfg = cfg.eval
    if eval_cfg.engine not in ENGINES:
        raise DraftsmithError(f"eval.engine={eval_cfg.engine}: not available in this build; "
                              f"use one of {', '.join(ENGINES)}")
    run.ensure()
    started = time.time()
    export_manifest, export_dir = drafter_source(run, eval_cfg.drafter)
    drafter_config = read_json_object(export_dir / CONFIG_FILE)
    if eval_cfg.num_speculative_tokens == "auto":  # resolved before the fingerprint: auto and its K share records
        cfg = cfg.model_copy(deep=True)
        cfg.eval.num_speculative_tokens = exported_k(export_dir)
        eval_cfg = cfg.eval
    info = target_info(cfg.target, cfg.trust_remote_code)
    exported_for = _exported_for(export_dir, drafter_config, info)
    prompts = _eval_prompts(eval_cfg)

    book, record_fp = _book(run, cfg, folder, export_manifest, info, started)
    if (old := book.skip_or_begin(outputs_ok=(run.path / folder / REPORT_JSON).is_file())) is not None:
        return old  # up to date: same export, target, prompts and settings (`run` skips it)
    d = run.stage_dir(folder)
    done = resume_records(d / ANSWERS, record_fp, keep={p.id for p in prompts})

    with book.progress(total=len(prompts), unit="prompts", done=len(done)) as prog:
        if done:
            prog.log(f"resuming: {len(done)} of {len(prompts)} prompts already in {d / ANSWERS}")
        trained = exported_for.get("ttt_steps")
        if trained and eval_cfg.num_speculative_tokens > trained:
            prog.log(f"note: K={eval_cfg.num_speculative_tokens} exceeds the {trained} steps the drafter was "
                     "trained to draft")
        todo = [(i, p) for i, p in enumerate(prompts) if p.id not in done]
        if todo:
            ctx = EngineContext(run=run, cfg=cfg, export_dir=export_dir, todo=todo, prog=prog, warmup=warmup,
                                fingerprint=record_fp, folder=folder)
            _append_answers(ctx, d / ANSWERS, done)
        records = [done[p.id] for p in prompts]
        report = _report(run, cfg, d, records, info, drafter_config, export_manifest, record_fp)
        report["k_choice"] = _k_choice(report, records, drafter_config, export_dir)
        report["agreement"] = _agreement(run, cfg, report, drafter_config, export_dir, folder, info, record_fp,
                                         prompts)
        write_report(d, report, run.path / "train" / "metrics.jsonl")
        _say_report(prog, report)
        if eval_cfg.drafter is None:  # the run's own export: its model card lists every report
            trained_k = int(exported_for.get("ttt_steps") or eval_cfg.num_speculative_tokens)
            if why := write_card(run, export_dir, speculative_config(export_dir, trained_k), cfg.export.repo_id,
                                 base_model_id=cfg.export.base_model):
                prog.log(f"warning: {why}")
    return book.finish(
        counts={"done": len(records), "total": len(prompts), "unit": "prompts"},
        inputs={"export": export_manifest.get("fingerprint"), "prompts": eval_cfg.prompts},
        outputs=[ANSWERS, REPORT_JSON, REPORT_MD, PLOT] + (
            [n for n in (ENGINE_INFO, SERVER_LOG, BASELINE_LOG, BASELINE_FILE) if (d / n).is_file()]
            if eval_cfg.engine == "vllm" else []),
        extra={"report": {k: report[k] for k in ("acceptance_length", "acceptance_per_position", "tokens_per_s",
                                                 "baseline_tokens_per_s", "speedup")}},
    )


def summary(run: RunDir, manifest: dict) -> str:
    """The line `draftsmith eval` prints when done."""
    r = manifest["report"]
    return (f"acceptance length {fmt_value(r['acceptance_length'])}, speedup {fmt_value(r['speedup'])}; "
            f"report: {run.stage_dir(STAGE) / REPORT_JSON}")


def _exported_for(export_dir: Path, drafter_config: dict, info) -> dict:
    """The drafter's config.json `draftsmith` block (export's: what it was trained and exported for; {} for a
    drafter from elsewhere), refused when it names another target than the configured one: a drafter decodes
    only for the target whose states it trained on."""
    exported_for = drafter_config.get("draftsmith") or {}
    if exported_for.get("target_fingerprint") not in (None, info.fingerprint):
        raise DraftsmithError(f"{export_dir / CONFIG_FILE}: the drafter was exported for target "
                              f"{exported_for.get('target')} (fingerprint {exported_for.get('target_fingerprint')}), "
                              f"but target is {info.name} (fingerprint {info.fingerprint})")
    return exported_for


def _eval_prompts(eval_cfg) -> list[Prompt]:
    """The prompts eval decodes (eval.prompts from eval.offset, at most eval.limit; first turns only), refused in one
    line when the selection holds none."""
    prompts = load_prompts(eval_cfg.prompts, limit=eval_cfg.limit, offset=eval_cfg.offset, first_turn_only=True)
    if not prompts:
        raise DraftsmithError(f"eval.prompts: no prompts in {eval_cfg.prompts} "
                              f"(offset {eval_cfg.offset}, limit {eval_cfg.limit})")
    return prompts


def _book(run: RunDir, cfg, folder: str, export_manifest: dict, info, started: float) -> tuple[StageBook, str]:
    """(the stage's book, the fingerprint each answers.jsonl record carries): the eval settings, the export and the
    target make the book's; the records' leave out which prompts are selected."""
    settings = {**cfg.section(STAGE), "dtype": cfg.dtype, "device": cfg.device}
    if cfg.eval.engine == "local":  # the server settings do not change what the local engine computes
        settings["eval"] = {k: v for k, v in settings["eval"].items() if k not in VLLM_ONLY}
    book = StageBook(run, folder, cfg, settings=settings, upstream={"export": export_manifest}, target=info,
                     started=started)
    # a per-prompt record stays valid when only the selection of prompts changes (a larger
    # limit reuses the answers already written)
    record_settings = {**settings, "eval": {k: v for k, v in settings["eval"].items() if k not in ("limit", "offset")}}
    return book, replace(book, settings=record_settings).fingerprint


def _k_choice(report: dict, records: list[dict], drafter_config: dict, export_dir: Path) -> dict | None:
    """report.json's `k_choice` (speedup.py): the K that serves fastest by these records, with where a drafting
    step's time goes (cost_split) and, for a drafter of a kind draftsmith knows, the --speculative-config serving
    it; None without a measured speedup."""
    split = cost_split(report)
    reader = kinds.format_of(drafter_config)  # None: a drafter from elsewhere of a type draftsmith has no kind for
    chosen = k_choice(report, records, bool(reader and reader.block), split["draft_pass"] if split else None)
    if chosen:
        chosen["split"] = split
        chosen["serve"] = speculative_config(export_dir, chosen["best_k"]) if reader is not None else None
    return chosen


def _say_report(prog: Progress, report: dict) -> None:
    """The report in one log line (tau, acceptance per position, throughput against plain decoding, K's choice),
    and the agreement's verdict as a warning when validation and serving disagree."""
    prog.log(f"tau {fmt_value(report['acceptance_length'])}, acceptance per position "
             f"[{', '.join(fmt_value(a) for a in report['acceptance_per_position'])}], "
             f"{fmt_value(report['tokens_per_s'], '.1f')} tok/s vs "
             f"{fmt_value(report['baseline_tokens_per_s'], '.1f')} plain "
             f"(speedup {fmt_value(report['speedup'])}); {k_summary(report['k_choice'])}")
    if report["agreement"]["verdict"]:
        prog.log(f"warning: {report['agreement']['verdict']}")


def _agreement(run: RunDir, cfg, report: dict, drafter_config: dict, export_dir: Path, folder: str, info,
               record_fp: str, prompts: list[Prompt]) -> dict:
    """report.json's `agreement` (eval/agreement.py): this tau beside the validation one and the other engine's."""
    K = cfg.eval.num_speculative_tokens
    d = run.path / folder
    engine_info = read_engine_info(d, record_fp) if cfg.eval.engine == "vllm" else {}
    template = chat_template_sha256(load_tokenizer(info, cfg.trust_remote_code))
    found = differences(run, cfg, report, drafter_config, export_dir, d, engine_info, template, prompts,
                        num_layers=info.num_layers)
    engines = measured(run, report, folder)
    return agreement(predicted(drafter_config, K), engines, found, K,
                     (drafter_config.get("draftsmith") or {}).get("ttt_steps"), output_agreement(run, engines))


def drafter_source(run: RunDir, drafter: str | None) -> tuple[dict, Path]:
    """(the manifest eval depends on, the drafter folder): RUN/export's, or for eval.drafter a
    folder from elsewhere (another toolkit's speculators-format drafter), fingerprinted by the
    sha256 of its config.json and weight files so that a changed drafter is evaluated again."""
    if drafter is None:
        return upstream(run, "export", by="draftsmith eval"), run.path / "export"
    folder = Path(drafter).expanduser().resolve()
    weights = sorted(folder.glob("*.safetensors"))
    if not (folder / CONFIG_FILE).is_file() or not weights:
        raise DraftsmithError(f"eval.drafter={drafter}: not a drafter folder (needs {CONFIG_FILE} and *.safetensors)")
    return {"fingerprint": folder_sha256([folder / CONFIG_FILE, *weights]), "drafter": str(folder)}, folder


def _append_answers(ctx: EngineContext, answers: Path, done: dict[str, dict]) -> None:
    """Run the engine over ctx.todo; each record is appended to answers.jsonl (fsynced) as it comes."""
    engine = ctx.cfg.eval.engine
    for rec in ENGINES[engine](ctx):
        missing = [k for k in RECORD_KEYS if k not in rec]
        if missing:
            raise RuntimeError(f"engine {engine} returned a record without {missing}")
        rec = {**rec, "engine": engine, "fingerprint": ctx.fingerprint}
        append_json_line(answers, rec, fsync=True)
        done[rec["id"]] = rec
        ctx.prog.log(f"{rec['id']}: {rec['output_tokens']} tokens, tau {fmt_value(rec.get('acceptance_length'))}, "
                     f"{fmt_value(rec.get('tokens_per_s'), '.1f')} tok/s"
                     + (f" (plain {fmt_value(rec['baseline']['tokens_per_s'], '.1f')})" if rec.get("baseline") else ""))
        ctx.prog.advance(1)


def _report(run: RunDir, cfg, d: Path, records: list[dict], info, drafter_config: dict, export_manifest: dict,
            record_fp: str) -> dict:
    """The report (report.json's content) of the records and what was evaluated how."""
    eval_cfg = cfg.eval
    device = pick_device(cfg.device)
    report = {
        "engine": eval_cfg.engine, "num_speculative_tokens": eval_cfg.num_speculative_tokens,
        "temperature": eval_cfg.temperature,
        **aggregate(records, eval_cfg.num_speculative_tokens),
        "max_tokens": eval_cfg.max_tokens, "prompts_source": eval_cfg.prompts, "offset": eval_cfg.offset,
        "limit": eval_cfg.limit,
        "target": info.name, "target_fingerprint": info.fingerprint,
        # what "auto" resolved to on this machine
        "dtype": str(pick_dtype(cfg.dtype, device)).removeprefix("torch."), "device": str(device),
        # the run's own export by its place in the run (a moved run names itself); a drafter from elsewhere by its path
        "drafter": str(Path(eval_cfg.drafter).expanduser().resolve()) if eval_cfg.drafter else "export",
        "aux_layers": kinds.export_aux(drafter_config),
        "export_fingerprint": export_manifest.get("fingerprint"), "seed": eval_cfg.seed,
        "machine": machine_summary(f"{torch.cuda.get_device_name(device)} x{torch.cuda.device_count()}"
                                   if device.type == "cuda" else None),
    }
    if eval_cfg.engine == "vllm":
        # what the server ran with (engine.json: also when this rerun had nothing left to decode);
        # dtype is what it was asked for (None: a server of eval.server)
        engine_info = read_engine_info(d, record_fp)
        report.update({"dtype": None if eval_cfg.server else vllm_server_args(cfg, None)[1], "device": "vllm",
                       "concurrency": 1, "server": engine_info.get("server"),
                       "baseline_server": engine_info.get("baseline_server"),
                       "vllm_version": (engine_info.get("server") or {}).get("vllm_version")})
    return report


def cost_split(report: dict) -> dict | None:
    """Where a drafting step's time goes, in plain decoding steps, when the engine timed its drafter (local):
    {draft_pass, verification}; None otherwise (vLLM's /metrics do not split it)."""
    draft_s, drafts, K = report.get("draft_seconds"), report.get("num_drafts"), report["num_speculative_tokens"]
    b_tps = report.get("baseline_tokens_per_s")
    if draft_s is None or not drafts or not b_tps:
        return None
    plain_s = 1.0 / b_tps  # seconds per plain decoding step (one token each)
    return {"draft_pass": draft_s / (drafts * K) / plain_s,
            "verification": (report["seconds"] - draft_s) / drafts / plain_s}
