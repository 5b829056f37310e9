"""train.init_from: training starts from a released drafter (draftsmith/released.py).

A source drafter is trained here briefly on the tiny target's learnable synthetic states (test_train's helpers), its
validation tau recorded, and exported in each layout (speculators; the EAGLE-3 layout of export.format=eagle3); a
second run started from the export with init_vocab=keep builds a drafter whose weights are the source's and whose
validation pass before any step (step 0) measures the source's own tau. A random drafter with another draft
vocabulary (conftest.write_drafter_checkpoint, exported) stands for a foreign one: remapped, its shared head rows
are copied and the others are the target's. Refusals: another target's drafter (one line from the CLI, before any
stage), extract.layers or a store of other ids, a train setting that shapes the drafter.
"""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from conftest import run_cli, write_drafter_checkpoint
from draftsmith import DraftsmithError
from draftsmith.config import load_config
from draftsmith.export import run_export
from draftsmith.released import open_released, preflight
from draftsmith.rundir import RunDir
from draftsmith.target import target_info
from draftsmith.train.drafter import build_drafter, drafter_config, read_target_weights
from draftsmith.train.stage import _settings, run_train
from draftsmith.vocab import load_vocab, run_vocab
from test_train import base_sets, copy_run, cycle_samples, make_run, metrics, synthesize_states

pytestmark = pytest.mark.usefixtures("one_thread")

VAL = 8  # held-out samples: the source and the runs started from it measure the same ones


def cfg(target, *extra, **train):
    return load_config(None, [*base_sets(target, validation=VAL, validate_every=1000, **train), *extra])


@pytest.fixture(scope="module")
def base(tiny8, tmp_path_factory) -> RunDir:
    """prepare, vocab and extract (synthetic states) of the tiny target; no train (copy before use)."""
    run = make_run(tmp_path_factory.mktemp("base") / "run", tiny8, cycle_samples(target_info(str(tiny8)).vocab_size,
                                                                                   40))
    synthesize_states(run, tiny8)
    return run


@pytest.fixture(scope="module")
def source(base, tiny8, tmp_path_factory) -> dict:
    """The source drafter: trained 20 steps, its validation tau, and its export in each layout (float32, so that the
    imported weights are the trained ones bit for bit)."""
    run = copy_run(base, tmp_path_factory.mktemp("source") / "run")
    m = run_train(run, cfg(tiny8, max_steps=20))
    out = {"run": run, "tau": m["counts"]["validation"]["acceptance_length"],
           "weights": load_file(str(run.path / "train/final/model.safetensors"))}
    for fmt in ("speculators", "eagle3"):
        run_export(run, cfg(tiny8, "export.dtype=float32", f"export.format={fmt}"))
        out[fmt] = shutil.copytree(run.path / "export", run.path.parent / f"released-{fmt}")
    return out


def built(run: RunDir, c):
    """The drafter train would start from (read_inputs' released drafter, vocabulary and build), with its info."""
    info = target_info(c.target)
    rel = open_released(c, info)
    d2t, _, _ = load_vocab(run)
    dcfg = drafter_config(info, c, int(d2t.numel()), len(rel.aux_layers), rel)
    drafter, _, _ = build_drafter(dcfg, info, d2t, c.train, None, None, rel.aux_layers, lambda m: None, None, rel)
    return drafter, info, d2t


@pytest.mark.parametrize("fmt", ["speculators", "eagle3"])
def test_a_released_drafter_kept_whole_is_the_source_and_validates_at_its_tau(fmt, source, base, tiny8, tmp_path):
    run = copy_run(base, tmp_path / "run")
    c = cfg(tiny8, max_steps=1, init_from=str(source[fmt]), init_vocab="keep")
    m = run_vocab(run, c)  # the released maps written, their coverage of this run's answers reported
    vocab = json.loads((run.path / "vocab/vocab.json").read_text())
    assert vocab["init_from"]["format"] == fmt and vocab["init_from"]["vocab"] == "keep"
    assert 0 < m["counts"]["coverage"] <= 1 and vocab["draft_vocab_size"] == 64

    drafter, _, _ = built(run, c)
    got = drafter.state_dict()
    assert set(got) - {"embed_tokens.weight"} == set(source["weights"])
    for name, t in source["weights"].items():
        assert torch.equal(got[name], t), name

    run_train(run, c)
    first = next(r for r in metrics(run) if r.get("split") == "validation")
    assert first["step"] == 0 and first["acceptance_length"] == pytest.approx(source["tau"], abs=1e-9)
    meta = json.loads((run.path / "train/final/drafter.json").read_text())
    assert meta["init_from"]["source"] == f"{source[fmt].parent.name}/{source[fmt].name}"  # its last two parts
    assert meta["init_from"]["format"] == fmt and len(meta["init_from"]["sha256"]) == 64
    # the export, its provenance and card name it, with no path of this machine
    run_export(run, cfg(tiny8, max_steps=1, init_from=str(source[fmt]), init_vocab="keep"))
    ds = json.loads((run.path / "export/config.json").read_text())["draftsmith"]
    assert ds["init_from"] == meta["init_from"]
    assert json.loads((run.path / "export/provenance.json").read_text())["init_from"] == meta["init_from"]
    card = (run.path / "export/README.md").read_text()
    assert "started from (train.init_from)" in card and source[fmt].name in card
    assert str(tmp_path) not in card + json.dumps(ds)


@pytest.fixture(scope="module")
def foreign(tiny8, tmp_path_factory):
    """A released drafter of another draft vocabulary (random ids) and other aux layers, exported."""
    run = RunDir(tmp_path_factory.mktemp("foreign") / "run").ensure()
    write_drafter_checkpoint(run.path / "train/final", str(tiny8), aux_layers=[1, 3, 6], draft_vocab_size=64, seed=3)
    run_export(run, load_config(None, [f"target={tiny8}", "export.dtype=float32"]))
    return shutil.copytree(run.path / "export", run.path.parent / "foreign-drafter")


def test_remapped_vocabulary_copies_the_shared_rows_and_starts_the_others_from_the_target(foreign, base, tiny8,
                                                                                           tmp_path):
    run = copy_run(base, tmp_path / "run")
    c = cfg(tiny8, "vocab.draft_vocab_size=48", init_from=str(foreign))  # remap: the default
    run_vocab(run, c)
    assert "init_from" not in json.loads((run.path / "vocab/vocab.json").read_text())  # counted as usual
    drafter, info, d2t = built(run, c)
    src = load_file(str(foreign / "model.safetensors"))
    head = read_target_weights(info)[1].float()
    ids = d2t + torch.arange(d2t.numel())
    theirs = src["d2t"] + torch.arange(src["d2t"].numel())
    shared = torch.isin(ids, theirs)
    assert 0 < int(shared.sum()) < ids.numel()  # some rows of each kind
    got = drafter.state_dict()
    for i, t in enumerate(ids.tolist()):
        want = src["lm_head.weight"][int((theirs == t).nonzero())] if shared[i] else head[t]
        assert torch.equal(got["lm_head.weight"][i], want), (i, t)
    assert torch.equal(got["d2t"], d2t) and got["lm_head.weight"].shape[0] == 48
    for name in ("fc.weight", "norm.weight", "layers.0.self_attn.q_proj.weight", "layers.0.hidden_norm.weight"):
        assert torch.equal(got[name], src[name]), name
    # a store extracted with other ids than the drafter reads: refused naming both
    with pytest.raises(DraftsmithError, match=r"extract/meta.json: extracted with layers \[2, 4, 5\], but "
                                              r"train.init_from .* reads layers \[1, 3, 6\]"):
        run_train(run, c)


def test_the_drafter_fixes_extract_layers_kind_and_shape(foreign, tiny8):
    info = target_info(str(tiny8))
    from draftsmith.released import aux_layers
    assert aux_layers(cfg(tiny8, init_from=str(foreign)), info, open_released(cfg(tiny8, init_from=str(foreign)),
                                                                             info)) == [1, 3, 6]
    for extra, train, match in [
        (["extract.layers=[2,4,5]"], {}, r"extract.layers: \[2, 4, 5\], but train.init_from .* layers \[1, 3, 6\]"),
        ([], {"method": "peagle"}, r"train.method: peagle, but train.init_from .* is a eagle3 drafter"),
        ([], {"num_layers": 2}, r"train.num_layers: 2, but train.init_from .* has num_hidden_layers 1"),
        ([], {"norm_output": "true"}, r"train.norm_output: True, but .* has norm_output False"),
    ]:
        c = cfg(tiny8, *extra, init_from=str(foreign), **train)
        with pytest.raises(DraftsmithError, match=match):
            rel = open_released(c, info)
            aux_layers(c, info, rel)
    # a block kind: the run's block must be the drafter's (its drafts a step are written in every artifact)
    run = RunDir(foreign.parent / "dflash-run").ensure()
    write_drafter_checkpoint(run.path / "train/final", str(tiny8), draft_vocab_size=64, kind="dflash", block_size=4,
                             mask_token_id=1)
    run_export(run, load_config(None, [f"target={tiny8}", "train.method=dflash"]))
    c = cfg(tiny8, init_from=str(run.path / "export"), method="dflash", ttt_steps=5)
    with pytest.raises(DraftsmithError, match=r"train.block_size: the run drafts blocks of 6 tokens .* drafts blocks "
                                              r"of 4; set train.block_size=4"):
        open_released(c, info)
    assert open_released(cfg(tiny8, init_from=str(run.path / "export"), method="dflash"), info).config.block_size == 4
    for bad, match in [({"init_layer": 3}, "init_layer: not with init_from"),
                       ({"init_vocab": "keep"}, "init_vocab: keep keeps the vocabulary of train.init_from, which is "
                        "unset")]:
        with pytest.raises(DraftsmithError, match=match):
            cfg(tiny8, **({"init_from": str(foreign)} if "init_layer" in bad else {}), **bad)


def test_a_hub_id_resolves_from_the_cache_offline(foreign, tiny8, tmp_path, monkeypatch):
    hub = tmp_path / "hf" / "hub"
    snap = hub / "models--acme--tiny-eagle3" / "snapshots" / "0123abcd"
    shutil.copytree(foreign, snap)
    (hub / "models--acme--tiny-eagle3" / "refs").mkdir()
    (hub / "models--acme--tiny-eagle3" / "refs" / "main").write_text("0123abcd")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    rel = open_released(cfg(tiny8, init_from="acme/tiny-eagle3"), target_info(str(tiny8)))
    assert rel.folder == snap and rel.aux_layers == [1, 3, 6]
    assert rel.record(tmp_path)["source"] == "acme/tiny-eagle3"
    with pytest.raises(DraftsmithError, match=r"^train.init_from: acme/other: not in the Hugging Face cache and "
                                              r"HF_HUB_OFFLINE=1 forbids fetching it$"):
        open_released(cfg(tiny8, init_from="acme/other"), target_info(str(tiny8)))


def test_another_targets_drafter_is_refused_in_one_line_before_any_stage(foreign, base, tiny8, tmp_path):
    from transformers import AutoConfig, LlamaForCausalLM

    other = tmp_path / "wide"  # the tiny target's tokenizer, hidden size 96
    shutil.copytree(tiny8, other)
    hf = AutoConfig.from_pretrained(other)
    hf.hidden_size, hf.intermediate_size = 96, 192
    LlamaForCausalLM(hf).save_pretrained(other, safe_serialization=True)
    run = copy_run(base, tmp_path / "run")
    before = sorted(p.name for p in run.path.iterdir())
    sets = ["--set", f"target={other}", "--set", f"train.init_from={foreign}"]
    for args in (["vocab", "--run", str(run.path), *sets], ["extract", "--run", str(run.path), *sets]):
        p = run_cli(*args)
        assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
        line = p.stderr.strip()
        assert "\n" not in line and line.startswith(f"draftsmith: error: train.init_from: {foreign}/config.json: "
                                                    "hidden_size 64, but the target")
        assert "has 96" in line
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"target: {other}\ntrain:\n  init_from: {foreign}\n")
    p = run_cli("run", str(recipe), "--run", str(tmp_path / "fresh"))
    assert p.returncode == 2 and "Traceback" not in p.stderr and "hidden_size 64" in p.stderr, p.stderr
    assert not (tmp_path / "fresh" / "pipeline.json").exists()
    assert sorted(p.name for p in run.path.iterdir()) == before
    with pytest.raises(DraftsmithError, match="hidden_size 64"):
        preflight(load_config(None, [f"target={other}", f"train.init_from={foreign}"]))


def test_without_init_from_no_fingerprint_changes(tiny8):
    c = cfg(tiny8)
    plain = _settings(c, [2, 4, 5], "fp32")
    assert not {"init_from", "init_vocab"} & set(plain["train"]) and "init_from" not in plain
    # the same settings when init_vocab is written at its default, and a run from a released drafter differs
    assert _settings(cfg(tiny8, init_vocab="remap"), [2, 4, 5], "fp32") == plain


def test_an_mla_drafter_for_a_deepseek_target_starts_whole(tmp_path):
    """The MLA EAGLE-3 drafter (Eagle3DeepseekV3ForCausalLM, export's native folder for an MLA target) read back and
    built: every weight the checkpoint's."""
    from families import make_tiny
    from draftsmith.released import vocab_maps

    target = make_tiny("deepseek_v3", tmp_path / "ds")
    run = RunDir(tmp_path / "run").ensure()
    ckpt = write_drafter_checkpoint(run.path / "train/final", str(target), draft_vocab_size=64, seed=2)
    run_export(run, load_config(None, [f"target={target}", "export.dtype=float32"]))
    cj = json.loads((run.path / "export/config.json").read_text())
    assert cj["architectures"] == ["Eagle3DeepseekV3ForCausalLM"]
    c = load_config(None, [f"target={target}", f"train.init_from={run.path / 'export'}", "train.init_vocab=keep"])
    info = target_info(str(target))
    rel = open_released(c, info)
    assert rel.config.attention == "mla" and rel.aux_layers == info.default_aux_layers()
    d2t = torch.from_numpy(vocab_maps(rel, info)[0])
    dcfg = drafter_config(info, c, int(d2t.numel()), 3, rel)
    drafter, _, _ = build_drafter(dcfg, info, d2t, c.train, None, None, rel.aux_layers, lambda m: None, None, rel)
    got, want = drafter.state_dict(), load_file(str(ckpt / "model.safetensors"))
    assert set(got) - {"embed_tokens.weight"} == set(want)
    for name, t in want.items():
        assert torch.equal(got[name], t), name


def test_a_drafter_made_for_another_named_target_is_a_note(foreign, tiny8, tmp_path):
    folder = shutil.copytree(foreign, tmp_path / "named")
    cj = json.loads((folder / "config.json").read_text())
    cj["speculators_config"]["verifier"]["name_or_path"] = "meta-llama/Llama-3.1-8B-Instruct"
    (folder / "config.json").write_text(json.dumps(cj))
    said = []
    open_released(cfg(tiny8, init_from=str(folder)), target_info(str(tiny8)), said.append)
    assert len(said) == 1 and "made for meta-llama/Llama-3.1-8B-Instruct" in said[0] and "shapes fit" in said[0]
    said.clear()
    open_released(cfg(tiny8, init_from=str(foreign)), target_info(str(tiny8)), said.append)
    assert said == []  # made for this target: nothing to say


def test_estimate_sizes_the_released_drafter_not_the_train_settings(tiny8, tmp_path):
    """A released drafter of two layers with its own aux layers and vocabulary: `estimate` sizes what train will build
    from it (released.as_trained), as if those were the settings, not train.num_layers' one layer."""
    from draftsmith.estimate import estimate_config

    run = RunDir(tmp_path / "run").ensure()
    write_drafter_checkpoint(run.path / "train/final", str(tiny8), aux_layers=[1, 3, 6], draft_vocab_size=64,
                             num_layers=2)
    run_export(run, load_config(None, [f"target={tiny8}", "export.dtype=float32"]))

    def est(*sets):
        return estimate_config(load_config(None, [f"target={tiny8}", "generate.limit=1000", *sets]), "h100", 1, None,
                               100, 200)
    released = est(f"train.init_from={run.path / 'export'}", "train.init_vocab=keep")
    spelled = est("train.num_layers=2", "extract.layers=[1, 3, 6]", "vocab.draft_vocab_size=64")
    assert released == spelled
    assert released != est("extract.layers=[1, 3, 6]", "vocab.draft_vocab_size=64")  # one layer: sized smaller
