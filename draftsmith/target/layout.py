"""Where a target's language model sits: its tensor names in the checkpoint and its modules once loaded.

Most families lay a decoder out as Llama does (`model.embed_tokens`, `model.layers.N.self_attn.q_proj`,
`model.norm`, `lm_head`), under a wrapper's prefix when a vision tower sits beside it; `Layout()` is that layout.
A family whose checkpoint differs adds one adapter to LAYOUTS, keyed by its text config's model_type, as
torchtitan's state_dict_adapter does: the names of its stack, embeddings and final norm, its config fields under
the names the drafter's rules read, and its decoder layer's tensors under a Llama layer's names (fused
projections split). Nothing else in draftsmith names a family's tensors or modules.

No torch here: `draftsmith estimate` reads a family's config through its adapter (identity.py).
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from safetensors import safe_open

from draftsmith import DraftsmithError


def first_sentence(e: BaseException) -> str:
    """A library's message cut to its first sentence (transformers' list every class it knows)."""
    text = " ".join(str(e).split())
    for stop in (". ", ": ["):
        if stop in text[:400]:
            text = text[: text.index(stop)]
            break
    return f"{type(e).__name__}: {text[:300]}"


# -------------------------------------------------------------------------------------------------
# The adapters


@dataclass(frozen=True)
class Layout:
    """A family's checkpoint layout; the defaults are Llama's (and every family's that copies it)."""
    name: str = "Llama"
    root: str = "model."  # the decoder stack's prefix in the family's own causal LM checkpoint
    embed: str = "embed_tokens"  # inside the stack: the token embeddings, the list of layers, the final norm
    layers: str = "layers"
    norm: str = "norm"
    # the drafter rules' name of a config field -> this family's (GPT-2's `n_embd` is `hidden_size`)
    config_keys: dict[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        return f"`*{self.embed}.weight` beside `*{self.layers}.N.*`"

    def decoder(self, model) -> tuple[Any, Any]:
        """(the module returning the final normed state, its list of decoder layers) of a loaded causal LM."""
        # the family's own attribute first: transformers' get_decoder() is the model itself for some (Llama 4)
        base = getattr(model, self.root[:-1], None)
        if getattr(base, self.layers, None) is None and hasattr(model, "get_decoder"):
            base = model.get_decoder()
        layers = getattr(base, self.layers, None)
        if base is None or layers is None:
            raise DraftsmithError(f"target: cannot find the decoder layers of {type(model).__name__} (expected "
                                  f"{self.root}{self.layers}, the {self.name} layout; another layout needs an "
                                  "adapter in draftsmith/target/layout.py)")
        return base, layers

    def final_norm(self, model):
        """The loaded model's final norm module (None when it has none)."""
        return getattr(self.decoder(model)[0], self.norm, None)

    def llama_layer(self, tensors: dict, text: dict) -> dict:
        """One decoder layer's tensors {name inside the layer: tensor} under a Llama layer's names (what
        train.init_layer copies); `text`: the text config (identity.py's, in the drafter rules' names)."""
        return tensors


class GPT2Layout(Layout):
    """GPT-2 (`transformer.wte`, `transformer.h.N`, `transformer.ln_f`): one fused `attn.c_attn` for q, k and v,
    and Conv1D weights stored [in, out], the transpose of a Linear's."""

    def llama_layer(self, tensors: dict, text: dict) -> dict:
        out = {}
        for key, t in tensors.items():
            if key == "attn.c_attn.weight":  # [H, 3H] -> q, k, v [H, H] each
                for proj, w in zip(("q_proj", "k_proj", "v_proj"), t.t().chunk(3, dim=0)):
                    out[f"self_attn.{proj}.weight"] = w.contiguous()
            elif key == "attn.c_attn.bias":
                for proj, b in zip(("q_proj", "k_proj", "v_proj"), t.chunk(3, dim=0)):
                    out[f"self_attn.{proj}.bias"] = b
            else:
                name = (key.replace("attn.c_proj.", "self_attn.o_proj.").replace("mlp.c_fc.", "mlp.up_proj.")
                        .replace("mlp.c_proj.", "mlp.down_proj.").replace("ln_1.", "input_layernorm.")
                        .replace("ln_2.", "post_attention_layernorm."))
                out[name] = t.t().contiguous() if name.endswith("proj.weight") else t
        return out


class Phi3Layout(Layout):
    """Phi-3 (Llama's names, but one `self_attn.qkv_proj` for q, k and v, and one `mlp.gate_up_proj`)."""

    def llama_layer(self, tensors: dict, text: dict) -> dict:
        heads = int(text["num_attention_heads"])
        kv_heads = int(text.get("num_key_value_heads") or heads)
        head_dim = int(text.get("head_dim") or int(text["hidden_size"]) // heads)
        out = {}
        for key, t in tensors.items():
            if key == "self_attn.qkv_proj.weight":  # [(heads + 2 kv heads) x head_dim, H], q then k then v
                q, k, v = t.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=0)
                out.update({"self_attn.q_proj.weight": q, "self_attn.k_proj.weight": k, "self_attn.v_proj.weight": v})
            elif key == "mlp.gate_up_proj.weight":  # [2 x intermediate, H], gate then up
                gate, up = t.chunk(2, dim=0)
                out.update({"mlp.gate_proj.weight": gate, "mlp.up_proj.weight": up})
            else:
                out[key] = t
        return out


LLAMA = Layout()
# model_type of the text config -> its adapter; a model_type not here has the Llama layout
LAYOUTS: dict[str, Layout] = {
    "phi3": Phi3Layout(name="Phi-3"),
    "gpt2": GPT2Layout(name="GPT-2", root="transformer.", embed="wte", layers="h", norm="ln_f",
                       config_keys={"hidden_size": "n_embd", "num_hidden_layers": "n_layer",
                                    "num_attention_heads": "n_head", "intermediate_size": "n_inner",
                                    "max_position_embeddings": "n_positions", "rms_norm_eps": "layer_norm_epsilon"}),
}


def layout_of(model_type: str | None) -> Layout:
    """The adapter of a family by its text config's model_type (the Llama layout when it has none of its own)."""
    return LAYOUTS.get(model_type or "", LLAMA)


def layout_of_model(model) -> Layout:
    """The adapter of a loaded transformers model (a wrapper's language model loaded alone has its text config)."""
    cfg = getattr(model, "config", None)
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    return layout_of(getattr(text, "model_type", None))


# -------------------------------------------------------------------------------------------------
# The language model's tensors inside a checkpoint


def weight_map(folder: str | os.PathLike) -> dict[str, str]:
    """{tensor name: safetensors file} of a model folder (sharded or not); {} without safetensors."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            return dict(json.loads(index.read_text())["weight_map"])
        except (ValueError, KeyError, TypeError):
            raise DraftsmithError(f"{index}: not a safetensors index (no weight_map)") from None
    where: dict[str, str] = {}
    for p in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(p), framework="pt") as f:
                where.update({k: p.name for k in f.keys()})
        except Exception as e:  # safetensors raises its own error types for a corrupt header
            raise DraftsmithError(f"{p}: not a readable safetensors file ({first_sentence(e)})") from None
    return where


@dataclass(frozen=True)
class LanguageModelNames:
    """Where a target's language model sits in its checkpoint, found from the tensor names, never by the
    shortest suffix (a Kimi-K2.5 checkpoint's shortest `*norm.weight` is its projector's):

        base   the decoder stack's prefix: "model." (Llama), "language_model.model." (Kimi-K2.5, the
               released Llava-style layout), "model.language_model." (transformers 5's own wrappers),
               "transformer." (GPT-2)
        embed  base + "embed_tokens.weight" (the layout's embeddings)
        norm   base + "norm.weight" (None when absent)
        head   the LM head: "lm_head.weight" beside the stack ("language_model.lm_head.weight"), at the top,
               or the embeddings when the target ties them
    """
    base: str
    embed: str
    norm: str | None
    head: str
    files: dict[str, str] = field(repr=False)  # tensor name -> safetensors file, for every tensor of the folder
    layout: Layout = LLAMA

    def layer_prefix(self, n: int) -> str:
        return f"{self.base}{self.layout.layers}.{n}."

    def key_mapping(self) -> dict[str, str]:
        """transformers' `key_mapping` that loads the language model alone as its ForCausalLM class (its
        stack and `lm_head`); {} when the checkpoint already names them so."""
        out = {}
        if self.base != self.layout.root:
            out[self.base[:-1]] = self.layout.root[:-1]
        if self.head not in ("lm_head.weight", self.embed):
            out[self.head[: -len(".weight")]] = "lm_head"
        return out


def _numbered_stack(names) -> str | None:
    """The prefix of the most common numbered module list among tensor names (`transformer.h.N`), to name a
    layout the adapters do not know."""
    stacks = Counter(m.group(1) for k in names if (m := re.match(r"^(.*?[A-Za-z_]+)\.\d+\.", k)))
    return f"{stacks.most_common(1)[0][0]}.N" if stacks else None


def language_model_names(info) -> LanguageModelNames | None:
    """The language model's tensor names in the target's safetensors (None without safetensors files); `info`: a
    load.TargetInfo (its path, layout, num_layers, tie_word_embeddings, architecture). A decoder stack is the
    layout's embeddings with its layers beside them; of several (an MTP or vision stack beside the text
    model's), the one with the target's layer count, then the shortest."""
    folder, layout, architecture = Path(info.path), info.layout, info.architecture
    where = weight_map(folder)
    if not where:
        return None
    embed_key = f"{layout.embed}.weight"
    bases = [k[: -len(embed_key)] for k in where if k.endswith(embed_key) and k[: -len(embed_key)][-1:] in ("", ".")]
    stacks = {b: {k[len(b) + len(layout.layers) + 1:].split(".", 1)[0] for k in where
                  if k.startswith(f"{b}{layout.layers}.")} for b in bases}  # prefix -> its layer ids
    stacks = {b: layers for b, layers in stacks.items() if layers}
    if not stacks:
        found = _numbered_stack(where)
        raise DraftsmithError(f"{folder}: {architecture}: no language model of the {layout.name} layout in its "
                              f"safetensors files (no {layout.describe()}"
                              + (f"; its stack is `{found}.*`" if found else "")
                              + "): a family laid out otherwise needs an adapter in draftsmith/target/layout.py")
    base = min(stacks, key=lambda b: (len(stacks[b]) != info.num_layers, len(b)))
    embed = base + embed_key
    outer = base[: -len(layout.root)] if base.endswith(layout.root) else base
    head = next((k for k in (outer + "lm_head.weight", "lm_head.weight") if k in where), None)
    if head is None:
        if not info.tie_word_embeddings:
            raise DraftsmithError(f"{folder}: {architecture}: no LM head ({outer}lm_head.weight) in its "
                                  "safetensors files, and the config does not tie it to the embeddings")
        head = embed
    norm = f"{base}{layout.norm}.weight"
    return LanguageModelNames(base=base, embed=embed, norm=norm if norm in where else None, head=head, files=where,
                              layout=layout)


def read_tensor(folder: str | os.PathLike, names: LanguageModelNames, key: str):
    """One tensor of the target's checkpoint, in its stored dtype."""
    with safe_open(str(Path(folder) / names.files[key]), framework="pt") as f:
        return f.get_tensor(key)
