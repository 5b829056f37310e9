import types
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from torch.nn.attention.flex_attention import create_mask

from draftsmith.model.config import DrafterConfig
from draftsmith.model.dflash import DFlashDrafter
from draftsmith.kinds import drafter_class
from draftsmith.model.eagle3 import DrafterCache, Eagle3Drafter, RMSNorm, rope_cos_sin
from draftsmith.model.init import init_from_target, init_layer_from_target
from draftsmith.model.mla import MLAAttention
from draftsmith.model.ttt import FLEX_BLOCK, FlexShape, FlexTTTMask

H, HEADS, KV_HEADS, V, DV = 32, 4, 2, 100, 40


def make_config(**overrides) -> DrafterConfig:
    kwargs = dict(hidden_size=H, intermediate_size=64, num_attention_heads=HEADS,
                  num_key_value_heads=KV_HEADS, vocab_size=V, draft_vocab_size=DV)
    kwargs.update(overrides)
    return DrafterConfig(**kwargs)


# a small MLA layer (q LoRA, latent, nope + rope heads of unequal value width), as model/mla.py builds it
MLA = dict(attention="mla", num_key_value_heads=HEADS, q_lora_rank=16, kv_lora_rank=24, qk_nope_head_dim=8,
           qk_rope_head_dim=6, v_head_dim=10)


def make_drafter(seed: int = 0, layers: int = 1, attention: str = "gqa") -> Eagle3Drafter:
    torch.manual_seed(seed)
    model = Eagle3Drafter(make_config(num_hidden_layers=layers, **(MLA if attention == "mla" else {})))
    # random norm weights too, so a swapped or skipped norm changes the output
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    draft_ids = torch.randperm(V)[:DV].sort().values
    init_from_target(model, torch.randn(V, H), torch.randn(V, H), torch.rand(H) + 0.5, draft_ids)
    return model.eval()


def make_batch(B: int = 2, L: int = 12, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (B, L), generator=g), torch.randn(B, L, 3 * H, generator=g)


# --- structure ---------------------------------------------------------------

def test_state_dict_names_match_vllm_export():
    expected = {
        "embed_tokens.weight", "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
        *(f"layers.0.self_attn.{p}_proj.weight" for p in "qkvo"),
        *(f"layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
        *(f"layers.0.{n}.weight" for n in ("input_layernorm", "hidden_norm",
                                           "post_attention_layernorm")),
    }
    sd = Eagle3Drafter(make_config()).state_dict()
    assert set(sd) == expected
    assert sd["fc.weight"].shape == (H, 3 * H)
    assert sd["layers.0.self_attn.q_proj.weight"].shape == (HEADS * 8, 2 * H)
    assert sd["layers.0.self_attn.k_proj.weight"].shape == (KV_HEADS * 8, 2 * H)
    assert sd["layers.0.self_attn.o_proj.weight"].shape == (H, HEADS * 8)
    assert sd["lm_head.weight"].shape == (DV, H)
    assert sd["d2t"].dtype == torch.long and sd["d2t"].shape == (DV,)
    assert sd["t2d"].dtype == torch.bool and sd["t2d"].shape == (V,)


def test_later_layers_read_only_the_previous_output():
    # vLLM's llama_eagle3 builds layer n >= 1 with q/k/v over H and uses no hidden_norm there
    sd = Eagle3Drafter(make_config(num_hidden_layers=3)).state_dict()
    assert sd["layers.0.self_attn.q_proj.weight"].shape == (HEADS * 8, 2 * H)
    for n in (1, 2):
        assert sd[f"layers.{n}.self_attn.q_proj.weight"].shape == (HEADS * 8, H)
        assert sd[f"layers.{n}.self_attn.k_proj.weight"].shape == (KV_HEADS * 8, H)
        assert f"layers.{n}.hidden_norm.weight" not in sd and f"layers.{n}.input_layernorm.weight" in sd
    with pytest.raises(ValueError, match="num_hidden_layers"):
        make_config(num_hidden_layers=0)


def test_embeddings_frozen():
    model = Eagle3Drafter(make_config())
    assert not model.embed_tokens.weight.requires_grad
    assert all(p.requires_grad for n, p in model.named_parameters() if n != "embed_tokens.weight")


def test_init_from_target_copies_and_maps_vocab():
    torch.manual_seed(0)
    model = Eagle3Drafter(make_config())
    embed, head, norm = torch.randn(V, H), torch.randn(V, H), torch.randn(H)
    draft_ids = torch.randperm(V)[:DV].sort().values
    init_from_target(model, embed, head, norm, draft_ids)

    assert torch.equal(model.embed_tokens.weight, embed)
    assert not model.embed_tokens.weight.requires_grad
    assert torch.equal(model.lm_head.weight, head[draft_ids])
    assert torch.equal(model.norm.weight, norm)
    assert torch.equal(torch.arange(DV) + model.d2t, draft_ids)
    assert torch.equal(model.draft_ids(), draft_ids)
    assert int(model.t2d.sum()) == DV
    assert torch.equal(model.t2d.nonzero().squeeze(1), draft_ids)

    with pytest.raises(ValueError, match="strictly increasing"):
        init_from_target(model, embed, head, None, draft_ids.flip(0))
    with pytest.raises(ValueError, match="draft_ids must be"):
        init_from_target(model, embed, head, None, draft_ids[:-1])
    with pytest.raises(ValueError, match="embed_weight"):
        init_from_target(model, embed[:-1], head, None, draft_ids)


def test_default_vocab_mapping_is_identity():
    model = Eagle3Drafter(make_config())
    assert torch.equal(model.draft_ids(), torch.arange(DV))
    assert torch.equal(model.t2d.nonzero().squeeze(1), torch.arange(DV))


# --- numerics against references -------------------------------------------

def test_rmsnorm_and_rope_match_transformers():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

    x = torch.randn(2, 5, H)
    ours, ref = RMSNorm(H, 1e-5), LlamaRMSNorm(H, eps=1e-5)
    with torch.no_grad():
        ours.weight.uniform_(0.5, 1.5)
        ref.weight.copy_(ours.weight)
    torch.testing.assert_close(ours(x), ref(x))
    torch.testing.assert_close(ours(x.bfloat16()), ref(x.bfloat16()))

    cfg = LlamaConfig(hidden_size=H, num_attention_heads=HEADS, rope_theta=500000.0)
    pos = torch.tensor([[0, 1, 2, 700, 5000], [3, 0, 1, 2, 9]])
    ref_cos, ref_sin = LlamaRotaryEmbedding(cfg)(x, pos)
    cos, sin = rope_cos_sin(pos, H // HEADS, 500000.0)
    torch.testing.assert_close(cos, ref_cos)
    torch.testing.assert_close(sin, ref_sin)


def test_decoder_layer_follows_vllm_residual_structure():
    # With a single token, attention is just o_proj(v) (softmax over one key;
    # RoPE does not touch v), which isolates the norm/residual wiring of
    # vLLM's llama_eagle3 layer (norm_before_residual=False).
    model = make_drafter()
    layer = model.layers[0]
    ids, aux = make_batch(B=3, L=1)
    logits, prenorm = model(ids, aux, torch.zeros(3, 1, dtype=torch.long))

    hidden = model.fc(aux)
    x = torch.cat([layer.input_layernorm(model.embed_tokens(ids)), layer.hidden_norm(hidden)], -1)
    v = layer.self_attn.v_proj(x).view(3, 1, KV_HEADS, 8).repeat_interleave(HEADS // KV_HEADS, 2)
    x = layer.self_attn.o_proj(v.reshape(3, 1, HEADS * 8)) + hidden
    mlp = layer.mlp
    h = layer.post_attention_layernorm(x)
    x = x + mlp.down_proj(F.silu(mlp.gate_proj(h)) * mlp.up_proj(h))
    torch.testing.assert_close(prenorm, x)
    torch.testing.assert_close(logits, model.lm_head(model.norm(x)))


# --- training-time test == inference -----------------------------------------

@torch.no_grad()
@pytest.mark.parametrize("attention", ["gqa", "mla"])
@pytest.mark.parametrize("layers", [1, 2])
def test_ttt_matches_cached_chain_drafting(layers, attention):
    """The central guarantee: ttt_forward's step-k logits at index i are what
    chain drafting with a KV cache produces after the prefix t_0..t_{i+1}."""
    model = make_drafter(layers=layers, attention=attention)
    B, L, steps = 2, 12, 3
    ids, aux = make_batch(B, L)
    # a non-zero position offset per row, as if the sequence continued a prompt
    pos = torch.arange(L).expand(B, L) + torch.tensor([[0], [5]])
    ttt = model.ttt_forward(ids, aux, steps, position_ids=pos)
    assert len(ttt) == steps and all(t.shape == (B, L, DV) for t in ttt)

    for i in range(L - steps):
        # prefill step 0 over the verified prefix t_0..t_{i+1}: index j reads
        # the target state after t_j and the token t_{j+1}
        cache = DrafterCache()
        logits, prenorm = model(ids[:, 1 : i + 2], aux[:, : i + 1], pos[:, : i + 1], cache)
        torch.testing.assert_close(logits, ttt[0][:, : i + 1], rtol=1e-5, atol=1e-5)

        # a chain of wrongly drafted tokens, then roll back as after a rejection
        h = prenorm[:, -1:]
        for k in range(1, steps):
            _, h = model((ids[:, i + 1 + k : i + 2 + k] + 1) % V, h, pos[:, i : i + 1] + k, cache)
        cache.crop(i + 1)

        # the chain that feeds back its own pre-norm state, one token per step
        h = prenorm[:, -1:]
        for k in range(1, steps):
            logits, h = model(ids[:, i + 1 + k : i + 2 + k], h, pos[:, i : i + 1] + k, cache)
            torch.testing.assert_close(logits[:, 0], ttt[k][:, i], rtol=1e-5, atol=1e-5)
        assert cache.length == i + steps


@torch.no_grad()
@pytest.mark.parametrize("attention", ["gqa", "mla"])
@pytest.mark.parametrize("layers", [1, 2])
def test_cache_prefill_in_chunks_matches_one_shot(layers, attention):
    model = make_drafter(layers=layers, attention=attention)
    ids, aux = make_batch(L=10)
    pos = torch.arange(10).expand(2, 10)
    full, _ = model(ids, aux, pos, DrafterCache())
    cache = DrafterCache()
    first, _ = model(ids[:, :4], aux[:, :4], pos[:, :4], cache)
    second, _ = model(ids[:, 4:], aux[:, 4:], pos[:, 4:], cache)
    torch.testing.assert_close(torch.cat([first, second], 1), full, rtol=1e-5, atol=1e-5)
    no_cache, _ = model(ids, aux, pos)
    torch.testing.assert_close(no_cache, full)
    with pytest.raises(ValueError):
        cache.crop(11)
    cache.crop(0)
    assert cache.length == 0


@torch.no_grad()
@pytest.mark.parametrize("attention", ["gqa", "mla"])
@pytest.mark.parametrize("layers", [1, 2])
def test_packed_documents_match_separate_documents(layers, attention):
    model = make_drafter(layers=layers, attention=attention)
    steps, La, Lb = 3, 7, 6
    ids, aux = make_batch(B=1, L=La + Lb)
    pos = torch.cat([torch.arange(La), torch.arange(Lb)])[None]
    doc = torch.cat([torch.zeros(La), torch.ones(Lb)]).long()[None]
    packed = model.ttt_forward(ids, aux, steps, position_ids=pos, doc_ids=doc)
    alone_a = model.ttt_forward(ids[:, :La], aux[:, :La], steps)
    alone_b = model.ttt_forward(ids[:, La:], aux[:, La:], steps)
    for k in range(steps):
        # document A's chain at index i is self-contained while t_{i+1+k} is in A
        n = La - 1 - k
        torch.testing.assert_close(packed[k][:, :n], alone_a[k][:, :n], rtol=1e-5, atol=1e-5)
        # document B ends the row, so both see the same zero fill past its end
        torch.testing.assert_close(packed[k][:, La:], alone_b[k], rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_ttt_is_causal():
    model = make_drafter()
    steps, L, p = 3, 12, 8
    ids, aux = make_batch(L=L)
    base = model.ttt_forward(ids, aux, steps)

    ids2 = ids.clone()
    ids2[:, p] = (ids2[:, p] + 1) % V
    changed = model.ttt_forward(ids2, aux, steps)
    for k in range(steps):
        # index i reads tokens t_1..t_{i+1+k}: only i >= p-1-k may change
        n = p - 1 - k
        torch.testing.assert_close(changed[k][:, :n], base[k][:, :n])
        assert not torch.allclose(changed[k][:, n], base[k][:, n])

    aux2 = aux.clone()
    aux2[:, p] += 1.0
    changed = model.ttt_forward(ids, aux2, steps)
    for k in range(steps):
        torch.testing.assert_close(changed[k][:, :p], base[k][:, :p])
        assert not torch.allclose(changed[k][:, p], base[k][:, p])


# --- flex attention: the same TTT pattern through a block mask --------------

# rows of 300 tokens (three 128-token tiles, the last one padded): row 0 one document, so whole
# tiles are visible; row 1 packed documents, padding, and a document id that comes back
FLEX_DOCS = torch.tensor([[0] * 300, [0] * 100 + [1] * 150 + [2] * 20 + [0] * 20 + [-1] * 10])


def _dense_ttt_mask(doc: torch.Tensor, k: int) -> torch.Tensor:
    """[B, L, (k+1)L] bool: the TTT pattern of step k, written out (query i sees step-0 keys j <= i
    of its document and key i of each later step)."""
    L = doc.shape[1]
    i = torch.arange(L)
    step0 = (i[None, :] <= i[:, None]) & (doc[:, :, None] == doc[:, None, :])
    return torch.cat([step0] + [torch.eye(L, dtype=torch.bool).expand_as(step0)] * k, dim=-1)


@pytest.mark.parametrize("k", [0, 1, 3])
@pytest.mark.parametrize("rows,row_len,Lp", [(2, 300, 3 * FLEX_BLOCK), (3, 1000, 3 * FLEX_BLOCK),
                                              (3, 1000, 6 * FLEX_BLOCK)])
def test_flex_block_mask_lists_exactly_the_visible_tiles(k, rows, row_len, Lp):
    """The block mask built from the document ids alone: a tile it marks full is all visible, a
    tile it skips holds no visible key, and its mask function is the TTT pattern (padding unseen).
    Rows and length padded to a FlexShape's (a third row; 600 tokens to the 6-tile bucket): the
    padding's query tiles visit no tile."""
    docs = FLEX_DOCS if Lp == 3 * FLEX_BLOCK else torch.cat([FLEX_DOCS, FLEX_DOCS + 3], dim=1)
    B, L = docs.shape
    mask = FlexTTTMask(docs, FlexShape(rows, row_len, 4))
    assert mask.Lp == Lp
    dense = create_mask(mask.mask_mod, rows, None, Lp, (k + 1) * Lp, device="cpu")[:, 0]  # [R, Lp, (k+1)Lp]
    real = torch.cat([torch.arange(L) + s * Lp for s in range(k + 1)])
    assert torch.equal(dense[:B, :L][:, :, real], _dense_ttt_mask(docs, k))
    assert not dense[:B, :L][:, :, [j for j in range((k + 1) * Lp) if j % Lp >= L]].any()
    bm = mask.block_mask(k)
    nq, n = Lp // FLEX_BLOCK, (k + 1) * Lp // FLEX_BLOCK
    tiles = dense.reshape(rows, nq, FLEX_BLOCK, n, FLEX_BLOCK)
    listed = torch.zeros(rows, nq, n, dtype=torch.bool)
    full = torch.zeros_like(listed)
    for b in range(rows):
        for q in range(nq):
            listed[b, q, bm.kv_indices[b, 0, q, :bm.kv_num_blocks[b, 0, q]].long()] = True
            full[b, q, bm.full_kv_indices[b, 0, q, :bm.full_kv_num_blocks[b, 0, q]].long()] = True
    tq = -(-L // FLEX_BLOCK)  # query tiles holding a real token, in the B real rows
    assert torch.equal(full[:B, :tq], tiles.all(-1).all(2)[:B, :tq])
    assert torch.equal((listed | full)[:B, :tq], tiles.any(-1).any(2)[:B, :tq])
    assert not (listed & full).any()
    assert not (listed | full)[B:].any() and not (listed | full)[:, tq:].any()  # padding visits nothing
    assert full[0].any() and not full[1, :, 1:].any()  # one document: whole tiles; packed ones: partly


@torch.no_grad()
def test_flex_attention_forward_equals_the_sdpa_paths():
    """Compiled flex attention (one compile per session, ~20 s on the CPU, forward only: torch has
    no CPU backward for it) gives what the block-sparse SDPA and the dense mask give, GQA included,
    with rows padded to a tile and rows that fill their tiles, and padded to a FlexShape's rows and
    length bucket (3 rows, 4 tiles)."""
    model = make_drafter(layers=2)
    for doc, shape in ((FLEX_DOCS, None), (FLEX_DOCS[:, :256], None), (FLEX_DOCS, FlexShape(3, 1000, 3))):
        B, L = doc.shape
        ids, aux = make_batch(B=B, L=L, seed=3)
        pos = torch.cat([torch.arange(100), torch.arange(150), torch.arange(20), torch.arange(20), torch.zeros(10).long()])[:L]
        pos = torch.stack([torch.arange(L), pos])
        flex = {"attention": "flex", "flex_shape": shape}
        outs = {name: model.ttt_forward(ids, aux, 3, position_ids=pos, doc_ids=doc, **kw)
                for name, kw in (("flex", flex), ("sdpa", {}), ("dense", {"attn_block": None}))}
        for k in range(3):
            torch.testing.assert_close(outs["flex"][k], outs["sdpa"][k], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(outs["flex"][k], outs["dense"][k], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="attention must be one of"):
        model.ttt_forward(ids, aux, 1, attention="xformers")


# --- training plumbing -------------------------------------------------------

def test_gradients_reach_trainable_weights_only():
    model = make_drafter().train()
    ids, aux = make_batch()
    loss = sum(logits.float().logsumexp(-1).mean() for logits in model.ttt_forward(ids, aux, 3))
    loss.backward()
    assert model.embed_tokens.weight.grad is None
    for name, p in model.named_parameters():
        if name != "embed_tokens.weight":
            assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_bf16_autocast_on_cpu():
    model = make_drafter()
    ids, aux = make_batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ttt = model.ttt_forward(ids, aux, 2)
        logits, prenorm = model(ids, aux, torch.arange(12).expand(2, 12), DrafterCache())
    for t in (*ttt, logits, prenorm):
        assert torch.isfinite(t.float()).all()
    assert ttt[0].dtype == torch.bfloat16

    # weights cast to bf16 outright (no autocast) must also run
    model = model.to(torch.bfloat16)
    out = model.ttt_forward(ids, aux.bfloat16(), 2)
    assert out[0].dtype == torch.bfloat16 and torch.isfinite(out[0].float()).all()


# --- config ------------------------------------------------------------------

def test_config_defaults_and_validation():
    cfg = make_config()
    assert cfg.head_dim == H // HEADS and cfg.num_aux_layers == 3 and cfg.rms_norm_eps == 1e-5
    assert make_config(head_dim=16).head_dim == 16

    bad = [
        (dict(hidden_size=30), "not divisible"),
        (dict(num_key_value_heads=3), "multiple of num_key_value_heads"),
        (dict(draft_vocab_size=V + 1), "draft_vocab_size"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(head_dim=7), "head_dim"),
        (dict(num_aux_layers=1), "num_aux_layers"),
        (dict(vocab_size=0), "vocab_size"),
        (dict(rms_norm_eps=0.0), "rms_norm_eps"),
    ]
    for overrides, message in bad:
        with pytest.raises(ValueError, match=message):
            make_config(**overrides)


def test_from_target_config_reads_llama_config():
    from transformers import LlamaConfig

    target = LlamaConfig(hidden_size=H, intermediate_size=96, num_attention_heads=HEADS,
                         num_key_value_heads=KV_HEADS, vocab_size=V, rope_theta=500000.0,
                         rms_norm_eps=1e-6, max_position_embeddings=4096)
    cfg = DrafterConfig.from_target_config(target, draft_vocab_size=DV)
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.head_dim) == (H, 96, HEADS, KV_HEADS, H // HEADS)
    assert (cfg.vocab_size, cfg.draft_vocab_size) == (V, DV)
    assert cfg.rope_theta == 500000.0 and cfg.rms_norm_eps == 1e-6
    assert cfg.max_position_embeddings == 4096

    # transformers 4 style: rope_theta as a plain attribute, no kv heads given
    old = types.SimpleNamespace(hidden_size=H, intermediate_size=96, num_attention_heads=HEADS,
                                vocab_size=V, rope_theta=1234.0, rms_norm_eps=1e-5)
    cfg = DrafterConfig.from_target_config(old, draft_vocab_size=DV)
    assert cfg.rope_theta == 1234.0 and cfg.num_key_value_heads == HEADS

    with pytest.raises(ValueError, match="draft_vocab_size"):
        DrafterConfig.from_target_config(target, draft_vocab_size=V + 1)


# --- initialising from a target layer ---------------------------------------

def _llama_layer_tensors(cfg: DrafterConfig, seed: int = 3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    hd, I = cfg.head_dim, cfg.intermediate_size
    shapes = {"self_attn.q_proj.weight": (HEADS * hd, H), "self_attn.k_proj.weight": (KV_HEADS * hd, H),
              "self_attn.v_proj.weight": (KV_HEADS * hd, H), "self_attn.o_proj.weight": (H, HEADS * hd),
              "mlp.gate_proj.weight": (I, H), "mlp.up_proj.weight": (I, H), "mlp.down_proj.weight": (H, I),
              "input_layernorm.weight": (H,), "post_attention_layernorm.weight": (H,)}
    return {k: (torch.rand(s, generator=g) + 0.5 if len(s) == 1 else torch.randn(s, generator=g) * 0.2)
            for k, s in shapes.items()}


@torch.no_grad()
@pytest.mark.parametrize("layers", [1, 2])
def test_init_layer_from_target_is_the_target_layer_on_the_passed_aux_state(layers):
    # With the embedding half of q/k/v zeroed, the drafter's step 0 on aux state 2 is exactly
    # transformers' Llama decoder layers on that state: fc passes it through, the layers are copies.
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    cfg = make_config(rope_theta=10000.0)
    model = make_drafter(layers=layers)
    tensors = [_llama_layer_tensors(cfg, seed=3 + n) for n in range(layers)]
    init_layer_from_target(model, tensors if layers > 1 else tensors[0], aux_index=-1)
    for proj in ("q_proj", "k_proj", "v_proj"):
        getattr(model.layers[0].self_attn, proj).weight[:, :H] = 0

    hf_cfg = LlamaConfig(hidden_size=H, intermediate_size=cfg.intermediate_size, num_attention_heads=HEADS,
                         num_key_value_heads=KV_HEADS, rope_theta=10000.0, rms_norm_eps=cfg.rms_norm_eps)
    hf_cfg._attn_implementation = "eager"
    ids, aux = make_batch(B=2, L=7)
    L = ids.shape[1]
    pos = torch.arange(L).expand(2, L)
    causal = torch.full((L, L), float("-inf")).triu(1)[None, None]
    out = aux[..., 2 * H:]
    for n in range(layers):
        ref = LlamaDecoderLayer(hf_cfg, layer_idx=n)
        ref.load_state_dict(tensors[n])
        out = ref(out, attention_mask=causal, position_ids=pos,
                  position_embeddings=LlamaRotaryEmbedding(hf_cfg)(aux, pos))
        out = out[0] if isinstance(out, tuple) else out
    _, prenorm = model(ids, aux, pos)
    torch.testing.assert_close(prenorm, out, rtol=1e-4, atol=1e-5)


@torch.no_grad()
def test_init_layer_from_target_undoes_an_input_scale_and_refuses_foreign_layers():
    cfg = make_config()
    model = make_drafter()
    tensors = _llama_layer_tensors(cfg)
    scale = torch.rand(3 * H) + 0.5
    init_layer_from_target(model, tensors, aux_index=0, input_scale=scale)
    aux = torch.randn(5, 3 * H)
    torch.testing.assert_close(model.fc(aux * scale), aux[:, :H])

    with pytest.raises(ValueError, match="cannot hold.*q_proj.bias"):
        init_layer_from_target(model, {**tensors, "self_attn.q_proj.bias": torch.zeros(H)}, aux_index=-1)
    with pytest.raises(ValueError, match="no mlp.up_proj.weight"):
        init_layer_from_target(model, {k: v for k, v in tensors.items() if k != "mlp.up_proj.weight"}, aux_index=-1)
    with pytest.raises(ValueError, match="got 1 target layers for a drafter of 2"):
        init_layer_from_target(make_drafter(layers=2), tensors, aux_index=-1)
    with pytest.raises(ValueError, match=r"o_proj.weight must be \[32, 32\]"):
        init_layer_from_target(model, {**tensors, "self_attn.o_proj.weight": torch.zeros(H, 2 * H)}, aux_index=-1)


@torch.no_grad()
def test_mla_attention_matches_transformers_deepseek_v3():
    """model/mla.py computes DeepSeek-V3's attention (transformers' DeepseekV3Attention, interleaved RoPE): the
    same weights give the same output, so the exported layer is the function vLLM's MLA computes."""
    import transformers as tf


    c = make_config(**MLA)
    hf_cfg = tf.DeepseekV3Config(hidden_size=H, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                                 q_lora_rank=c.q_lora_rank, kv_lora_rank=c.kv_lora_rank,
                                 qk_nope_head_dim=c.qk_nope_head_dim, qk_rope_head_dim=c.qk_rope_head_dim,
                                 v_head_dim=c.v_head_dim, rms_norm_eps=c.rms_norm_eps, rope_interleave=True,
                                 rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta})
    hf_cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    theirs = tf.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3Attention(hf_cfg, layer_idx=0).eval()
    for p in theirs.parameters():
        p.normal_(0, 0.3)
    mine = MLAAttention(c, in_dim=H)
    missing, unexpected = mine.load_state_dict(theirs.state_dict(), strict=False)
    assert not missing and not unexpected  # vLLM's names, one to one
    B, T = 2, 9
    x = torch.randn(B, T, H)
    pos = torch.arange(T).expand(B, T) + torch.tensor([[0], [7]])
    rope = tf.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3RotaryEmbedding(hf_cfg)
    causal = torch.ones(T, T, dtype=torch.bool).tril()[None, None]
    want, _ = theirs(x, position_embeddings=rope(x, pos), attention_mask=torch.where(causal, 0.0, float("-inf")))
    cos, sin = rope_cos_sin(pos, c.rope_dim, c.rope_theta)
    got, (k, v) = mine(x, cos, sin, causal)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert k.shape == (B, HEADS, T, 14) and v.shape == (B, HEADS, T, 10)


def test_from_target_config_picks_mla_for_mla_targets():
    import transformers as tf

    ds = tf.DeepseekV3Config(hidden_size=7168, num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512,
                             qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, vocab_size=163840,
                             intermediate_size=18432, moe_intermediate_size=2048)
    c = DrafterConfig.from_target_config(ds, draft_vocab_size=32000)
    assert (c.attention, c.num_attention_heads, c.q_lora_rank, c.kv_lora_rank, c.rope_dim, c.v_head_dim) == (
        "mla", 128, 1536, 512, 64, 128)
    assert c.intermediate_size == 18432
    gqa = DrafterConfig.from_target_config(ds, draft_vocab_size=32000, attention="gqa")
    assert (gqa.attention, gqa.head_dim, gqa.num_attention_heads) == ("gqa", 128, 56)
    llama = tf.LlamaConfig(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, vocab_size=128256)
    assert DrafterConfig.from_target_config(llama, draft_vocab_size=32000).attention == "gqa"
    mla = DrafterConfig.from_target_config(llama, draft_vocab_size=32000, attention="mla")
    assert (mla.kv_lora_rank + mla.qk_rope_head_dim, mla.qk_nope_head_dim, mla.q_lora_rank) == (576, 128, None)
    with pytest.raises(ValueError, match="attention must be one of"):
        make_config(attention="mha")


@pytest.mark.parametrize("kind", ["eagle3", "peagle"])
@pytest.mark.parametrize("norms", [{}, {"norm_before_fc": True, "norm_output": True}, {"fc_norm": True}],
                         ids=["plain", "norm_before_fc+norm_output", "fc_norm"])
def test_ttt_forward_equals_drafting_as_served_for_each_kind_and_eagle31_norms(kind, norms):
    """Training's unrolled forward computes the drafts serving computes: EAGLE-3 (with EAGLE-3.1's norms) chain
    drafting step by step from a cache, P-EAGLE's drafts 1..K-1 in one forward over mask slots after the
    forward over the accepted tokens (as vLLM's parallel drafting runs them)."""

    torch.manual_seed(0)
    cfg = DrafterConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                       vocab_size=50, draft_vocab_size=50, mask_token_id=7 if kind == "peagle" else None, kind=kind,
                       **norms)
    d = drafter_class(cfg)(cfg).eval()
    assert type(d).__name__ == ("PEagleDrafter" if kind == "peagle" else "Eagle3Drafter")
    L, K, i = 12, 4, 6  # drafting after the prefix t_0..t_{i+1}
    ids, aux = torch.randint(0, 50, (1, L)), torch.randn(1, L, 96)
    with torch.no_grad():
        out = d.ttt_forward(ids, aux, K, attn_block=None)
        cache = DrafterCache()
        logits, h = d(ids[:, 1:i + 2], aux[:, :i + 1], torch.arange(i + 1)[None], cache)
        got = [logits[0, -1]]
        if kind == "peagle":
            got += list(d.mask_slots(K - 1, i + 1, cache)[0])
        else:
            last = h[:, -1:]
            for k in range(1, K):
                lg, last = d(ids[:, i + 1 + k:i + 2 + k], last, torch.tensor([[i + k]]), cache)
                got.append(lg[0, -1])
    for k in range(K):
        torch.testing.assert_close(out[k][0, i], got[k], atol=1e-5, rtol=1e-5)
    if norms:  # the norms change the function (they are not identity at their initial ones)
        plain = drafter_class(replace(cfg, norm_before_fc=False, fc_norm=False, norm_output=False))(
            replace(cfg, norm_before_fc=False, fc_norm=False, norm_output=False))
        plain.load_state_dict(d.state_dict(), strict=False)
        with torch.no_grad():
            assert not torch.allclose(plain.ttt_forward(ids, aux, K, attn_block=None)[1], out[1])


def test_dflash_block_forward_equals_drafting_as_served():
    """DFlash's training forward (many anchors per row, documents packed) computes what serving computes: one
    block after the context keys of the verified positions before its anchor (vLLM's DFlash proposer)."""

    torch.manual_seed(0)
    cfg = DrafterConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                       vocab_size=50, draft_vocab_size=50, mask_token_id=7, block_size=4, num_hidden_layers=2,
                       kind="dflash")
    d = DFlashDrafter(cfg).eval()
    L = 14
    ids, aux = torch.randint(0, 50, (1, L)), torch.randn(1, L, 96)
    doc = torch.tensor([[0] * 6 + [1] * 8])
    pos = torch.cat([torch.arange(6), torch.arange(8)])[None]
    anchors = torch.tensor([[3, 5, 6, 9, 10]])  # 6: a document's first token, no context
    with torch.no_grad():
        logits = d.lm_head(d.norm(d.block_forward(ids, aux, anchors, pos, doc)))  # [1, M, S, Dv]
        for m, a in enumerate(anchors[0].tolist()):
            start = 0 if a < 6 else 6
            cache = DrafterCache()
            if a > start:
                d.add_context(aux[:, start:a], pos[:, start:a], cache)
            torch.testing.assert_close(logits[0, m, 1:], d.draft(ids[:, a:a + 1], int(pos[0, a]), cache)[0],
                                       atol=1e-5, rtol=1e-5)
        # the block sees itself both ways: slot 1 of a 4-token block differs from slot 1 of a 2-token one (causal
        # attention would give the same); the same weights in a drafter of block size 2
        short = DFlashDrafter(replace(cfg, block_size=2)).eval()
        short.load_state_dict(d.state_dict())
        s4, s2 = d.block_forward(ids, aux, anchors, pos, doc), short.block_forward(ids, aux, anchors, pos, doc)
        assert torch.equal(s4[0, :, 0], s2[0, :, 0]) is False and not torch.allclose(s4[0, :, 1], s2[0, :, 1])
        moved = aux.clone()
        moved[0, 4] += 1.0  # context of anchors 5 (position 4 < 5), not of anchor 3
        after, before = d.block_forward(ids, moved, anchors, pos, doc), d.block_forward(ids, aux, anchors, pos, doc)
        assert not torch.equal(after[0, 1], before[0, 1]) and torch.equal(after[0, 0], before[0, 0])
