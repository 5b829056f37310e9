"""The drafter folder says what it is: RUN/export/README.md (a Hugging Face model card) and provenance.json.

Written by `export` and rewritten by `eval` whenever it adds a report, from the run directory's own records
(config.json, the stages' manifests and resolved configs, the eval reports). What is published must name no
machine: every value is checked for absolute paths before it is written (a path inside the run is written
relative to it, any other absolute path as its last part), and nothing here reads an API key (configs name only
the environment variable that holds one).

README.md: YAML front matter (`base_model` = the target's Hub id when there is one, no `library_name` (render_card
says why), tags with the kind; the license is left to the user), then the kind and its sizes, the aux layer ids,
the draft vocabulary and its coverage, the training data, the samples and tokens trained, steps and wall time, the
validation acceptance, every eval report found (each acceptance length with its standard error where the report
has one), the exact `vllm serve` line at the K its newest eval found fastest (draftsmith/speedup.py: vLLM's report
before the local one's) and how to upload the folder.

provenance.json: draftsmith's version, the resolved config of every stage (RUN/<stage>/config.yaml), and the
sha256 of each input file (the prompt files, the target's config.json, the files of the folder itself).

The card is data, not a script: every user-given string it shows (the target's name, prompt sources, machines) sits
in a Markdown code span fenced longer than any backtick run it holds, with control characters shown as `?`, and
every command line in it is built by shlex (each argument quoted), so no name can close a fence, start a heading or
run a command when the line is pasted; export.repo_id and export.base_model are Hub ids (config.py refuses others).
The front matter is written by PyYAML and read back by `front_matter` before the card is kept.

No torch: a file format (the caller passes the `--speculative-config` it serves with).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
from pathlib import Path
from typing import Any

import yaml

from draftsmith import __version__, kinds
from draftsmith.acceptance import fmt as fmt_tau
from draftsmith.checkpoint_format import BEST_DIR
from draftsmith.config import is_hub_id
from draftsmith.rundir import RunDir, atomic_write_json, atomic_write_text
from draftsmith.speedup import chosen as chosen_k, summary as speedup_summary
from draftsmith.stages import names as stage_names

CARD = "README.md"
PROVENANCE = "provenance.json"
# what `hf upload` publishes of RUN/export (the rest is the stage's bookkeeping, which names this machine)
PUBLISHED = ("config.json", "model.safetensors", CARD, PROVENANCE)
# the export.format SGLang loads (the EAGLE-3 layout): its card gives an SGLang line beside vLLM's
SGLANG_FORMAT = kinds.FORMATS[1]
REPO_PLACEHOLDER = "YOUR-ORG/YOUR-DRAFTER"  # the card's serve and upload lines until export.repo_id names the repo


# -------------------------------------------------------------------------------------------------
# No path of this machine


def scrub_paths(value: Any, root: Path) -> Any:
    """`value` (JSON-like) with every absolute path in its strings made publishable: inside `root` (the run) as
    `RUN/<relative>`, anything else as its last part. Also reaches paths inside longer strings."""
    root_s = str(Path(root).resolve())

    def one(s: str) -> str:
        s = s.replace(root_s, "RUN")
        # an absolute path (not a URL's //host/...) -> its last part
        return re.sub(r"(?<![\w.~:/-])/(?:[^\s/'\",;:]+/)+([^\s/'\",;:]*)", lambda m: m.group(1) or "/", s)

    if isinstance(value, str):
        return one(value)
    if isinstance(value, list):
        return [scrub_paths(v, root) for v in value]
    if isinstance(value, dict):
        return {k: scrub_paths(v, root) for k, v in value.items()}
    return value


def has_absolute_path(text: str) -> bool:
    """Whether `text` holds something that looks like an absolute POSIX path (two components or more)."""
    return re.search(r"(?<![\w.~:/-])/(?:[^\s/'\",;:]+/)+[^\s/'\",;:]+", text) is not None


# -------------------------------------------------------------------------------------------------
# Reading the run's records


def _json(path: Path) -> dict:
    try:
        v = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return v if isinstance(v, dict) else {}


def _sha256(path: Path) -> str | None:
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    except OSError:
        return None
    return h.hexdigest()


def parameter_count(weights: Path) -> int | None:
    """Elements in a safetensors file, from its header alone (no tensor is read)."""
    try:
        with open(weights, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
    except (OSError, ValueError):
        return None
    total = 0
    for name, t in header.items():
        if name == "__metadata__" or name in ("d2t", "t2d"):
            continue
        size = 1
        for d in t.get("shape", []):
            size *= int(d)
        total += size
    return total


def eval_reports(run: RunDir, export_fingerprint: str | None) -> list[dict]:
    """Every eval report of the run (eval/ and eval-*/) of this export, oldest first, each with its folder."""
    out = []
    for d in sorted([run.path / "eval", *run.path.glob("eval-*")]):
        rep = _json(d / "report.json")
        if not rep or rep.get("acceptance_length") is None:
            continue
        if export_fingerprint and rep.get("export_fingerprint") not in (None, export_fingerprint):
            continue
        out.append({**rep, "folder": d.name})
    return out


def _kind(cj: dict) -> str:
    """The kind the export says (draftsmith.kind), else the one whose format it is in."""
    written = (cj.get("draftsmith") or {}).get("kind")
    found = kinds.format_of(cj)
    return str(written or (found.name if found else cj.get("speculators_model_type") or "?"))


def _sizes(cj: dict) -> dict:
    layer = cj.get("transformer_layer_config") or cj
    return {k: layer.get(k) for k in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                                      "num_key_value_heads", "kv_lora_rank", "q_lora_rank") if layer.get(k) is not None}


# -------------------------------------------------------------------------------------------------
# The card


def base_model(target: str | None, configured: str | None) -> str | None:
    """The card's `base_model`: export.base_model, else the target's published name when it is a Hub id (the Hub
    links only an `org/name`; a folder's or a .gguf file's own name would be an invalid one); else None, left out."""
    return configured or (target if is_hub_id(target) else None)


def card_facts(run: RunDir, export_dir: Path, serve: dict, repo_id: str | None, reports: bool = True,
               base_model_id: str | None = None) -> dict:
    """Everything the card says, read from the run directory (module doc); `reports`: with the run's eval reports
    of this export (export itself writes the card of a new export, which has none yet); `base_model_id`:
    export.base_model."""
    cj = _json(export_dir / "config.json")
    layer = cj.get("transformer_layer_config") or cj
    ds = cj.get("draftsmith") or {}
    man = {s: run.read_manifest(s) or {} for s in stage_names()}
    resolved = stage_configs(run)
    gen_settings = (resolved.get("generate") or {}).get("generate") or {}
    train_settings = (resolved.get("train") or {}).get("train") or {}
    regenerated = man["generate"].get("inputs", {}).get("target") if isinstance(man["generate"].get("inputs"),
                                                                                 dict) else None
    repo = repo_id or REPO_PLACEHOLDER
    target = (ds.get("target_id") or (cj.get("speculators_config") or {}).get("verifier", {}).get("name_or_path")
              or ds.get("verifier") or ds.get("target"))
    train_counts = man["train"].get("counts") or {}
    found = eval_reports(run, man["export"].get("fingerprint")) if reports else []
    chosen = chosen_k(found)  # draftsmith/speedup.py
    return {
        "target": target, "base_model": base_model(target, base_model_id),
        "kind": _kind(cj), "format": kinds.layout_of(cj), "sizes": _sizes(cj),
        "format_name": reader.format_name(cj) if (reader := kinds.format_of(cj)) else None,
        "parameters": parameter_count(export_dir / "model.safetensors"),
        "aux_layers": kinds.export_aux(cj),
        "draft_vocab_size": cj.get("draft_vocab_size"), "vocab_size": layer.get("vocab_size"),
        "coverage": (man["vocab"].get("counts") or {}).get("coverage", man["vocab"].get("coverage")),
        "data": {"prompts": gen_settings.get("prompts"), "backend": gen_settings.get("backend"),
                 "temperature": gen_settings.get("temperature"), "max_tokens": gen_settings.get("max_tokens"),
                 "answers_per_prompt": gen_settings.get("answers_per_prompt", 1),
                 "samples": (man["prepare"].get("counts") or {}).get("samples"),
                 "tokens": (man["prepare"].get("counts") or {}).get("tokens"),
                 "masked_tokens": (man["prepare"].get("counts") or {}).get("masked_tokens"),
                 "reasoning_turns": (man["prepare"].get("counts") or {}).get("reasoning_turns"),
                 "regenerated_by": regenerated.get("name") if isinstance(regenerated, dict) else regenerated},
        "train": {"mode": train_settings.get("mode"), "steps": ds.get("step"), "ttt_steps": ds.get("ttt_steps"),
                  "optimizer": train_settings.get("optimizer"), "lr": train_settings.get("lr"),
                  "minutes": train_counts.get("train_minutes"),
                  "wall_s": man["train"].get("seconds"), "world_size": man["train"].get("world_size"),
                  "tokens": train_counts.get("tokens"), "samples_read": train_counts.get("samples"),
                  # what train read of the data (a run from before it counted them has none: the card then
                  # counts no token as trained)
                  "samples": train_counts.get("trained_samples"), "held_out": train_counts.get("held_out"),
                  "trained_tokens": train_counts.get("trained_tokens"),
                  "loss_on": train_settings.get("loss_on", "assistant"),
                  "loss_skip_tokens": train_settings.get("loss_skip_tokens", 0)},
        "validation": ds.get("validation"), "checkpoint": ds.get("checkpoint"),
        "init_from": ds.get("init_from") if isinstance(ds.get("init_from"), dict) else None,
        "validation_passes": ds.get("validation_passes"),
        "reports": found, "k_choice": chosen,
        "serve": {**serve, "model": repo, **({"num_speculative_tokens": chosen["best_k"]} if chosen else {})},
        "repo": repo, "repo_set": repo_id is not None,
    }


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def _shown(x: Any) -> str:
    """A user-given value as one line of text: control characters (newlines included) as `?`."""
    return _CONTROL.sub("?", str(x))


def _code(x: Any) -> str:
    """`x` as a Markdown code span: fenced by more backticks than any run inside it (CommonMark), padded by a space
    where it starts or ends with one, so nothing in it renders as Markdown or HTML."""
    text = _shown(x)
    fence = "`" * (max((len(r) for r in re.findall(r"`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def _cell(x: Any) -> str:
    """_code for a table cell: a `|` escaped (GitHub's tables split cells at it even inside a code span)."""
    return _code(x).replace("|", "\\|")


def _num(x, spec: str = ".2f") -> str:
    return "n/a" if not isinstance(x, (int, float)) else format(x, spec)


def _tau(figures: dict) -> str:
    """An acceptance length with its standard error (`acceptance_length_se`) as `1.374 ± 0.045`; the figure alone
    where there is none (a report or an export from before they carried one)."""
    return fmt_tau(figures.get("acceptance_length"), figures.get("acceptance_length_se"), ".3f")


def _has_se(f: dict) -> bool:
    return any(isinstance((r or {}).get("acceptance_length_se"), (int, float))
               for r in [f["validation"], *f["reports"]])


def _selected(f: dict) -> str:
    """What the validation figure is of: the checkpoint export.checkpoint=best picked (the largest of N passes,
    high by selection), or nothing for the weights training ended with."""
    ck = str(f.get("checkpoint") or "")
    if not ck.endswith(f"/{BEST_DIR}"):
        return ""
    n = f.get("validation_passes")
    return (f"; the exported checkpoint is `{ck}`, picked as the best of {n if n else 'several'} validation passes, "
            "so this figure reads high by selection: eval's figures below are the unbiased ones")


def _trained(t: dict) -> str:
    """What training read of the data: its samples, the held-out ones, the tokens in its loss (train.loss_on)."""
    if t.get("trained_tokens") is None:
        return ""
    on = "every token" if t["loss_on"] == "all" else "the answers' tokens"
    skip = f", each sample's first {t['loss_skip_tokens']} left out" if t.get("loss_skip_tokens") else ""
    held = f" ({t['held_out']} held out for validation)" if t.get("held_out") else ""
    # a run stopped inside its first epoch (train.max_minutes, max_steps) read only some of them
    part = (f"; the steps read {_num(t['samples_read'], ',d')} samples, less than one pass"
            if isinstance(t.get("samples_read"), int) and isinstance(t.get("samples"), int)
            and t["samples_read"] < t["samples"] else "")
    return (f"on {_num(t['samples'], ',d')} samples{held} and their {_num(t['trained_tokens'], ',d')} tokens trained "
            f"(the loss on {on}{skip}{part}), ")


def _started_from(init: dict | None) -> list[str]:
    """The card's row naming the released drafter training started from (train.init_from), if any."""
    if not init:
        return []
    how = ("its draft vocabulary kept" if init.get("vocab") == "keep"
           else "its LM head rows remapped to this run's draft vocabulary")
    return [f"| started from (train.init_from) | {_cell(init.get('source'))} ({init.get('format')} format, sha256 "
            f"`{str(init.get('sha256'))[:12]}`), every weight but the target's embeddings, {how}; fine-tuned from "
            "there with a fresh optimizer |"]


def card_front(f: dict) -> dict:
    """The card's YAML front matter from card_facts."""
    # No `library_name`: the Hub knows a library only by a key of huggingface.js packages/tasks/src/model-libraries.ts
    # (read 2026-12-07 at commit fe42e68; the file last changed in ece43c3, 2026-08-12), and neither `vllm` nor
    # `speculators` is one: vLLM is a local app there (local-apps.ts), offered on models tagged `transformers` or
    # GGUF. `transformers` would be recognised but false: it cannot load a speculators drafter, and the vLLM button
    # it brings would serve the drafter as a model. Left out, a repo created after August 2024 gets no library
    # guessed from its config.json (hub-docs docs/hub/model-cards.md, "Specifying a library"); the tags `vllm` and
    # `speculators` say what loads it, as on the speculators drafters RedHatAI publishes.
    # An export in the EAGLE-3 layout says `sglang` instead of `speculators`: SGLang loads it (and vLLM too).
    loads = ["sglang", "vllm"] if f["format"] == SGLANG_FORMAT else ["speculators", "vllm"]
    return {**({"base_model": f["base_model"]} if f["base_model"] else {}), "pipeline_tag": "text-generation",
            "tags": ["speculative-decoding", f["kind"], "draftsmith", *loads]}


def render_card(f: dict) -> str:
    """README.md from card_facts."""
    kind = f["kind"]
    front = card_front(f)
    s = f["sizes"]
    sizes = ", ".join(f"{k.replace('num_', '').replace('_', ' ')} {v}" for k, v in s.items())
    d, t, v = f["data"], f["train"], f["validation"] or {}
    lines = ["---", yaml.safe_dump(front, sort_keys=False).rstrip(), "---", "",
             f"# {kinds.get(kind).label if kind in kinds.names() else kind} drafter for {_code(f['target'])}", "",
             f"A draft model for speculative decoding of {_code(f['target'])} in "
             f"{'SGLang and vLLM' if f['format'] == SGLANG_FORMAT else 'vLLM'}, trained with draftsmith "
             f"{__version__}. It proposes tokens that the target verifies; the output is the target's own.", "",
             "| | |", "| --- | --- |",
             f"| kind | `{kind}` |",
             f"| format | {_cell(f['format_name'] or f['format'])} (`export.format={f['format']}`) |",
             f"| size | {sizes}; {_num(f['parameters'], ',d') if f['parameters'] else 'n/a'} parameters besides the "
             "target's embeddings, which it shares |",
             f"| target layers it reads (aux layer ids) | {f['aux_layers']} |",
             f"| draft vocabulary | {f['draft_vocab_size']} of {f['vocab_size']} tokens, covering "
             f"{_num(100 * f['coverage'] if isinstance(f['coverage'], (int, float)) else None, '.1f')} % of the "
             "training answers' tokens |",
             f"| training data | {d['samples']} samples from {_cell(d['prompts'])}, {_num(d['tokens'], ',d')} tokens "
             f"({_num(d['masked_tokens'], ',d')} in the answers), answers regenerated by the target "
             f"({_cell(d['regenerated_by'])}, backend {d['backend']}, temperature {d['temperature']}, "
             f"{d['answers_per_prompt']} answer(s) per prompt, at most {d['max_tokens']} tokens"
             + (f", {d['reasoning_turns']} with reasoning, kept" if d.get("reasoning_turns") else "") + ") |",
             f"| training | {t['mode']}, {t['steps']} steps of {t['ttt_steps']} drafting steps, {t['optimizer']} lr "
             f"{t['lr']}, {_trained(t)}{_num(t['tokens'], ',d')} tokens read by the steps, "
             f"{_num(t['minutes'], '.1f')} min of steps "
             f"({_num((t['wall_s'] or 0) / 60 if t['wall_s'] else None, '.1f')} min wall) on {t['world_size']} "
             "rank(s) |",
             *_started_from(f["init_from"]),
             f"| validation (held-out samples, T=0, K={len(v.get('acceptance_per_position') or []) or 'n/a'}) | "
             + (f"acceptance length {_tau(v)}, per position "
                f"{', '.join(_num(a, '.3f') for a in v.get('acceptance_per_position') or [])} over "
                f"{v.get('samples')} samples at step {v.get('step')}{_selected(f)} |" if v else "not measured |"),
             "", "## Measured acceptance and speed", ""]
    if f["reports"]:
        lines += ["| engine | K | T | prompts | acceptance length | per position | speedup | machine |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in f["reports"]:
            lines.append(f"| {r.get('engine')} | {r.get('num_speculative_tokens')} | {r.get('temperature')} | "
                         f"{r.get('prompts')} of {_cell(r.get('prompts_source'))} | "
                         f"{_tau(r)} "
                         f"| {', '.join(_num(a) for a in r.get('acceptance_per_position') or [])} | "
                         f"{_num(r.get('speedup'))}x | {_cell(r['machine']) if r.get('machine') else 'n/a'} |")
        lines += ["", "The acceptance length is the tokens the target emits per verification step (1 + accepted "
                  "drafts per draft); the speedup is over plain decoding on the same machine, one request at a time."]
    else:
        lines.append("No evaluation yet (`draftsmith eval --run RUN`).")
    if _has_se(f):
        lines += ["", "An acceptance length written `a ± b` was measured as `a` with a standard error of `b` (± is "
                  "one standard error)."]
    serve = shlex.join(["vllm", "serve", _shown(f["target"]), "--speculative-config",
                        json.dumps(f["serve"], sort_keys=True)])
    if f["format"] == SGLANG_FORMAT:  # a chain of K drafts: one candidate per step, K + 1 tokens verified
        k = int(f["serve"].get("num_speculative_tokens") or 3)
        serve += "\n" + shlex.join(["python", "-m", "sglang.launch_server", "--model", _shown(f["target"]),
                                    "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path",
                                    _shown(f["repo"]), "--speculative-num-steps", str(k), "--speculative-eagle-topk",
                                    "1", "--speculative-num-draft-tokens", str(k + 1)])
    upload = shlex.join(["hf", "upload", _shown(f["repo"]), "RUN/export",
                         *(a for p in PUBLISHED for a in ("--include", p))])
    lines += ["", "## Serve it", ""]
    if kc := f.get("k_choice"):
        lines += [f"At K = {kc['best_k']} draft tokens per step ({speedup_summary(kc)}; {kc['engine']} engine on "
                  f"{_cell(kc.get('machine'))}, report `{kc.get('folder')}/report.md`). The fastest K depends on the "
                  "machine: measure yours with `draftsmith eval --set eval.num_speculative_tokens=auto`.", ""]
    lines += ["```bash", serve, "```", "", "## Upload it", "", "```bash", upload, "```", ""]
    if not f["repo_set"]:
        lines += [f"`{REPO_PLACEHOLDER}` stands for your repository: set `export.repo_id` and the card names it.", ""]
    lines += [f"How it was made: `{PROVENANCE}` (draftsmith's version, every stage's resolved config, the sha256 of "
              "each input). License: set by whoever publishes it (the target's license may bind it).", ""]
    return "\n".join(lines)


def stage_configs(run: RunDir) -> dict[str, dict]:
    """The resolved config each stage ran with (RUN/<stage>/config.yaml), by stage; unreadable ones left out."""
    configs = {}
    for stage in stage_names():
        try:
            c = yaml.safe_load((run.path / stage / "config.yaml").read_text(encoding="utf-8"))
        except (OSError, yaml.YAMLError):
            continue
        if isinstance(c, dict):
            configs[stage] = c
    return configs


def provenance(run: RunDir, export_dir: Path) -> dict:
    """draftsmith's version, every stage's resolved config, the sha256 of each input file (module doc)."""
    configs = stage_configs(run)
    inputs: dict[str, str | None] = {}
    for stage, key in (("generate", "prompts"), ("eval", "prompts")):
        spec = (configs.get(stage) or {}).get(stage, {}).get(key) if isinstance(configs.get(stage), dict) else None
        if isinstance(spec, str) and os.path.isfile(spec):
            inputs[f"{stage}.prompts"] = _sha256(Path(spec))
    target = (run.read_manifest("export") or {}).get("settings", {}).get("target")
    cj = _json(export_dir / "config.json")
    ds = cj.get("draftsmith") or {}
    inputs["target config.json"] = ds.get("target_config_sha256")
    for name in ("config.json", "model.safetensors"):
        inputs[f"export/{name}"] = _sha256(export_dir / name)
    for stage, name in (("generate", "samples.jsonl"), ("prepare", "samples.jsonl"), ("vocab", "vocab.safetensors")):
        inputs[f"{stage}/{name}"] = _sha256(run.path / stage / name)
    started = {"init_from": ds["init_from"]} if isinstance(ds.get("init_from"), dict) else {}
    return scrub_paths({"draftsmith": __version__, "target": ds.get("target_id") or target,
                        "target_fingerprint": ds.get("target_fingerprint"), **started, "configs": configs,
                        "sha256": inputs}, run.path)


def write_card(run: RunDir, export_dir: Path, serve: dict, repo_id: str | None, reports: bool = True,
               base_model_id: str | None = None) -> str | None:
    """README.md and provenance.json into `export_dir` (atomically); `reports` and `base_model_id` as card_facts'.
    Returns None, or why the card was not written (a path of this machine that got past scrub_paths: the files
    stay as they were, and the stage goes on: the drafter does not depend on its card)."""
    facts = scrub_paths(card_facts(run, export_dir, serve, repo_id, reports, base_model_id), run.path)
    text = scrub_paths(render_card(facts), run.path)
    prov = provenance(run, export_dir)
    for name, body in ((CARD, text), (PROVENANCE, json.dumps(prov))):
        if has_absolute_path(body):  # scrub_paths covers every string; this guards what it could miss
            return f"{export_dir / name} not written: it would name a path of this machine"
    try:  # read back by the reader the card is checked with: a card whose front matter says other is not kept
        read_back = front_matter(text)
    except ValueError as e:
        read_back = str(e)
    if read_back != card_front(facts):
        return f"{export_dir / CARD} not written: its front matter does not read back as written ({read_back!r:.80})"
    atomic_write_text(export_dir / CARD, text)
    atomic_write_json(export_dir / PROVENANCE, prov)
    return None


def front_matter(text: str) -> dict:
    """The YAML front matter of a model card: the lines between a first line `---` and the next line that is exactly
    `---` (as the Hub reads it; a `---` inside a value is indented or quoted and ends nothing)."""
    lines = text.split("\n")
    if not lines or lines[0].rstrip("\r") != "---":
        raise ValueError("no YAML front matter")
    end = next((i for i, line in enumerate(lines[1:], 1) if line.rstrip("\r") == "---"), None)
    if end is None:
        raise ValueError("the front matter has no closing ---")
    try:
        data = yaml.safe_load("\n".join(lines[1:end]))
    except yaml.YAMLError as e:
        raise ValueError(f"the front matter is not YAML ({getattr(e, 'problem', e)})") from None
    if not isinstance(data, dict):
        raise ValueError("front matter is not a mapping")
    return data
