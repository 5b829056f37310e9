"""Drafter kinds: the registry and what every kind owes it (tests a new kind gets for free), and DSpark and DFlash2
end to end, each added as one package (draftsmith/kinds/dspark/, kinds/dflash2/): trained from a store, exported in
the form vLLM parses, drafted by the local engine, refused by vLLM-CPU with the line eval quotes."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open

from draftsmith import DraftsmithError, kinds
from draftsmith.config import load_config
from draftsmith.eval.local import SpecDecoder
from draftsmith.export import load_exported, run_export, speculative_config
from draftsmith.extract.stage import run_extract
from draftsmith.model.config import DrafterConfig
from draftsmith.model.eagle3 import DrafterCache
from draftsmith.rundir import RunDir
from draftsmith.target import load_target, target_info
from draftsmith.train.stage import run_train
from draftsmith.vllm_server import VLLMServer, vllm_python
from draftsmith.vocab import run_vocab
from test_train import (cfg_for, copy_run, cycle_samples, final_weights, make_run, metrics, synthesize_states,
                        write_prepare)

REPO = Path(__file__).resolve().parents[1]
AUX = [1, 2, 3]


def tiny_config(kind: str, **over) -> DrafterConfig:
    """A small drafter of `kind` with everything its kind needs set."""
    fields = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=50,
                  draft_vocab_size=40, num_hidden_layers=2, kind=kind, options=kinds.get(kind).check_options({}, ""))
    if kind != "eagle3":
        fields["mask_token_id"] = 7
    if kinds.get(kind).block:
        fields["block_size"] = 4
    if kind == "dflash2":  # the whole vocabulary (kinds/dflash2: vLLM reads its candidates as target ids)
        fields["draft_vocab_size"] = 50
        fields["options"] = {**fields["options"], "conv_group_size": 8, "selector_rank": 4}
    return DrafterConfig(**{**fields, **over})


def synth_store(path: Path, target, n: int, **sets) -> RunDir:
    """prepare (written), vocab and extract with `sets`, then test_train's learnable synthetic states."""
    run = RunDir(path)
    write_prepare(run, target, cycle_samples(target_info(str(target)).vocab_size, n))
    run_vocab(run, cfg_for(target, **sets))
    run_extract(run, cfg_for(target, **sets, **{"extract.shard_size": 16}))
    synthesize_states(run, target)
    return run


def assert_exported_as_trained(run: RunDir, drafter_class: str, aux: list[int]):
    """The export loads back as `drafter_class`, reading `aux`, with every tensor training saved -> (model, info)."""
    model, info = load_exported(run.path / "export")
    assert type(model).__name__ == drafter_class and info["aux_layers"] == aux
    got = model.state_dict()
    for name, t in final_weights(run).items():
        assert torch.equal(got[name], t), name
    return model, info


def assert_drafts_plain_greedy(run: RunDir, target_path, tokens: int = 24):
    """The local engine with the run's export decodes what plain greedy decoding does -> (target, drafter, info)."""
    target = load_target(str(target_path), dtype="float32")
    drafter, info = load_exported(run.path / "export", target_info=target.info, embed_weight=target.embed_weight(),
                                  dtype=target.dtype)
    dec = SpecDecoder(target.model, drafter, info["aux_layers"], 3, 0.0, target.eos_ids())
    ids = target.tokenizer("The cat sat on").input_ids
    spec, plain = dec.generate(ids, tokens), dec.plain_generate(ids, tokens)
    dec.close()
    assert spec.tokens == plain.tokens and spec.num_drafts > 0 and spec.num_draft_tokens == 3 * spec.num_drafts
    return target, drafter, info


# --- the registry: what every kind owes it ------------------------------------------------------------------


def test_registry_finds_each_kind_by_its_own_name_and_refuses_an_unknown_one_in_a_line():
    assert kinds.names() == ("eagle3", "peagle", "dflash", "dspark", "dflash2")
    for name in kinds.names():
        kind = kinds.get(name)
        assert kind.name == name and kind.label and kind.speculators_type
    assert len({k.speculators_type for k in kinds.all_kinds()}) == len(kinds.names())
    with pytest.raises(DraftsmithError, match=r"^unknown drafter kind 'medusa'; the kinds are eagle3, peagle, dflash, "
                                              r"dspark, dflash2$"):
        kinds.get("medusa")
    with pytest.raises(DraftsmithError, match=r"^--set: train.method: one of eagle3, peagle, dflash, dspark, dflash2 "
                                              r"\(got .medusa.\)$"):
        load_config(None, ["target=smollm2-135m", "train.method=medusa"])


@pytest.mark.parametrize("name", kinds.names())
def test_every_kind_exports_exactly_its_drafters_weights_and_reads_its_own_config_back(name):
    """A kind's export names every tensor its drafter has (bar the target's embed_tokens) and nothing else, and
    its config.json reads back to the drafter config it was written from, kind and options included."""
    kind = kinds.get(name)
    config = tiny_config(name)
    drafter = kinds.drafter_class(config)(config)
    trained = set(drafter.state_dict()) - {"embed_tokens.weight"}
    assert set(kind.export_keys(config)) == trained
    cj = kind.write_config(config, AUX, target_name="t", target_arch="LlamaForCausalLM", num_speculative_tokens=3,
                           dtype="bfloat16", draftsmith={"kind": name})
    cj = json.loads(json.dumps(cj))
    assert kinds.of_export(cj, "config.json") is kind and kinds.export_aux(cj) == AUX
    back, aux, k, verifier = kind.read_config(cj, "config.json")
    assert aux == AUX and verifier == "t" and k == (3 if not kind.block else config.block_size - 1)
    for field in ("kind", "options", "hidden_size", "num_hidden_layers", "draft_vocab_size", "vocab_size",
                  "mask_token_id", "block_size", "intermediate_size", "num_key_value_heads"):
        assert getattr(back, field) == getattr(config, field), field
    # the kind draftsmith wrote must be the file's format
    other = next(n for n in kinds.names() if n != name)
    with pytest.raises(DraftsmithError, match=f"draftsmith.kind says '{other}' but the file is a {name} export"):
        kinds.of_export({**cj, "draftsmith": {"kind": other}}, "config.json")


@pytest.mark.parametrize("name", kinds.names())
def test_every_kind_refuses_an_option_it_does_not_have_naming_the_field(name):
    kind = kinds.get(name)
    with pytest.raises(DraftsmithError, match=rf"^--set: train.drafter_options.nope: not an option of train.method={name}"):
        load_config(None, ["target=smollm2-135m", f"train.method={name}", "train.drafter_options.nope=1"])
    for option, (default, doc) in kind.options.items():
        assert doc and kind.check_options({}, "")[option] == default
        with pytest.raises(DraftsmithError, match=rf"^--set: train.drafter_options.{option}: must be above 0"):
            load_config(None, ["target=smollm2-135m", f"train.method={name}", f"train.drafter_options.{option}=0"])


@pytest.mark.parametrize("name", ["dspark", "dflash2"])
def test_only_the_kinds_package_and_its_registry_line_name_it(name):
    """The test of the design (a kind is one package): besides the registry, only the kind's own files name it."""
    named = sorted(str(p.relative_to(REPO)) for p in (REPO / "draftsmith").rglob("*.py")
                   if name in p.read_text().lower())
    assert named == ["draftsmith/kinds/__init__.py", f"draftsmith/kinds/{name}/__init__.py",
                     f"draftsmith/kinds/{name}/model.py"], named
    registry = (REPO / "draftsmith/kinds/__init__.py").read_text().lower()
    assert registry.count(name) == 2  # its line: "<name>": "draftsmith.kinds.<name>"


def test_a_checkpoint_from_before_kinds_is_read_once_by_the_fields_its_kind_set():
    """drafter.json of the releases before kinds had names (no config.kind, no method)."""
    assert kinds.of_meta({"config": {"block_size": 4, "mask_token_id": 3}}) == "dflash"
    assert kinds.of_meta({"config": {"mask_token_id": 3}}) == "peagle"
    assert kinds.of_meta({"config": {"hidden_size": 8}}) == "eagle3"
    assert kinds.of_meta({"method": "peagle", "config": {}}) == "peagle"
    # written since: the kind itself, whatever fields are set (a DSpark with a block is no DFlash)
    assert kinds.of_meta({"method": "dspark", "config": {"kind": "dspark", "block_size": 4}}) == "dspark"
    assert kinds.served_tokens({"ttt_steps": 5}) == 5 and kinds.served_tokens({"drafts": 3, "ttt_steps": 7}) == 3


# --- DSpark ---------------------------------------------------------------------------------------------------


def test_dspark_training_slots_equal_drafting_as_served():
    """The objective's slot logits (DFlash's block forward + the Markov bias of the true token before each slot)
    equal what serving computes along an accepted run: one block after the context, each slot biased by the token
    before it (the bonus token for the first)."""
    from draftsmith.kinds.dspark.model import Objective

    torch.manual_seed(0)
    config = tiny_config("dspark", draft_vocab_size=50)
    d = kinds.drafter_class(config)(config).eval()
    torch.nn.init.normal_(d.markov_head.markov_w2.weight)  # a bias that moves the logits (it starts at zero)
    L = 12
    ids, aux = torch.randint(0, 50, (1, L)), torch.randn(1, L, 96)
    pos, doc = torch.arange(L)[None], torch.zeros(1, L, dtype=torch.long)
    anchors = torch.tensor([[3, 7]])
    obj = Objective(d, torch.randn(50, 32), gamma=0.8, max_anchors=2)  # target_head: the teacher's rows [Dv, H]
    with torch.no_grad():
        states = d.norm(d.block_forward(ids, aux, anchors, pos, doc))  # [1, M, S, H]
        for m, a in enumerate(anchors[0].tolist()):
            prev = ids[0, a:a + 3]  # the true token before slots 1..3: the anchor, then the block's own
            trained = obj.slot_logits(states[0, m, 1:], prev)
            cache = DrafterCache()
            d.add_context(aux[:, :a], pos[:, :a], cache)
            base = d.draft(ids[:, a:a + 1], a, cache)[0]  # [K, Dv]: what block_logits hands propose
            served = torch.stack([base[j] + d.markov_head(prev[j:j + 1])[0] for j in range(3)])
            torch.testing.assert_close(trained, served, atol=1e-5, rtol=1e-5)
            assert not torch.allclose(trained, base, atol=1e-3)  # the bias is there


@pytest.fixture(scope="module")
def dspark_run(tiny8, tmp_path_factory) -> RunDir:
    """A DSpark run trained on the learnable synthetic store (test_train's), then exported."""
    src = make_run(tmp_path_factory.mktemp("synth") / "run", tiny8, cycle_samples(target_info(str(tiny8)).vocab_size, 48))
    synthesize_states(src, tiny8)
    run = copy_run(src, tmp_path_factory.mktemp("dspark") / "run")
    run_train(run, cfg_for(tiny8, max_steps=80, method="dspark", block_size=4, **{"train.drafter_options.markov_rank": 8}))
    run_export(run, load_config(None, [f"target={tiny8}", "export.dtype=float32"]))
    return run


def test_dspark_learns_from_the_store_and_exports_what_it_trained(dspark_run):
    first, last = metrics(dspark_run)[0], metrics(dspark_run)[-1]
    assert last["loss"][0] < 0.5 * first["loss"][0] and last["acc"][0] > 0.2, (first, last)
    meta = json.loads((dspark_run.path / "train/final/drafter.json").read_text())
    assert meta["method"] == meta["config"]["kind"] == "dspark" and meta["drafts"] == 3
    assert meta["config"]["options"] == {"markov_rank": 8} and meta["config"]["block_size"] == 4
    sd = final_weights(dspark_run)
    assert sd["markov_head.markov_w1.weight"].shape == (meta["config"]["vocab_size"], 8)
    assert sd["markov_head.markov_w2.weight"].shape == (meta["draft_vocab_size"], 8)
    assert sd["markov_head.markov_w2.weight"].abs().max() > 0  # it learned a bias (it starts at zero)
    cj = json.loads((dspark_run.path / "export/config.json").read_text())
    assert cj["speculators_model_type"] == "dspark" and cj["draftsmith"]["kind"] == "dspark"
    assert cj["architectures"] == ["Qwen3DSparkModel"] and cj["markov_rank"] == 8 and cj["block_size"] == 4
    assert cj["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert_exported_as_trained(dspark_run, "DSparkDrafter", [2, 4, 5])
    with pytest.raises(DraftsmithError, match="block_size - 1 = 3"):
        speculative_config(dspark_run.path / "export", 5)


def test_dspark_in_the_local_engine_equals_plain_greedy_decoding(dspark_run, tiny8, one_thread):
    target, drafter, info = assert_drafts_plain_greedy(dspark_run, tiny8)
    with pytest.raises(DraftsmithError, match="block_size - 1 = 3"):
        SpecDecoder(target.model, drafter, info["aux_layers"], 2, 0.0, target.eos_ids())


@pytest.mark.vllm
def test_vllm_parses_the_dspark_export_and_vllm_cpu_refuses_to_serve_it_with_the_line_eval_quotes(
        dspark_run, tiny8, tmp_path, cli):
    """vLLM 0.32's own SpeculatorsConfig reads the export as DSpark with the block, mask token, Markov rank and
    target layers it was trained with; a real vLLM-CPU server started with it stops at start-up with CPU_REFUSAL
    (its V1 runner has no DSpark), and eval says so in one line without starting one."""
    out = dspark_run.path / "export"
    code = ("import json, sys\n"
            "from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig\n"
            "c = SpeculatorsConfig.from_pretrained(sys.argv[1])\n"
            "d = json.load(open(sys.argv[1] + '/config.json'))\n"
            "keys = ['architectures', 'markov_rank', 'block_size', 'mask_token_id', 'target_layer_ids',\n"
            "        'eagle_aux_hidden_state_layer_ids', 'dspark_bonus_anchor', 'draft_vocab_size']\n"
            "out = {k: getattr(c, k, None) for k in keys}\n"
            "out['spec'] = SpeculatorsConfig.extract_vllm_speculative_config(d)\n"
            "print(json.dumps(out))\n")
    p = subprocess.run([str(vllm_python()), "-c", code, str(out)], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"})
    assert p.returncode == 0, p.stderr[-2000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    cj = json.loads((out / "config.json").read_text())
    assert got["spec"] == {"method": "dspark", "num_speculative_tokens": 3}
    assert got["architectures"] == ["Qwen3DSparkModel"] and got["markov_rank"] == 8 and got["block_size"] == 4
    assert got["mask_token_id"] == cj["mask_token_id"] and got["draft_vocab_size"] == cj["draft_vocab_size"]
    assert got["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5] and got["target_layer_ids"] == [1, 3, 4]
    assert got["dspark_bonus_anchor"] is True
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "d2t"} <= set(f.keys())

    assert_vllm_cpu_refuses(dspark_run, "dspark", tiny8, tmp_path, cli)


def assert_vllm_cpu_refuses(run: RunDir, name: str, tiny8, tmp_path, cli) -> None:
    """A real vLLM-CPU server started with the run's export stops at start-up with the kind's serves_on_cpu line,
    and eval says so in one line without starting one."""
    kind, out = kinds.get(name), run.path / "export"
    spec = speculative_config(out, 3)
    assert spec == {"model": str(out), "method": kind.vllm_method, "num_speculative_tokens": 3}
    log = tmp_path / "vllm.log"
    with pytest.raises(DraftsmithError, match="during start-up"):
        with VLLMServer(target_info(str(tiny8)).path, log_path=log, dtype="float32", max_model_len=256,
                        extra_args=["--enforce-eager", "--speculative-config", json.dumps(spec)], say=lambda s: None):
            pass
    refusal = kind.serves_on_cpu()
    assert refusal and refusal in log.read_text(), log.read_text()[-3000:]
    p = cli("eval", "--run", str(run.path), "--set", f"target={tiny8}", "--set", "eval.engine=vllm")
    assert p.returncode != 0 and "Traceback" not in p.stderr
    assert f"vLLM-CPU does not serve {kind.label} drafters" in p.stderr and refusal in p.stderr, p.stderr[-2000:]


# --- DFlash2 --------------------------------------------------------------------------------------------------


def randomize(module: torch.nn.Module, names: tuple[str, ...], seed: int = 1) -> None:
    """Non-trivial values in the parameters whose names contain one of `names` (they start as an identity or zero)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in module.named_parameters():
            if any(x in n for x in names):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)


def test_dflash2_training_slots_equal_drafting_as_served():
    """The block forward of training (many anchors at once, the convolution running along each block's slots) gives
    the states serving computes for one block after the context, and the selector scores a slot's candidates the same
    from both, given the true token before it; the draft training counts is the walk's pick."""
    from draftsmith.kinds.dflash2.model import Objective

    torch.manual_seed(0)
    config = tiny_config("dflash2")
    d = kinds.drafter_class(config)(config).eval()
    randomize(d, ("_conv.", "candidate_selector."))
    L = 12
    ids, aux = torch.randint(0, 50, (1, L)), torch.randn(1, L, 96)
    pos, doc = torch.arange(L)[None], torch.zeros(1, L, dtype=torch.long)
    anchors = torch.tensor([[3, 7]])
    obj = Objective(d, torch.randn(50, 32), gamma=0.8, max_anchors=2)
    with torch.no_grad():
        states = d.norm(d.block_forward(ids, aux, anchors, pos, doc))  # [1, M, S, H]
        plain_cfg = tiny_config("dflash", draft_vocab_size=50)
        plain = kinds.drafter_class(plain_cfg)(plain_cfg).eval()
        plain.load_state_dict({k: v for k, v in d.state_dict().items() if k in plain.state_dict()})
        assert not torch.allclose(states, plain.norm(plain.block_forward(ids, aux, anchors, pos, doc)), atol=1e-3)
        for m, a in enumerate(anchors[0].tolist()):
            cache = DrafterCache()
            d.add_context(aux[:, :a], pos[:, :a], cache)
            served = d.draft_states(ids[:, a:a + 1], a, cache)[0]  # [K, H]
            torch.testing.assert_close(states[0, m, 1:], served, atol=1e-5, rtol=1e-5)
            prev, targets = ids[0, a:a + 3], ids[0, a + 1:a + 4]
            logits = d.lm_head(served)
            _, drafted = obj.slot_extra(served, logits, prev, targets)
            cand, unary = d.candidates(served)
            for j in range(3):
                s = d.candidate_selector.scores(served[j:j + 1], cand[j:j + 1], unary[j:j + 1], prev[j:j + 1, None])
                assert int(drafted[j]) == int(cand[j, s[0, 0].argmax()])


def test_dflash2_refuses_a_draft_vocabulary_smaller_than_the_target_s_and_a_group_that_does_not_divide():
    with pytest.raises(ValueError, match=r"whole vocabulary .* set vocab.draft_vocab_size=50 \(it is 40\)"):
        tiny_config("dflash2", draft_vocab_size=40)
    with pytest.raises(ValueError, match="conv_group_size 5 must divide hidden_size 32"):
        tiny_config("dflash2", options={"conv_group_size": 5, "selector_rank": 4})
    # at config time, against the target, naming the train field
    cfg = load_config(None, ["target=smollm2-135m", "train.method=dflash2", "train.block_size=4",
                             "train.drafter_options.conv_group_size=100"])
    hf = SimpleNamespace(hidden_size=576, pad_token_id=2, eos_token_id=2, vocab_size=49152)  # SmolLM2's
    with pytest.raises(DraftsmithError, match=r"^train.drafter_options.conv_group_size: 100 must divide the target's "
                                              r"hidden_size 576$"):
        kinds.get("dflash2").config_options(cfg.train, hf, "gqa")
    cfg = load_config(None, ["target=smollm2-135m", "train.method=dflash2", "train.block_size=4",
                             "train.drafter_options.conv_kernel_size=5"])
    with pytest.raises(DraftsmithError, match=r"^train.drafter_options.conv_kernel_size: 5 taps reach past a block "
                                              r"of 4; at most block_size$"):
        kinds.get("dflash2").config_options(cfg.train, hf, "gqa")


@pytest.fixture(scope="module")
def dflash2_run(tiny8, tmp_path_factory) -> RunDir:
    """A DFlash2 run on the learnable synthetic store over the tiny target's whole vocabulary, then exported."""
    V = target_info(str(tiny8)).vocab_size
    full = {"vocab.draft_vocab_size": V}
    run = synth_store(tmp_path_factory.mktemp("dflash2") / "run", tiny8, 48, **full)
    run_train(run, cfg_for(tiny8, max_steps=80, method="dflash2", block_size=4, **full,
                           **{"train.drafter_options.selector_rank": 8, "train.drafter_options.conv_group_size": 16}))
    run_export(run, load_config(None, [f"target={tiny8}", f"vocab.draft_vocab_size={V}", "export.dtype=float32"]))
    return run


def test_dflash2_learns_from_the_store_and_exports_what_it_trained(dflash2_run):
    first, last = metrics(dflash2_run)[0], metrics(dflash2_run)[-1]
    assert last["loss"][0] < 0.5 * first["loss"][0] and last["acc"][0] > 0.2, (first, last)
    meta = json.loads((dflash2_run.path / "train/final/drafter.json").read_text())
    assert meta["method"] == meta["config"]["kind"] == "dflash2" and meta["drafts"] == 3
    assert meta["config"]["options"] == {"conv_kernel_size": 3, "conv_group_size": 16, "selector_rank": 8,
                                         "selector_top_k": 8}
    sd = final_weights(dflash2_run)
    V, H = meta["config"]["vocab_size"], meta["config"]["hidden_size"]
    assert sd["candidate_selector.successor_codebook"].shape == (V, 8)
    assert sd["candidate_selector.successor_codebook"].abs().max() > 0  # the selector learned (it starts at zero)
    assert sd["layers.0.attention_conv.base_kernel"].shape == (2, 3, H)
    assert sd["layers.0.mlp_conv.kernel_projection.weight"].shape == (2 * 3 * H // 16, H)
    assert sd["layers.0.mlp_conv.kernel_projection.weight"].abs().max() > 0  # so did the convolution
    cj = json.loads((dflash2_run.path / "export/config.json").read_text())
    assert cj["speculators_model_type"] == "dflash2" and cj["draftsmith"]["kind"] == "dflash2"
    assert cj["architectures"] == ["DFlash2DraftModel"] and cj["draft_vocab_size"] == V
    assert (cj["conv_kernel_size"], cj["conv_group_size"], cj["selector_rank"], cj["selector_top_k"]) == (3, 16, 8, 8)
    assert_exported_as_trained(dflash2_run, "DFlash2Drafter", [2, 4, 5])


def test_dflash2_in_the_local_engine_equals_plain_greedy_decoding(dflash2_run, tiny8, one_thread):
    assert_drafts_plain_greedy(dflash2_run, tiny8)


@pytest.mark.vllm
def test_vllm_parses_the_dflash2_export_computes_its_parts_as_draftsmith_and_vllm_cpu_refuses_it(
        dflash2_run, tiny8, tmp_path, cli):
    """vLLM 0.32's SpeculatorsConfig reads the export as DFlash2 (method dflash, its four keys); vLLM's own grouped
    convolution (its CPU path) and edge scores, fed the export's tensors, equal draftsmith's; a real vLLM-CPU server
    stops at start-up with CPU_REFUSAL, and eval says so in one line without starting one."""
    out = dflash2_run.path / "export"
    model, _ = load_exported(out)
    g = torch.Generator().manual_seed(0)
    conv, sel = model.layers[0].attention_conv, model.candidate_selector
    x, h = torch.randn(2 * 4, model.config.hidden_size, generator=g), torch.randn(3, model.config.hidden_size, generator=g)
    cand, prev = torch.randint(0, model.config.vocab_size, (3, 8), generator=g), torch.tensor([5, 6, 7])
    unary = torch.randn(3, 8, generator=g)
    with torch.no_grad():
        ours_conv = conv.prepare(x[None])[0][0]
        # vLLM's predecessors: the anchor for slot 0, then each slot's candidates; here every slot's is given
        ours_scores = sel.scores(h, cand, unary, prev[:, None])[:, 0]
    torch.save({"x": x, "h": h, "cand": cand, "prev": prev, "unary": unary}, tmp_path / "in.pt")
    code = ("import json, sys, torch\n"
            "from safetensors.torch import load_file\n"
            "from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig\n"
            "from vllm.model_executor.models.qwen3_dflash2 import _grouped_conv\n"
            "c = SpeculatorsConfig.from_pretrained(sys.argv[1])\n"
            "d = json.load(open(sys.argv[1] + '/config.json'))\n"
            "w = load_file(sys.argv[1] + '/model.safetensors')\n"
            "t = torch.load(sys.argv[2], weights_only=True)\n"
            "cfg = c.dflash_config\n"
            "taps, gs = cfg['conv_kernel_size'], cfg['conv_group_size']\n"
            "H = t['x'].shape[1]\n"
            "coef = t['x'] @ w['layers.0.attention_conv.kernel_projection.weight'].t()\n"
            "coef = coef.reshape(t['x'].shape[0], 2, taps, H // gs)\n"
            "conv = _grouped_conv(t['x'], coef[:, 0], w['layers.0.attention_conv.base_kernel'][0], 4, H // gs, gs, taps)\n"
            "hid = t['h'] @ w['candidate_selector.hidden_projection.weight'].t()\n"
            "pred = w['candidate_selector.predecessor_codebook'][t['prev']] * hid\n"
            "succ = w['candidate_selector.successor_codebook'][t['cand']]\n"
            "scores = t['unary'] + torch.einsum('nr,nkr->nk', pred, succ)\n"
            "torch.save({'conv': conv, 'scores': scores}, sys.argv[3])\n"
            "keys = ['architectures', 'draft_vocab_size', 'eagle_aux_hidden_state_layer_ids']\n"
            "out = {k: getattr(c, k, None) for k in keys}\n"
            "out['dflash_config'] = cfg\n"
            "out['spec'] = SpeculatorsConfig.extract_vllm_speculative_config(d)\n"
            "print(json.dumps(out))\n")
    p = subprocess.run([str(vllm_python()), "-c", code, str(out), str(tmp_path / "in.pt"), str(tmp_path / "out.pt")],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"})
    assert p.returncode == 0, p.stderr[-2000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["spec"] == {"method": "dflash", "num_speculative_tokens": 3}
    assert got["architectures"] == ["DFlash2DraftModel"] and got["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    cfg = got["dflash_config"]
    assert (cfg["conv_kernel_size"], cfg["conv_group_size"], cfg["selector_rank"], cfg["selector_top_k"]) == (3, 16, 8, 8)
    assert cfg["target_layer_ids"] == [1, 3, 4] and cfg["mask_token_id"] == model.config.mask_token_id
    theirs = torch.load(tmp_path / "out.pt", weights_only=True)
    torch.testing.assert_close(ours_conv, theirs["conv"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours_scores, theirs["scores"], atol=1e-5, rtol=1e-5)

    assert_vllm_cpu_refuses(dflash2_run, "dflash2", tiny8, tmp_path, cli)


# --- the number of target layers a drafter reads -------------------------------------------------------------


@pytest.mark.parametrize("name", ["eagle3", "dflash"])
def test_a_drafter_reads_as_many_target_layers_as_extract_layers_names(name, tiny8, tmp_path, one_thread):
    """Four aux layers (DFlash's published drafters read five): the store keeps four, fc fuses four, the export says
    four and loads back, and the local engine drafts with it; one id is refused in a line naming the field."""
    layers = {"extract.layers": "[1,2,4,5]"}
    run = synth_store(tmp_path / "run", tiny8, 16, **layers)
    block = {"block_size": 4} if name == "dflash" else {}
    run_train(run, cfg_for(tiny8, max_steps=6, method=name, **block, **layers))
    H = json.loads((run.path / "train/final/drafter.json").read_text())["config"]["hidden_size"]
    assert final_weights(run)["fc.weight"].shape == (H, 4 * H)
    run_export(run, load_config(None, [f"target={tiny8}", "extract.layers=[1,2,4,5]", "export.dtype=float32"]))
    assert kinds.export_aux(json.loads((run.path / "export/config.json").read_text())) == [1, 2, 4, 5]
    target, drafter, info = assert_drafts_plain_greedy(run, tiny8, tokens=12)
    assert info["aux_layers"] == [1, 2, 4, 5] and drafter.config.num_aux_layers == 4
    with pytest.raises(DraftsmithError, match=r"^extract.layers: expected at least 2 auxiliary layer ids, got \[3\]$"):
        target.info.check_layers([3])


def test_the_lists_of_kinds_a_user_reads_name_every_kind_of_the_registry():
    """The CLI's help is built from the registry; the README's first line is checked against it (a kind's name may
    appear only in its package, so no hand-written list in the package could be right)."""
    from typer.testing import CliRunner

    from draftsmith.cli import app

    labels = [kinds.get(n).label for n in kinds.names()]
    help_text = " ".join(CliRunner().invoke(app, ["--help"]).output.split())
    readme = (REPO / "README.md").read_text().splitlines()[2]
    for label in labels:
        assert label in help_text and label in readme, label
