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
    assert any(d.startswith("prompts: 3 of the 3 eval prompts were trained on") for d in ag["differences"])
    md = (run.path / "eval" / "report.md").read_text()
    assert "## Validation, local engine, vLLM" in md and "| validation (predicted) |" in md


@pytest.mark.parametrize("broken", ["aux layer", "vocabulary"])
def test_a_broken_export_is_named_in_one_line(piped, tmp_path, broken, capsys, monkeypatch):
    """An exporter broken on purpose (what it writes is what the manifest records: eval does not refuse it as an edited
    file) writes a wrong aux layer id, or another build's draft vocabulary: eval names it in one warning line."""
    import torch

    from draftsmith import export as export_module
    from draftsmith import kinds

    run, config, *_ = piped
    bad = copy_run(run, tmp_path / "bad")
    shutil.rmtree(bad.path / "export")
    if broken == "aux layer":
        kind = kinds.get("eagle3")
        write = kind.write_config
        monkeypatch.setattr(kind, "write_config",
                            lambda *a, **k: {**write(*a, **k), "eagle_aux_hidden_state_layer_ids": [1, 4, 5]})
        expect = "aux layers: the export says [1, 4, 5], training used [2, 4, 5]"
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
