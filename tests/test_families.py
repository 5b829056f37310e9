"""The target families users bring (tests/families.py: Llama 3, Qwen3, Qwen3-MoE, Mistral, Gemma 3,
gpt-oss, DeepSeek-V3), each a tiny random model built here, through the hf path of the pipeline:
generate (local) -> prepare -> vocab -> extract (hf) -> train offline -> export, then train online ->
export, every export checked against what vLLM's eagle3 loader needs for that target. Serving the
exports with vLLM is tested in the vLLM tests; which families were checked how: docs/scaling.md."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from families import FAMILIES, LAYOUT_FAMILIES, make_tiny

from draftsmith.config import load_config
from draftsmith.export import load_exported
from draftsmith.model.config import DrafterConfig
from draftsmith.pipeline import run_pipeline
from draftsmith.rundir import RunDir
from draftsmith.target import target_info

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ["Write a short poem about the sea.", "Count from one to ten.", "def add(a, b): what does it return?"]
DRAFT_VOCAB = 64

# What each tiny family's drafter must look like (the rule of DrafterConfig.from_target_config):
# (heads, kv heads, head_dim, intermediate_size, rope_theta)
EXPECTED_SHAPE = {
    "llama": (4, 2, 32, 256, 500000.0),          # Llama-3 rope scaling dropped, its theta kept
    "qwen3": (4, 2, 32, 256, 10000.0),
    "qwen3_moe": (4, 2, 32, 256, 10000.0),       # the dense intermediate_size, not moe_intermediate_size 64
    "mistral": (4, 2, 32, 256, 10000.0),
    "gemma3": (4, 2, 32, 256, 1000000.0),        # the full-attention layers' theta
    "gpt_oss": (4, 2, 32, 192, 150000.0),        # 2 experts per token x 96
    "deepseek_v3": (4, 4, 96, 256, 10000.0),     # MLA drafter: the target's 4 heads of nope 32 + rope 64
    "kimi_k25": (4, 4, 96, 256, 10000.0),        # its DeepSeek-V3 text model's
    "gpt2": (4, 4, 32, 512, 10000.0),            # n_head 4 of 128 / 4; no n_inner: 4 x n_embd; no rope: the default
}
MLA_FAMILIES = ("deepseek_v3", "kimi_k25")
# the folder's own code: Kimi-K2.5's tokenizer (tests/assets/tokenization_tiny_kimi.py)
REMOTE_CODE = ("kimi_k25",)


@pytest.fixture(scope="module")
def family_target(tmp_path_factory):
    """family -> its tiny model folder, built on first use (once per module)."""
    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in built:
            built[family] = make_tiny(family, tmp_path_factory.mktemp(family))
        return built[family]

    return get


@pytest.fixture(scope="module")
def family_run(family_target, tmp_path_factory):
    """family -> (its run, its recipe), taken through the hf pipeline to an export on first use:
    the pipeline test checks that run, the vLLM test reads its export, and either runs alone too."""
    built: dict[str, tuple[RunDir, Path]] = {}

    def get(family: str) -> tuple[RunDir, Path]:
        if family not in built:
            folder = tmp_path_factory.mktemp(f"{family}-run")
            recipe = write_recipe(folder, family_target(family), trust_remote_code=family in REMOTE_CODE)
            run = RunDir(folder / "run")
            run_pipeline(run, load_config(recipe), until_stage="export")
            built[family] = run, recipe
        return built[family]

    return get


def write_recipe(folder: Path, target: Path, trust_remote_code: bool = False) -> Path:
    prompts = folder / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": t}]}) + "\n"
                               for i, t in enumerate(PROMPTS)))
    cfg = {
        "target": str(target), "dtype": "float32", "trust_remote_code": trust_remote_code,
        "generate": {"backend": "local", "prompts": str(prompts), "max_tokens": 10, "batch_size": 3},
        "prepare": {"max_length": 64},
        "vocab": {"draft_vocab_size": DRAFT_VOCAB},
        "extract": {"batch_tokens": 256},
        "train": {"max_steps": 2, "batch_tokens": 64, "seq_len": 64, "warmup_steps": 1, "checkpoint_every": 2,
                  "ttt_steps": 2, "loss_chunk_tokens": 0},
    }
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def check_export(run: RunDir, family: str, target: Path) -> dict:
    """The export against what vLLM's eagle3 path needs for this target; returns its config.json."""
    info = target_info(str(target))
    out = run.path / "export"
    cj = json.loads((out / "config.json").read_text())
    if family in MLA_FAMILIES:
        return check_mla_export(run, family, target, cj)
    layer = cj["transformer_layer_config"]
    assert info.num_layers == 8 and info.hidden_size == 128
    assert cj["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # [2, N // 2, N - 3] for 8 layers
    assert cj["target_hidden_size"] == layer["hidden_size"] == info.hidden_size
    assert layer["vocab_size"] == info.vocab_size and cj["draft_vocab_size"] == DRAFT_VOCAB
    assert layer["model_type"] == "llama" and layer["hidden_act"] == "silu"  # vLLM's llama_eagle3 layer
    heads, kv, head_dim, inter, theta = EXPECTED_SHAPE[family]
    assert (layer["num_attention_heads"], layer["num_key_value_heads"], layer["head_dim"],
            layer["intermediate_size"]) == (heads, kv, head_dim, inter)
    assert layer["rope_parameters"] == {"rope_type": "default", "rope_theta": theta}
    assert cj["norm_before_residual"] is False
    verifier = cj["speculators_config"]["verifier"]
    assert verifier["architectures"] == [info.architecture]
    assert verifier["name_or_path"] == target.name  # the target by a name that holds elsewhere, never a path
    assert cj["draftsmith"]["target_fingerprint"] == info.fingerprint
    # read back the way vLLM uses it: every tensor, shape and the vocabulary maps
    drafter, meta = load_exported(out, target_info=info)
    assert meta["aux_layers"] == [2, 4, 5]
    assert drafter.lm_head.weight.shape == (DRAFT_VOCAB, 128)
    assert drafter.fc.weight.shape == (128, 3 * 128)
    return cj


def check_mla_export(run: RunDir, family: str, target: Path, cj: dict) -> dict:
    """An MLA target's export: the native EAGLE-3 folder vLLM serves as Eagle3DeepseekV3ForCausalLM, with the
    target's latent widths; read back through load_exported."""
    info = target_info(str(target), trust_remote_code=family in REMOTE_CODE)
    text = json.loads((target / "config.json").read_text())
    text = text.get("text_config", text)
    assert cj["architectures"] == ["Eagle3DeepseekV3ForCausalLM"] and cj["model_type"] == "deepseek_v2"
    for key in ("num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                "v_head_dim", "hidden_size", "vocab_size"):
        assert cj[key] == text[key], key
    assert cj["intermediate_size"] == text["intermediate_size"] and cj["draft_vocab_size"] == DRAFT_VOCAB
    assert cj["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert cj["norm_before_residual"] is False and cj["rope_parameters"]["rope_type"] == "default"
    assert cj["draftsmith"]["verifier"] == target.name and cj["draftsmith"]["target_fingerprint"] == info.fingerprint
    drafter, meta = load_exported(run.path / "export", target_info=info)
    assert meta["aux_layers"] == [2, 4, 5] and drafter.config.attention == "mla"
    assert drafter.layers[0].self_attn.kv_a_proj_with_mqa.weight.shape == (512 + 64, 2 * 128)
    return cj


@pytest.mark.parametrize("family", FAMILIES)
def test_family_through_the_hf_pipeline(family, family_target, family_run):
    target = family_target(family)
    run, recipe = family_run(family)
    samples = [json.loads(line) for line in (run.path / "prepare" / "samples.jsonl").read_text().splitlines()]
    assert samples and all(sum(s["loss_mask"]) > 0 for s in samples), "prepare kept answers with assistant tokens"
    assert (run.path / "extract").is_dir() and run.read_manifest("extract") is not None
    offline = check_export(run, family, target)
    offline_loss = run.read_manifest("train")["counts"]["loss"]

    # online: the same drafter trained from the target in-process (no extract/ read): the same
    # hidden states, so the same losses up to the store's bf16 rounding
    run_pipeline(run, load_config(recipe, ["train.mode=online"]), from_stage="train", until_stage="export")
    train = run.read_manifest("train")
    assert train["settings"]["train"]["mode"] == "online"
    assert train["counts"]["loss"] == pytest.approx(offline_loss, rel=0.05)
    online = check_export(run, family, target)
    shape_of = (lambda c: {k: v for k, v in c.items() if k != "draftsmith"}) if family in MLA_FAMILIES else (
        lambda c: c["transformer_layer_config"])
    assert shape_of(online) == shape_of(offline)


@pytest.mark.parametrize("family", LAYOUT_FAMILIES)
def test_a_family_with_its_own_layout_goes_through_the_pipeline(family, family_target, family_run):
    """GPT-2's checkpoint (`transformer.h.N`, a fused c_attn, Conv1D weights, n_embd) goes through generate ->
    prepare -> vocab -> extract (hf) -> train -> export by its adapter in draftsmith/target/layout.py alone; the
    adapter maps its decoder layer to a Llama layer's tensors (the fused q/k/v split), as train.init_layer reads."""
    from safetensors import safe_open

    from draftsmith.train.drafter import read_target_layer

    target = family_target(family)
    run, _ = family_run(family)
    samples = [json.loads(line) for line in (run.path / "prepare" / "samples.jsonl").read_text().splitlines()]
    assert samples and all(sum(s["loss_mask"]) > 0 for s in samples)
    assert run.read_manifest("extract")["counts"]["done"] == len(samples)
    assert run.read_manifest("train")["counts"]["done"] == 2
    check_export(run, family, target)
    info = target_info(str(target))
    layer = read_target_layer(info, 3)
    with safe_open(str(target / "model.safetensors"), framework="pt") as f:
        fused = f.get_tensor("transformer.h.3.attn.c_attn.weight")  # [in 128, out 3 x 128]
    assert layer["self_attn.k_proj.weight"].shape == (128, 128)
    assert layer["self_attn.k_proj.weight"].equal(fused[:, 128:256].t())
    assert "input_layernorm.weight" in layer and "attn.c_attn.weight" not in layer


def test_a_family_layout_without_its_adapter_is_refused_in_one_line(family_target, monkeypatch, tmp_path):
    """Without its adapter, a GPT-2 checkpoint is refused by the first stage that reads the target, in one line
    naming the layout it expected, the stack it found and where an adapter goes."""
    from draftsmith import DraftsmithError
    from draftsmith.generate.stage import run_generate
    from draftsmith.target import layout

    target = family_target("gpt2")
    monkeypatch.delitem(layout.LAYOUTS, "gpt2")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "p0", "messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(DraftsmithError) as e:
        run_generate(RunDir(tmp_path / "run"), load_config(None, [f"target={target}", f"generate.prompts={prompts}"]))
    said = str(e.value)
    assert "\n" not in said and str(target) in said and "GPT2LMHeadModel" in said, said
    assert "the Llama layout" in said and "`transformer.h.N.*`" in said and "draftsmith/target/layout.py" in said, said
    assert not (tmp_path / "run" / "generate" / "samples.jsonl").exists()


@pytest.mark.vllm
def test_vllm_reads_every_family_export(family_run):
    """vLLM's own speculators parser (from the vLLM environment) turns each family's export into the
    eagle3 draft config we mean: its Llama layer's heads, kv heads, head_dim and MLP width, the aux
    layers, the draft vocabulary; it needs the verifier field only to be there."""
    import os
    import subprocess

    from draftsmith.vllm_server import vllm_python

    code = (
        "import json, sys\n"
        "from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig\n"
        "for path in sys.argv[1:]:\n"
        "    d = json.load(open(path + '/config.json'))\n"
        "    spec = SpeculatorsConfig.extract_vllm_speculative_config(d)\n"
        "    c = SpeculatorsConfig.from_pretrained(path)\n"
        "    print(json.dumps({'path': path, 'method': spec['method'], 'arch': c.architectures,"
        " 'shape': [c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.intermediate_size],"
        " 'aux': c.eagle_aux_hidden_state_layer_ids, 'dv': c.draft_vocab_size, 'hidden': c.target_hidden_size}))\n"
    )
    families = sorted(f for f in FAMILIES if f not in MLA_FAMILIES)  # MLA exports are native: served in test_families_vllm
    exports = [str(family_run(f)[0].path / "export") for f in families]  # online or offline: the same shapes
    p = subprocess.run([str(vllm_python()), "-c", code, *exports], capture_output=True,
                       text=True, timeout=600, env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"})
    assert p.returncode == 0, p.stderr[-2000:]
    got = [json.loads(line) for line in p.stdout.strip().splitlines() if line.startswith("{")]
    assert [g["path"] for g in got] == exports
    for family, g in zip(families, got):
        heads, kv, head_dim, inter, _ = EXPECTED_SHAPE[family]
        assert g["method"] == "eagle3" and g["arch"] == ["Eagle3LlamaForCausalLM"], (family, g)
        assert g["shape"] == [heads, kv, head_dim, inter], (family, g)
        assert g["aux"] == [2, 4, 5] and g["dv"] == DRAFT_VOCAB and g["hidden"] == 128, (family, g)


def test_mla_drafter_shape_for_kimi_k2():
    """Kimi-K2's real config (configs/targets/kimi-k2-instruct.json): head_dim 128 (its v_head_dim),
    7,168 / 128 = 56 heads, 8 kv heads, the dense intermediate_size 18,432, never the config's
    head_dim field (the rope part, 64) nor moe_intermediate_size (2,048)."""
    from types import SimpleNamespace

    c = json.loads((Path(__file__).resolve().parents[1] / "configs" / "targets" / "kimi-k2-instruct.json").read_text())
    cfg = DrafterConfig.from_target_config(SimpleNamespace(**c, head_dim=c["qk_rope_head_dim"]), 32000, attention="gqa")
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (7168, 56, 8, 128)
    assert cfg.num_attention_heads * cfg.head_dim == 7168
    assert cfg.intermediate_size == 18432


# real published configs' numbers (the fields the rule reads) -> the drafter's (heads, kv heads,
# head_dim, intermediate_size)
REAL_SHAPES = {
    "DeepSeek-V3": (dict(hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_attention_heads=128,
                         num_key_value_heads=128, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
                         v_head_dim=128, head_dim=64, n_routed_experts=256, num_experts_per_tok=8), (56, 8, 128, 18432)),
    "Qwen3-30B-A3B": (dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_attention_heads=32,
                           num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8), (32, 4, 128, 6144)),
    "gpt-oss-120b": (dict(hidden_size=2880, intermediate_size=2880, num_attention_heads=64, num_key_value_heads=8,
                          head_dim=64, num_local_experts=128, num_experts_per_tok=4), (64, 8, 64, 11520)),
    "Mixtral-8x7B": (dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                          num_local_experts=8, num_experts_per_tok=2), (32, 8, None, 28672)),
    "Llama-4-Scout": (dict(hidden_size=5120, intermediate_size=8192, intermediate_size_mlp=16384, num_attention_heads=40,
                           num_key_value_heads=8, head_dim=128, num_local_experts=16, num_experts_per_tok=1), (40, 8, 128, 16384)),
    "Llama-3.1-8B": (dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                          head_dim=128), (32, 8, 128, 14336)),
}


@pytest.mark.parametrize("name", REAL_SHAPES)
def test_drafter_shape_rule_on_real_configs(name):
    """The documented rule (DrafterConfig.from_target_config) on real targets' numbers, and estimate's
    widths from the plain dict (estimate.drafter_widths, the same rules through an attribute view) agree."""
    from types import SimpleNamespace

    from draftsmith.estimate import drafter_widths

    fields, (heads, kv, head_dim, inter) = REAL_SHAPES[name]
    c = {**fields, "vocab_size": 32000, "num_hidden_layers": 32}
    cfg = DrafterConfig.from_target_config(SimpleNamespace(**c), 1000, attention="gqa")
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size) == (heads, kv, inter)
    assert cfg.head_dim == (head_dim or 4096 // 32)
    assert drafter_widths(c) == (heads * cfg.head_dim, kv * cfg.head_dim, inter)


def _drafter_trainable(cfg: DrafterConfig) -> int:
    import torch

    from draftsmith.model.eagle3 import Eagle3Drafter

    with torch.device("meta"):
        model = Eagle3Drafter(cfg)
    return sum(p.numel() for n, p in model.named_parameters() if p.requires_grad and "norm" not in n)


@pytest.mark.parametrize("family", FAMILIES + LAYOUT_FAMILIES)
def test_estimate_from_the_family_config_alone(family, family_target):
    """`estimate` from config.json alone (no weights read) for each family: every stage gets a time,
    and its drafter is model/eagle3.py's (the same widths and trainable parameters as
    DrafterConfig.from_target_config)."""
    from transformers import AutoConfig

    from draftsmith.estimate import _drafter_params, estimate_config, render, target_shape

    folder = family_target(family)
    cfg = load_config(None, [f"target={folder}", f"vocab.draft_vocab_size={DRAFT_VOCAB}", "generate.limit=100"])
    e = estimate_config(cfg, "cpu", 1, folder / "config.json", prompt_tokens=100, answer_tokens=None)
    assert all(s["seconds"] > 0 for s in e["stages"].values()) and "train" in render(e)
    shape = target_shape(folder / "config.json")
    assert (shape.num_layers, shape.hidden_size) == (8, 128)
    hf = AutoConfig.from_pretrained(folder)
    dcfg = DrafterConfig.from_target_config(hf.get_text_config(), DRAFT_VOCAB)
    # estimate's widths, from the plain config.json, are those of the drafter from transformers' config
    assert (shape.q_dim, shape.kv_dim, shape.intermediate_size) == (
        dcfg.num_attention_heads * dcfg.head_dim, dcfg.num_key_value_heads * dcfg.head_dim, dcfg.intermediate_size)
    assert (shape.drafter_mla is not None) == (dcfg.attention == "mla") == (family in MLA_FAMILIES)
    assert _drafter_params(shape, DRAFT_VOCAB)[0] == _drafter_trainable(dcfg)


@pytest.mark.parametrize("name", sorted(p.name for p in (Path(__file__).resolve().parents[1] / "configs" / "targets").glob("*.json")))
def test_estimate_for_the_shipped_target_configs(name):
    """The real configs in configs/targets/ (Llama-3.1-8B, Kimi-K2): estimate runs on an 8-GPU
    profile and its drafter is model/eagle3.py's, read from the plain config.json."""
    from types import SimpleNamespace

    from draftsmith.estimate import HARDWARE, _drafter_params, estimate, target_shape

    path = Path(__file__).resolve().parents[1] / "configs" / "targets" / name
    shape = target_shape(path)
    e = estimate(load_config(None, ["generate.limit=10000"]), shape, HARDWARE["h200"], 8, prompt_tokens=300, answer_tokens=800)
    assert all(s["seconds"] > 0 for s in e["stages"].values())
    c = json.loads(path.read_text())
    c = c.get("text_config") or c  # Kimi-K2.5: the wrapper's language model
    dcfg = DrafterConfig.from_target_config(SimpleNamespace(**c), 32000)
    assert _drafter_params(shape, 32000)[0] == _drafter_trainable(dcfg)


def _config_only_folder(folder: Path, config_cls, architectures) -> Path:
    config = config_cls()
    config.architectures = architectures
    config.save_pretrained(folder)
    return folder


BAD_TARGETS = {  # kind: (config class, architectures, what the one line says)
    "encoder-only": ("BertConfig", ["BertForMaskedLM"], "BertForMaskedLM (model_type bert) is an encoder-only model"),
    "vision-only": ("ViTConfig", ["ViTForImageClassification"], "ViTForImageClassification (model_type vit) is a vision-only model"),
    "no num_hidden_layers": ("BltConfig", ["BltForCausalLM"],
                             "BltForCausalLM (model_type blt) is a model whose config has no num_hidden_layers"),
}


def _bad_target(tmp_path: Path, kind: str) -> tuple[Path, Path, str]:
    import transformers

    config_cls, architectures, words = BAD_TARGETS[kind]
    folder = _config_only_folder(tmp_path / kind.replace(" ", "-"), getattr(transformers, config_cls), architectures)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "p0", "messages": [{"role": "user", "content": "hi"}]}) + "\n")
    return folder, prompts, words


@pytest.mark.parametrize("kind", BAD_TARGETS)
def test_a_target_the_drafter_cannot_follow_is_refused_by_the_first_stage(kind, tmp_path):
    """Encoder-only, vision-only, and a config without num_hidden_layers: `generate`, the first stage
    that reads the target, refuses it before any work, naming the file and the architecture."""
    from draftsmith import DraftsmithError
    from draftsmith.generate.stage import run_generate

    folder, prompts, words = _bad_target(tmp_path, kind)
    run = RunDir(tmp_path / "run")
    with pytest.raises(DraftsmithError) as e:
        run_generate(run, load_config(None, [f"target={folder}", f"generate.prompts={prompts}"]))
    assert words in str(e.value) and str(folder / "config.json") in str(e.value) and "\n" not in str(e.value)
    assert not (run.path / "generate" / "samples.jsonl").exists()


def test_the_cli_refuses_an_encoder_only_target_in_one_line(tmp_path, cli):
    """The same through the command line, as a user meets it: non-zero exit, one line on stderr, no traceback."""
    folder, prompts, words = _bad_target(tmp_path, "encoder-only")
    p = cli("generate", "--run", str(tmp_path / "run"), "--set", f"target={folder}", "--set", f"generate.prompts={prompts}")
    err = p.stderr.strip()
    assert p.returncode != 0 and err.count("\n") == 0 and "Traceback" not in err, err
    assert words in err, err
