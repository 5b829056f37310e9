"""export: the speculators folder vLLM loads, picked checkpoints, atomic replacement, and
load_exported's checks."""

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from conftest import write_drafter_checkpoint
from draftsmith import DraftsmithError
from draftsmith.config import load_config
from draftsmith.export import export_keys, find_checkpoint, load_exported, run_export, speculative_config
from draftsmith.model.config import DrafterConfig
from draftsmith.rundir import RunDir
from draftsmith.target import target_info
from draftsmith.vllm_server import vllm_python

AUX = [1, 3, 4]  # not the default ids, so that the test sees them travel
DV = 64

# What vLLM 0.32's eagle3 loader reads (llama_eagle3.Eagle3LlamaForCausalLM.load_weights maps
# these names onto its modules; t2d is skipped, d2t becomes draft_id_to_target_id).
VLLM_KEYS = {
    "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
    "layers.0.self_attn.q_proj.weight", "layers.0.self_attn.k_proj.weight",
    "layers.0.self_attn.v_proj.weight", "layers.0.self_attn.o_proj.weight",
    "layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight", "layers.0.mlp.down_proj.weight",
    "layers.0.input_layernorm.weight", "layers.0.hidden_norm.weight",
    "layers.0.post_attention_layernorm.weight",
}

def cfg_for(target, *sets):
    return load_config(None, [f"target={target}", *sets])

@pytest.fixture
def trained_run(tmp_path, tiny_target):
    run = RunDir(tmp_path / "run").ensure()
    write_drafter_checkpoint(run.path / "train" / "final", str(tiny_target), aux_layers=AUX, draft_vocab_size=DV)
    return run

def test_export_writes_speculators_format(trained_run, tiny_target):
    run = trained_run
    m = run_export(run, cfg_for(tiny_target))
    info = target_info(str(tiny_target))
    out = run.path / "export"
    cj = json.loads((out / "config.json").read_text())

    assert cj["speculators_model_type"] == "eagle3"
    assert cj["draft_vocab_size"] == DV
    assert cj["eagle_aux_hidden_state_layer_ids"] == AUX
    assert cj["norm_before_residual"] is False  # vLLM's speculators default is True
    assert cj["target_hidden_size"] == info.hidden_size
    layer = cj["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["num_hidden_layers"] == 1
    assert layer["hidden_size"] == 64 and layer["num_attention_heads"] == 4 and layer["num_key_value_heads"] == 2
    assert layer["head_dim"] == 16 and layer["intermediate_size"] == 128
    assert layer["vocab_size"] == info.vocab_size
    assert layer["hidden_act"] == "silu"
    # plain RoPE with the target's theta (the tiny Llama's default 10000)
    assert layer["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}
    sc = cj["speculators_config"]
    assert sc["algorithm"] == "eagle3"
    assert sc["proposal_methods"][0]["speculative_tokens"] == 3  # the checkpoint's ttt_steps
    # the verifier by a name that holds elsewhere (the folder's, with no target_id; never a path of this machine),
    # plus what identifies it
    assert sc["verifier"]["name_or_path"] == tiny_target.name
    assert sc["verifier"]["architectures"] == ["LlamaForCausalLM"]
    assert cj["draftsmith"]["target_id"] == tiny_target.name and "target_spec" not in cj["draftsmith"]
    assert cj["draftsmith"]["checkpoint"] == "train/final" and cj["draftsmith"]["kind"] == "eagle3"
    assert str(tiny_target.parent) not in (out / "config.json").read_text()
    assert cj["draftsmith"]["target_architecture"] == "LlamaForCausalLM"
    assert len(cj["draftsmith"]["target_config_sha256"]) == 64
    assert cj["draftsmith"]["target"] == info.name and cj["draftsmith"]["target_fingerprint"] == info.fingerprint
    assert cj["draftsmith"]["step"] == 10

    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in keys}
        dtypes = {k: f.get_slice(k).get_dtype() for k in keys}
    config = DrafterConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
    assert keys == VLLM_KEYS == set(export_keys(config).values())  # no embed_tokens: vLLM shares the target's
    assert shapes["fc.weight"] == (64, 3 * 64)
    assert shapes["layers.0.self_attn.q_proj.weight"] == (64, 128)
    assert shapes["layers.0.self_attn.k_proj.weight"] == (32, 128)
    assert shapes["lm_head.weight"] == (DV, 64)
    assert shapes["d2t"] == (DV,) and shapes["t2d"] == (info.vocab_size,)
    assert dtypes["d2t"] == "I64" and dtypes["t2d"] == "BOOL"
    assert {dtypes[k] for k in keys - {"d2t", "t2d"}} == {"BF16"}

    assert m["counts"]["done"] == 1 and sorted(m["outputs"]) == ["README.md", "config.json", "model.safetensors",
                                                                 "provenance.json"]
    # unchanged checkpoint, target and settings: up to date, nothing rewritten (what `run` relies on)
    mtime = (out / "model.safetensors").stat().st_mtime_ns
    assert run_export(run, cfg_for(tiny_target)) == m
    assert (out / "model.safetensors").stat().st_mtime_ns == mtime
    assert (out / "manifest.json").is_file() and (out / "config.yaml").is_file()
    assert not [p for p in run.path.iterdir() if p.name.startswith(".export")], "temporary folder left behind"

def test_round_trip_equals_checkpoint(trained_run, tiny_target):
    run = trained_run
    run_export(run, cfg_for(tiny_target, "export.dtype=float32"))
    ckpt = load_file(str(run.path / "train" / "final" / "model.safetensors"))
    embed = torch.randn(target_info(str(tiny_target)).vocab_size, 64)
    model, info = load_exported(run.path / "export", target_info=target_info(str(tiny_target)), embed_weight=embed)
    sd = model.state_dict()
    for name, t in ckpt.items():
        assert torch.equal(sd[name], t), name
    assert torch.equal(sd["embed_tokens.weight"], embed)
    assert info["aux_layers"] == AUX and info["has_embed_tokens"] is False and info["dtype"] == "float32"
    assert info["config"].draft_vocab_size == DV

    # the default bf16 export equals the checkpoint rounded to bf16
    run_export(run, cfg_for(tiny_target))
    model, info = load_exported(run.path / "export")
    assert info["dtype"] == "bfloat16"
    for name, t in ckpt.items():
        want = t if name in ("d2t", "t2d") else t.to(torch.bfloat16).float()
        assert torch.equal(model.state_dict()[name], want), name

def test_two_layer_drafter_exports_and_reads_back(tmp_path, tiny_target):
    run = RunDir(tmp_path / "run").ensure()
    write_drafter_checkpoint(run.path / "train" / "final", str(tiny_target), aux_layers=AUX, draft_vocab_size=DV,
                             num_layers=2)
    run_export(run, cfg_for(tiny_target, "export.dtype=float32"))
    cj = json.loads((run.path / "export" / "config.json").read_text())
    assert cj["transformer_layer_config"]["num_hidden_layers"] == 2
    with safe_open(str(run.path / "export" / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        q1 = tuple(f.get_slice("layers.1.self_attn.q_proj.weight").get_shape())
    # layer 1 as vLLM's llama_eagle3 builds it: q/k/v over H, no hidden_norm (it stays at ones there)
    assert keys == VLLM_KEYS | {k.replace("layers.0.", "layers.1.") for k in VLLM_KEYS
                                if k.startswith("layers.0.") and "hidden_norm" not in k}
    assert q1 == (64, 64)
    ckpt = load_file(str(run.path / "train" / "final" / "model.safetensors"))
    model, info = load_exported(run.path / "export")
    assert info["config"].num_hidden_layers == 2 and len(model.layers) == 2
    for name, t in ckpt.items():
        assert torch.equal(model.state_dict()[name], t), name

def test_checkpoint_choice(tmp_path, tiny_target):
    run = RunDir(tmp_path / "run").ensure()
    with pytest.raises(DraftsmithError, match="no complete checkpoint"):
        find_checkpoint(run)
    ck = run.path / "train" / "checkpoints"
    write_drafter_checkpoint(ck / "step_5", str(tiny_target), aux_layers=AUX, draft_vocab_size=DV, step=5)
    write_drafter_checkpoint(ck / "step_40", str(tiny_target), aux_layers=AUX, draft_vocab_size=DV, step=40)
    write_drafter_checkpoint(ck / "step_90", str(tiny_target), aux_layers=AUX, draft_vocab_size=DV, step=90)
    (ck / "step_90" / "state.json").unlink()  # still being written
    assert find_checkpoint(run) == (ck / "step_40").resolve()  # numeric order, complete only
    with pytest.raises(DraftsmithError, match="incomplete checkpoint"):
        find_checkpoint(run, str(ck / "step_90"))
    assert find_checkpoint(run, "train/checkpoints/step_5") == (ck / "step_5").resolve()
    with pytest.raises(DraftsmithError, match="no such checkpoint"):
        find_checkpoint(run, str(tmp_path / "nowhere"))

    m = run_export(run, cfg_for(tiny_target))
    assert m["checkpoint"] == "train/checkpoints/step_40"  # relative to the run: a moved run names itself
    write_drafter_checkpoint(run.path / "train" / "final", str(tiny_target), aux_layers=AUX, draft_vocab_size=DV, step=100)
    assert find_checkpoint(run) == (run.path / "train" / "final").resolve()
    assert find_checkpoint(run, "final") == (run.path / "train" / "final").resolve()
    with pytest.raises(DraftsmithError, match=r"^export.checkpoint=best: .*train/best: no complete checkpoint"):
        find_checkpoint(run, "best")
    write_drafter_checkpoint(run.path / "train" / "best", str(tiny_target), aux_layers=AUX, draft_vocab_size=DV, step=60)
    assert find_checkpoint(run, "best") == (run.path / "train" / "best").resolve()
    assert find_checkpoint(run) == (run.path / "train" / "final").resolve()  # final stays the default

def test_reexport_replaces_folder_and_keeps_bookkeeping(trained_run, tiny_target):
    run = trained_run
    run_export(run, cfg_for(tiny_target))
    out = run.path / "export"
    first = (out / "model.safetensors").read_bytes()
    (out / "stray.bin").write_bytes(b"x")  # not an export file: must not survive the swap
    write_drafter_checkpoint(run.path / "train" / "final", str(tiny_target), aux_layers=AUX, draft_vocab_size=DV, seed=1, step=20)
    m2 = run_export(run, cfg_for(tiny_target))
    assert (out / "model.safetensors").read_bytes() != first
    assert json.loads((out / "config.json").read_text())["draftsmith"]["step"] == 20
    assert not (out / "stray.bin").exists()
    for name in ("config.yaml", "stage.log", "progress.jsonl", "progress.prev.jsonl", "manifest.json"):
        assert (out / name).is_file(), name
    assert json.loads((out / "manifest.json").read_text())["fingerprint"] == m2["fingerprint"]
    assert not [p for p in run.path.iterdir() if p.name.startswith(".export")]

def test_failed_export_leaves_previous_export(trained_run, tiny_target):
    run = trained_run
    run_export(run, cfg_for(tiny_target))
    before = (run.path / "export" / "model.safetensors").read_bytes()
    ckpt = run.path / "train" / "final" / "model.safetensors"
    sd = load_file(str(ckpt))
    del sd["fc.weight"]
    save_file(sd, str(ckpt))
    with pytest.raises(DraftsmithError, match=r"model\.safetensors: missing tensor 'fc\.weight'"):
        run_export(run, cfg_for(tiny_target))
    assert (run.path / "export" / "model.safetensors").read_bytes() == before
    assert not [p for p in run.path.iterdir() if p.name.startswith(".export")]

def test_export_refuses_other_target_and_bad_aux(tmp_path, tiny_target):
    from conftest import build_tiny_target

    other = build_tiny_target(tmp_path / "other", num_layers=5)
    run = RunDir(tmp_path / "run").ensure()
    write_drafter_checkpoint(run.path / "train" / "final", str(tiny_target), aux_layers=AUX, draft_vocab_size=DV)
    with pytest.raises(DraftsmithError, match="trained for target"):
        run_export(run, cfg_for(other))
    meta_path = run.path / "train" / "final" / "drafter.json"
    meta = json.loads(meta_path.read_text())
    n = target_info(str(tiny_target)).num_layers
    meta["aux_layers"] = [1, 3, n]
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(DraftsmithError, match=rf"drafter\.json: aux_layers.*layer id {n} is out of range"):
        run_export(run, cfg_for(tiny_target))

# --- load_exported on broken folders ------------------------------------------------------------

@pytest.fixture
def exported(trained_run, tiny_target, tmp_path):
    run_export(trained_run, cfg_for(tiny_target))
    return trained_run.path / "export"

def _edit_config(folder: Path, fn) -> None:
    p = folder / "config.json"
    cj = json.loads(p.read_text())
    fn(cj)
    p.write_text(json.dumps(cj))

def _edit_weights(folder: Path, fn) -> None:
    p = folder / "model.safetensors"
    sd = load_file(str(p))
    fn(sd)
    save_file(sd, str(p))

@pytest.mark.parametrize("break_it, message", [
    (lambda d: (d / "config.json").unlink(), r"config\.json: missing"),
    (lambda d: (d / "model.safetensors").unlink(), r"model\.safetensors: missing"),
    (lambda d: (d / "config.json").write_text("{not json"), r"config\.json: not valid JSON"),
    (lambda d: _edit_weights(d, lambda sd: sd.pop("layers.0.hidden_norm.weight")),
     r"model\.safetensors: missing tensor 'layers\.0\.hidden_norm\.weight'"),
    (lambda d: _edit_weights(d, lambda sd: sd.__setitem__("fc.weight", torch.zeros(64, 128))),
     r"model\.safetensors: tensor 'fc\.weight' has shape \[64, 128\], expected \[64, 192\]"),
    (lambda d: _edit_weights(d, lambda sd: sd.__setitem__("extra.weight", torch.zeros(2))),
     r"model\.safetensors: unexpected tensor 'extra\.weight'"),
    (lambda d: _edit_weights(d, lambda sd: sd.__setitem__("d2t", sd["d2t"].float())),
     r"tensor 'd2t' has dtype F32, expected int64"),
    (lambda d: _edit_weights(d, lambda sd: sd["d2t"].__setitem__(3, sd["d2t"][3] - 100)),
     r"model\.safetensors: 'd2t'"),
    # config and weights disagree
    (lambda d: _edit_config(d, lambda c: c.__setitem__("draft_vocab_size", 32)),
     r"model\.safetensors: tensor 'lm_head\.weight' has shape \[64, 64\], expected \[32, 64\]"),
    (lambda d: _edit_config(d, lambda c: c["transformer_layer_config"].__setitem__("intermediate_size", 96)),
     r"tensor 'layers\.0\.mlp\.gate_proj\.weight' has shape"),
    (lambda d: _edit_config(d, lambda c: c.__setitem__("eagle_aux_hidden_state_layer_ids", [1, 3])),
     r"tensor 'fc\.weight' has shape \[64, 192\], expected \[64, 128\]"),
    (lambda d: _edit_config(d, lambda c: c.__setitem__("speculators_model_type", "eagle")),
     r"config\.json: 'speculators_model_type' must be one of eagle3, peagle, dflash"),
    (lambda d: _edit_config(d, lambda c: c.pop("norm_before_residual")),
     r"config\.json: 'norm_before_residual' must be false"),
    (lambda d: _edit_config(d, lambda c: c["transformer_layer_config"].__setitem__(
        "rope_parameters", {"rope_type": "llama3", "rope_theta": 10000.0})), r"rope_type' must be \"default\""),
    (lambda d: _edit_config(d, lambda c: c["transformer_layer_config"].pop("hidden_size")),
     r"config\.json: missing 'transformer_layer_config\.hidden_size'"),
    (lambda d: _edit_config(d, lambda c: c.pop("speculators_config")), r"config\.json: 'speculators_config' needs"),
    (lambda d: _edit_config(d, lambda c: c["transformer_layer_config"].__setitem__("num_hidden_layers", 0)),
     r"config\.json: transformer_layer_config: 'num_hidden_layers' is 0, outside what any model has"),
    # a two-layer config over one-layer weights
    (lambda d: _edit_config(d, lambda c: c["transformer_layer_config"].__setitem__("num_hidden_layers", 2)),
     r"model\.safetensors: missing tensor 'layers\.1\.self_attn\.q_proj\.weight'"),
])
def test_load_exported_rejects_broken_folders(exported, break_it, message):
    load_exported(exported)  # intact first
    break_it(exported)
    with pytest.raises(DraftsmithError, match=message) as e:
        load_exported(exported)
    assert "\n" not in str(e.value)

def test_load_exported_checks_against_target(exported, tiny_target, tmp_path):
    from conftest import build_tiny_target

    info = target_info(str(tiny_target))
    load_exported(exported, target_info=info)
    n = info.num_layers
    _edit_config(exported, lambda c: c.__setitem__("eagle_aux_hidden_state_layer_ids", [1, 3, n + 1]))
    with pytest.raises(DraftsmithError, match=rf"config\.json: eagle_aux_hidden_state_layer_ids: layer id {n + 1} is out of range"):
        load_exported(exported, target_info=info)
    _edit_config(exported, lambda c: c.__setitem__("eagle_aux_hidden_state_layer_ids", AUX))
    bigger = target_info(str(build_tiny_target(tmp_path / "bigvocab", vocab_size=400)))
    if bigger.vocab_size != info.vocab_size:
        with pytest.raises(DraftsmithError, match="vocab_size"):
            load_exported(exported, target_info=bigger)

def test_cli_export(trained_run, tiny_target, cli):
    p = cli("export", "--help")
    assert p.returncode == 0 and "Examples" in p.stdout and "--checkpoint" in p.stdout
    p = cli("export", "--run", str(trained_run.path), "--set", f"target={tiny_target}")
    assert p.returncode == 0, p.stderr
    assert (trained_run.path / "export" / "model.safetensors").is_file()
    p = cli("export", "--run", str(trained_run.path), "--set", f"target={tiny_target}", "--checkpoint", "/nonexistent")
    assert p.returncode == 2 and "no such checkpoint" in p.stderr and "Traceback" not in p.stderr

def _vllm_parses(folder: Path, fields: dict[str, str]) -> dict:
    """What vLLM's own speculators parser makes of the export in `folder`, run in vLLM's venv: "spec", the draft
    config it derives (extract_vllm_speculative_config), and for each name in `fields` the attribute of the config
    it loads (None where it has none)."""
    code = (
        "import json, sys\n"
        "from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig\n"
        "d = json.load(open(sys.argv[1] + '/config.json'))\n"
        "c = SpeculatorsConfig.from_pretrained(sys.argv[1])\n"
        "out = {k: getattr(c, a, None) for k, a in json.loads(sys.argv[2]).items()}\n"
        "out['spec'] = SpeculatorsConfig.extract_vllm_speculative_config(d)\n"
        "print(json.dumps(out))\n"
    )
    p = subprocess.run([str(vllm_python()), "-c", code, str(folder), json.dumps(fields)], capture_output=True,
                       text=True, timeout=300, env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"})
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1])

@pytest.mark.vllm
def test_vllm_reads_exported_config(exported):
    """vLLM's own speculators parser turns the export into the eagle3 draft config we mean."""
    got = _vllm_parses(exported, {"arch": "architectures", "nbr": "norm_before_residual", "rope": "rope_parameters",
                                  "aux": "eagle_aux_hidden_state_layer_ids", "dv": "draft_vocab_size",
                                  "layers": "num_hidden_layers", "hidden": "hidden_size",
                                  "target_hidden": "target_hidden_size"})
    assert got["spec"] == {"method": "eagle3", "num_speculative_tokens": 3}
    assert got["arch"] == ["Eagle3LlamaForCausalLM"]
    assert got["nbr"] is False
    assert got["rope"]["rope_theta"] == 10000.0 and got["rope"].get("rope_type", "default") == "default"
    assert got["aux"] == AUX and got["dv"] == DV and got["layers"] == 1
    assert got["hidden"] == got["target_hidden"] == 64

@pytest.mark.vllm
@pytest.mark.parametrize("kind", ["peagle", "eagle3.1", "dflash"])
def test_vllm_reads_each_kinds_export(tmp_path, tiny_target, kind):
    """vLLM 0.32's own speculators parser reads a P-EAGLE export as parallel drafting with its mask token, an
    EAGLE-3.1 export with its norms on, and a DFlash export as its non-causal block drafter with the target layers it
    was trained on, each where vLLM looks for them; and the serving config export hands out matches what the
    parser derives."""
    options = {"peagle": {"kind": "peagle", "mask_token_id": 5, "fc_norm": True},
               "dflash": {"kind": "dflash", "mask_token_id": 5, "block_size": 4},
               "eagle3.1": {"norm_before_fc": True, "norm_output": True}}[kind]
    run = RunDir(tmp_path / "run").ensure()
    write_drafter_checkpoint(run.path / "train" / "final", str(tiny_target), aux_layers=AUX, draft_vocab_size=DV,
                             **options)
    run_export(run, cfg_for(tiny_target))
    out = run.path / "export"
    got = _vllm_parses(out, {"arch": "architectures", "pard": "pard_token", "nbf": "norm_before_fc", "fcn": "fc_norm",
                             "nout": "norm_output", "nbr": "norm_before_residual", "naux": "num_aux_hidden_states",
                             "aux": "eagle_aux_hidden_state_layer_ids", "dflash": "dflash_config",
                             "nh": "num_hidden_layers", "theta": "rope_theta"})
    ours = speculative_config(out, 3)
    if kind == "dflash":
        assert got["spec"] == {"method": "dflash", "num_speculative_tokens": 3}
        assert got["arch"] == ["DFlashDraftModel"] and got["aux"] == AUX and got["nh"] == 1
        assert got["dflash"]["target_layer_ids"] == [i - 1 for i in AUX] and got["dflash"]["mask_token_id"] == 5
        assert got["dflash"]["causal"] is False and got["theta"] == 10000.0
        assert ours == {"model": str(out), "method": "dflash", "num_speculative_tokens": 3}
        with pytest.raises(DraftsmithError, match="block_size - 1 = 3"):
            speculative_config(out, 5)
        with safe_open(str(out / "model.safetensors"), framework="pt") as f:
            assert {"hidden_norm.weight", "layers.0.self_attn.q_norm.weight", "lm_head.weight", "d2t"} <= set(f.keys())
        return
    assert got["nbr"] is False and got["naux"] == 3 and got["aux"] == AUX
    if kind == "peagle":
        assert got["spec"] == {"method": "eagle3", "num_speculative_tokens": 3, "parallel_drafting": True}
        assert got["arch"] == ["PeagleLlamaForCausalLM"] and got["pard"] == 5
        assert got["fcn"] is True and got["nbf"] is False
        assert ours == {"model": str(out), "method": "eagle3", "num_speculative_tokens": 3, "parallel_drafting": True}
    else:
        assert got["spec"] == {"method": "eagle3", "num_speculative_tokens": 3}
        assert got["arch"] == ["Eagle3LlamaForCausalLM"] and got["pard"] is None
        assert got["nbf"] is True and got["nout"] is True and got["fcn"] is False
        assert ours == {"model": str(out), "method": "eagle3", "num_speculative_tokens": 3}
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    extra = {"mask_hidden", "fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight"} if kind == "peagle" else {
        "input_norm.weight"}
    assert keys == VLLM_KEYS | extra

def test_flat_drafter_json_is_read_too(trained_run, tiny_target):
    """drafter.json with the config fields at the top level and target_fingerprint beside them."""
    meta_path = trained_run.path / "train" / "final" / "drafter.json"
    meta = json.loads(meta_path.read_text())
    flat = {**meta.pop("config"), "aux_layers": meta["aux_layers"], "target": meta["target"]["name"],
            "target_fingerprint": "0" * 16, "ttt_steps": 2}
    meta_path.write_text(json.dumps(flat))
    with pytest.raises(DraftsmithError, match="trained for target"):
        run_export(trained_run, cfg_for(tiny_target))
    flat["target_fingerprint"] = target_info(str(tiny_target)).fingerprint
    meta_path.write_text(json.dumps(flat))
    run_export(trained_run, cfg_for(tiny_target))
    _, info = load_exported(trained_run.path / "export")
    assert info["num_speculative_tokens"] == 2 and info["config"].draft_vocab_size == DV

@pytest.mark.parametrize("umask, folder_mode, file_mode", [(0o022, 0o755, 0o644), (0o077, 0o700, 0o600)])
def test_export_is_readable_as_umask_says(trained_run, tiny_target, umask, folder_mode, file_mode):
    """The serving team's vLLM runs as another account: under umask 022 the export (its folder and
    every file, the manifest too) is world-readable, as any file the user writes would be; under 077
    it stays private. Temporary files and folders are made 0600/0700 and lose that before renaming."""
    old = os.umask(umask)
    try:
        run_export(trained_run, cfg_for(tiny_target))
    finally:
        os.umask(old)
    out = trained_run.path / "export"
    assert out.stat().st_mode & 0o777 == folder_mode
    files = [p for p in out.rglob("*") if p.is_file()]
    assert {"config.json", "model.safetensors", "manifest.json"} <= {p.name for p in files}
    assert {p.name: p.stat().st_mode & 0o777 for p in files} == {p.name: file_mode for p in files}
