"""Tiny random targets of the families users bring, built offline with transformers' own config
classes and SmolLM2's tokenizer (the embedded target's, converted once into the draftsmith cache).

Every model has 8 decoder layers and hidden size 128 (so the default auxiliary layers are
[2, 4, 5]) and is saved as a bf16 safetensors folder with the tokenizer and its ChatML template:

    from families import FAMILIES, make_tiny
    folder = make_tiny("deepseek_v3", tmp_path / "ds")

Each family keeps the quirks a drafter or vLLM trips over (see FAMILY_NOTES): Llama-3 rope
scaling, Qwen3's q/k norms, a Qwen3-MoE with a dense first layer and an `intermediate_size`
different from its `moe_intermediate_size`, Mistral's sliding window, Gemma 3's text model
(scaled embeddings, tied head, sliding and full layers), gpt-oss (MoE with attention sinks and
biases), DeepSeek-V3 (MLA attention with a `head_dim` that is only the rope part, a dense first
layer, `topk_method: noaux_tc` so the router's `e_score_correction_bias` is saved as vLLM expects).
"""

from __future__ import annotations

import json
from pathlib import Path

FAMILIES = ("llama", "qwen3", "qwen3_moe", "mistral", "gemma3", "gpt_oss", "deepseek_v3", "kimi_k25")
# families whose checkpoint is not laid out as Llama's: each goes through draftsmith by its adapter in
# draftsmith/target/layout.py alone (vLLM serves no EAGLE-3 drafter beside them, so the vLLM tests leave them out)
LAYOUT_FAMILIES = ("gpt2",)

NUM_LAYERS = 8
HIDDEN = 128

FAMILY_NOTES = {
    "llama": "LlamaForCausalLM, Llama-3 rope scaling (rope_type llama3), untied head",
    "qwen3": "Qwen3ForCausalLM, q/k norms, tied head",
    "qwen3_moe": "Qwen3MoeForCausalLM, 4 experts (top 2), dense layer 0 (mlp_only_layers), moe_intermediate_size != intermediate_size",
    "mistral": "MistralForCausalLM, sliding window",
    "gemma3": "Gemma3ForCausalLM (gemma3_text), scaled embeddings, tied head, sliding/full layers",
    "gpt_oss": "GptOssForCausalLM, 4 experts (top 2), attention sinks, sliding/full layers",
    "deepseek_v3": "DeepseekV3ForCausalLM, MLA (q/kv LoRA, latent 512 + rope 64), dense layer 0, noaux_tc router",
    "kimi_k25": "KimiK25ForConditionalGeneration: a MoonViT tower and projector around the DeepSeek-V3 text model "
                "(text_config, weights under language_model.*), untied head",
    "gpt2": "GPT2LMHeadModel: transformer.wte / transformer.h.N / transformer.ln_f, one fused attn.c_attn for q, k "
            "and v, Conv1D weights stored [in, out], LayerNorm, learned positions, config fields n_embd / n_layer, "
            "tied head",
}


def smollm2_tokenizer_folder() -> Path:
    """The folder of the embedded SmolLM2 target (its tokenizer is what every tiny family uses)."""
    from draftsmith.target import target_info

    return Path(target_info("smollm2-135m", log=lambda *a, **k: None).path)


def family_config(family: str, *, bos: int, eos: int, pad: int, vocab_size: int, num_layers: int = NUM_LAYERS):
    """The transformers config of the tiny model of `family` (not saved)."""
    import transformers as tf

    common = dict(vocab_size=vocab_size, hidden_size=HIDDEN, num_hidden_layers=num_layers,
                  max_position_embeddings=2048, bos_token_id=bos, eos_token_id=eos, pad_token_id=pad)
    if family == "llama":
        common["max_position_embeddings"] = 131072  # Llama-3.1's, above the rope's original 8192
        cfg = tf.LlamaConfig(
            **common, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
        arch = "LlamaForCausalLM"
    elif family == "qwen3":
        cfg = tf.Qwen3Config(**common, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=32, tie_word_embeddings=True)
        arch = "Qwen3ForCausalLM"
    elif family == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(**common, intermediate_size=256, moe_intermediate_size=64, num_experts=4,
                                num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[0],
                                num_attention_heads=4, num_key_value_heads=2, head_dim=32, norm_topk_prob=True,
                                tie_word_embeddings=False)
        arch = "Qwen3MoeForCausalLM"
    elif family == "mistral":
        cfg = tf.MistralConfig(**common, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=32, sliding_window=64, tie_word_embeddings=False)
        arch = "MistralForCausalLM"
    elif family == "gemma3":
        cfg = tf.Gemma3TextConfig(**common, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                                  head_dim=32, query_pre_attn_scalar=32, sliding_window=64, tie_word_embeddings=True)
        arch = "Gemma3ForCausalLM"
    elif family == "gpt_oss":
        common["max_position_embeddings"] = 131072  # yarn factor 32 over the original 4096
        cfg = tf.GptOssConfig(**common, intermediate_size=96, num_local_experts=4, num_experts_per_tok=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=64,
                              tie_word_embeddings=False)
        arch = "GptOssForCausalLM"
    elif family == "deepseek_v3":
        cfg = tf.DeepseekV3Config(
            **common, intermediate_size=256, moe_intermediate_size=64, num_attention_heads=4, num_key_value_heads=4,
            n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
            # latent 512 + rope 64: vLLM-CPU's MLA decode kernel takes a head of 576 only (320 failed with
            # "Unsupported block size: 16"); the MLA drafter shares the target's KV-cache layout
            first_k_dense_replace=1, kv_lora_rank=512, q_lora_rank=64, qk_rope_head_dim=64, qk_nope_head_dim=32,
            v_head_dim=32, num_nextn_predict_layers=0, tie_word_embeddings=False, topk_method="noaux_tc",
            scoring_func="sigmoid")
        arch = "DeepseekV3ForCausalLM"
    elif family == "kimi_k25":
        text = family_config("deepseek_v3", bos=bos, eos=eos, pad=pad, vocab_size=vocab_size, num_layers=num_layers)
        text.architectures = None
        vision = tf.models.kimi_k25.Kimi_K25VisionConfig(num_hidden_layers=1, hidden_size=64, intermediate_size=128,
                                                         num_attention_heads=2, pos_emb_height=8, pos_emb_width=8)
        # the media token ids are the vocabulary's last (Kimi's own lie beyond SmolLM2's 49,152)
        cfg = tf.Kimi_K25Config(text_config=text.to_dict(), vision_config=vision.to_dict(), projection_hidden_size=64,
                                tie_word_embeddings=False, image_token_id=vocab_size - 1, video_token_id=vocab_size - 2,
                                vision_start_token_id=vocab_size - 3, vision_end_token_id=vocab_size - 4)
        arch = "KimiK25ForConditionalGeneration"  # the checkpoint's name (and vLLM's), not transformers' Kimi_K25...
    elif family == "gpt2":
        cfg = tf.GPT2Config(vocab_size=vocab_size, n_embd=HIDDEN, n_layer=num_layers, n_head=4, n_positions=2048,
                            bos_token_id=bos, eos_token_id=eos, pad_token_id=pad, tie_word_embeddings=True)
        arch = "GPT2LMHeadModel"
    else:
        raise ValueError(f"unknown family {family!r} (known: {', '.join(FAMILIES + LAYOUT_FAMILIES)})")
    cfg.architectures = [arch]
    return cfg


# Kimi-K2.5-style chat template over SmolLM2's ChatML tokens: every assistant turn is rendered with a think
# block, the last one with its reasoning_content and earlier ones empty (Kimi-K2-Thinking keeps reasoning of
# the last turn only)
KIMI_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}"
    "<|im_start|>assistant\n<think>{{ (m.reasoning_content or '') if loop.last else '' }}</think>"
    "{{ m.content }}<|im_end|>{{ '\\n' }}"
    "{%- else -%}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>{{ '\\n' }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant{{ '\\n' }}{%- endif -%}")


def _write_kimi_tokenizer(folder: Path, fast) -> None:
    """The tiny Kimi's tokenizer: SmolLM2's vocabulary as a tiktoken file read by a Python tokenizer class
    that the folder ships as its own code (tests/assets/tokenization_tiny_kimi.py, through auto_map), as
    Kimi-K2.5's does: loading it needs trust_remote_code and tiktoken, and it has no offset mapping."""
    import base64
    import shutil

    byte_of = {c: b for b, c in _bytes_to_unicode().items()}
    specials = {t.content: i for i, t in fast.added_tokens_decoder.items()}
    lines = [f"{base64.b64encode(bytes(byte_of[c] for c in tok)).decode()} {i}"
             for tok, i in sorted(fast.get_vocab().items(), key=lambda kv: kv[1]) if tok not in specials]
    (folder / "tiktoken.model").write_text("\n".join(lines) + "\n")
    shutil.copy(Path(__file__).parent / "assets" / "tokenization_tiny_kimi.py", folder / "tokenization_tiny_kimi.py")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        (folder / name).unlink(missing_ok=True)
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "TinyKimiTokenizer",
        "auto_map": {"AutoTokenizer": ["tokenization_tiny_kimi.TinyKimiTokenizer", None]},
        "special_tokens": specials, "bos_token": fast.bos_token, "eos_token": fast.eos_token,
        "pad_token": fast.pad_token, "unk_token": fast.unk_token, "chat_template": KIMI_TEMPLATE,
        "model_max_length": 2048}, indent=1))


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the alphabet of byte-level BPE vocabularies)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _fix_kimi_checkpoint(folder: Path) -> None:
    """Rewrite the names transformers 5.24 saves a Kimi_K25ForConditionalGeneration under into the released
    checkpoint's (and vLLM's kimi_k25.py's): its reverse of the vision renames also turns the language
    model's `layers` into `blocks`, writes the projector's norm under `model.` and the patch embedding
    under `vision_tower.encoder.`."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = folder / "model.safetensors"
    with safe_open(str(path), framework="pt") as f:
        tensors = {k.replace("language_model.model.blocks.", "language_model.model.layers.")
                   .replace("model.mm_projector.", "mm_projector.")
                   .replace("vision_tower.encoder.patch_embed.", "vision_tower.patch_embed."): f.get_tensor(k)
                   for k in f.keys()}
    save_file(tensors, str(path), metadata={"format": "pt"})
    # the image processor's settings as Kimi-K2.5's preprocessor_config.json gives them (vLLM's multimodal
    # processor reads them at start-up even when no image is allowed)
    (folder / "preprocessor_config.json").write_text(json.dumps({"media_proc_cfg": {
        "in_patch_limit": 16384, "patch_size": 14, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "merge_kernel_size": 2, "fixed_output_tokens": None, "patch_limit_on_one_side": 512,
        "in_patch_limit_each_frame": 4096, "in_patch_limit_video": None, "sample_fps": 2.0,
        "max_num_frames_each_video": None, "temporal_merge_kernel_size": 4, "timestamp_mode": "hh:mm:ss.fff"}},
        indent=1))
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"] = ["KimiK25ForConditionalGeneration"]
    cfg["media_placeholder_token_id"] = cfg["image_token_id"]  # the released config's field, which vLLM reads
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))


# `learnable`: the LM head speaks only these token ids (SmolLM2's word pieces), 5x sharper than `lively`
LEARNABLE_IDS = range(1000, 1100)


def make_tiny(family: str, folder: Path, *, num_layers: int = NUM_LAYERS, seed: int = 0,
              dtype: str = "bfloat16", lively: bool = True, learnable: bool = False) -> Path:
    """Build the tiny random model of `family` into `folder` (created) and return it.

    `lively`: draw the 2-D weights with std 0.2 instead of transformers' 0.02, so that greedy
    decoding does not repeat one token forever (the random model's logits are otherwise nearly
    flat and generate's answers collapse into whitespace that prepare rightly drops).

    `learnable`: a target a drafter learns in a minute, to show that training pays where serving is checked.
    A random target's next token is a hash of its whole context (a drafter reached 2 % accuracy after 600
    steps); this one is nearly a bigram model: its layers' output projections (attention's o_proj, every
    MLP's down_proj) are scaled by 0.01, so the current token dominates the residual stream while the
    layers still move it, and its head speaks only LEARNABLE_IDS, 5x sharper. A drafter trained for 120
    steps on 12 answers reached tau 1.35 in the local engine where an untrained one had 1.00."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(smollm2_tokenizer_folder())
    cfg = family_config(family, bos=tok.bos_token_id, eos=tok.eos_token_id, pad=tok.pad_token_id,
                        vocab_size=len(tok), num_layers=num_layers)
    torch.manual_seed(seed)
    if family == "kimi_k25":
        from transformers import Kimi_K25ForConditionalGeneration

        model = Kimi_K25ForConditionalGeneration(cfg)
    else:
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    if lively:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() >= 2 and "norm" not in name:
                    p.normal_(0, 0.2 if p.dim() == 2 else 0.05)
            if learnable:
                if model.config.get_text_config().tie_word_embeddings:
                    raise ValueError("learnable: for untied heads only (a tied one would silence the embeddings)")
                for name, p in model.named_parameters():
                    if name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):  # fused experts too
                        p.mul_(0.01)
                head = model.get_output_embeddings().weight
                speaks = torch.zeros(head.shape[0], dtype=torch.bool)
                speaks[list(LEARNABLE_IDS)] = True
                head.mul_(5).masked_fill_(~speaks[:, None], 0)
            if family == "gemma3":
                # Gemma scales its (tied) embeddings by sqrt(hidden): at std 0.2 the input token
                # dominates the residual stream and greedy decoding repeats it forever
                model.get_input_embeddings().weight.normal_(0, 0.02)
    model = model.to(getattr(torch, dtype))
    model.config.dtype = getattr(torch, dtype)
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    if family == "kimi_k25":
        _fix_kimi_checkpoint(folder)
        _write_kimi_tokenizer(folder, tok)
    (folder / "draftsmith-family.json").write_text(json.dumps({"family": family, "note": FAMILY_NOTES[family]}))
    return folder


# Multimodal wrappers around a language model, beside kimi_k25 (whose pipeline runs in the family tests): each
# checkpoint lays its language model out differently, and draftsmith loads that language model alone
WRAPPERS = {
    "gemma3": "Gemma3ForConditionalGeneration: SigLIP tower; language_model.model.* (the released layout), tied head",
    "qwen3_vl": "Qwen3VLForConditionalGeneration: model.language_model.* (transformers 5's layout), top-level lm_head; "
                "transformers ships no Qwen3VLTextForCausalLM",
    "llama4": "Llama4ForConditionalGeneration: MoE text model with chunked attention, language_model.lm_head",
}


def make_tiny_wrapper(kind: str, folder: Path, seed: int = 0) -> Path:
    """A tiny random multimodal wrapper of `kind` (WRAPPERS), saved with SmolLM2's tokenizer; returns the folder."""
    import torch
    import transformers as tf

    tok = tf.AutoTokenizer.from_pretrained(smollm2_tokenizer_folder())
    v = len(tok)
    text = dict(vocab_size=v, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, intermediate_size=128, max_position_embeddings=512, bos_token_id=tok.bos_token_id,
                eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    media = dict(image_token_index=v - 1, boi_token_index=v - 2, eoi_token_index=v - 3)
    torch.manual_seed(seed)
    if kind == "gemma3":
        model = tf.Gemma3ForConditionalGeneration(tf.Gemma3Config(
            text_config={**text, "sliding_window": 32, "query_pre_attn_scalar": 16}, vision_config=vision,
            mm_tokens_per_image=4, **media))
    elif kind == "qwen3_vl":
        model = tf.Qwen3VLForConditionalGeneration(tf.Qwen3VLConfig(
            text_config={**text, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                     "mrope_section": [2, 3, 3]}},
            vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                               deepstack_visual_indexes=[0]),
            image_token_id=v - 1, video_token_id=v - 2, vision_start_token_id=v - 3, vision_end_token_id=v - 4))
    elif kind == "llama4":
        model = tf.Llama4ForConditionalGeneration(tf.Llama4Config(
            text_config={**text, "intermediate_size_mlp": 128, "num_local_experts": 2, "num_experts_per_tok": 1,
                         "interleave_moe_layer_step": 2, "no_rope_layers": [1, 1, 1, 0], "attention_chunk_size": 64},
            vision_config={**vision, "vision_output_dim": 64, "projector_input_dim": 64, "projector_output_dim": 64},
            **media))
    else:
        raise ValueError(f"unknown wrapper {kind!r} (known: {', '.join(WRAPPERS)})")
    with torch.no_grad():  # lively, as make_tiny's: logits that differ by more than rounding
        for name, p in model.named_parameters():
            if p.dim() >= 2 and "norm" not in name:
                p.normal_(0, 0.2 if p.dim() == 2 else 0.05)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return Path(folder)


if __name__ == "__main__":  # python tests/families.py OUT_DIR: every family into OUT_DIR/<family>
    import sys
    import time

    import transformers

    print("transformers", transformers.__version__)
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/draftsmith-families")
    for fam in FAMILIES:
        t0 = time.time()
        p = make_tiny(fam, out / fam)
        print(f"{fam:12s} {time.time() - t0:5.1f}s {p}")
