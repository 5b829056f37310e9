"""P-EAGLE (parallel EAGLE, arXiv:2602.01469): the EAGLE-3 drafter that proposes all K draft tokens in one
forward instead of K sequential passes.

vLLM 0.32 serves it with its EAGLE-3 model (`parallel_drafting`): after the target verifies, one forward reads
the accepted tokens as EAGLE-3 does, then the bonus token (the target's own next token) with the state of the
last accepted one, then K-1 mask slots, each the embedding of `mask_token_id` beside fc(mask_hidden), at the
next K-1 positions, causal throughout. The bonus slot's and the mask slots' outputs are the K drafts.

So draft k (k >= 1) of a position sees what EAGLE-3's TTT step k sees: the verified prefix and its own earlier
slots, at position + k. Training is TTT with other step inputs (`step_inputs`): step 0 as EAGLE-3, every later
step the mask slot's fixed inputs instead of the token and the state the step before handed on. The masks,
positions and loss are TTT's (model/ttt.py, train/objective.py); step k is draft k.

mask_hidden [num_aux*H] is the learned stand-in for the target's concatenated states (it goes through fc, and
the EAGLE-3.1 norms before it, as vLLM's combine_hidden_states takes it). The mask token's embedding row stays
the target's (frozen; the export ships no embeddings): any id serves, because the slot is told apart by its
state, and a learned embedding would add nothing the projections of mask_hidden cannot already express.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from draftsmith.model.config import DrafterConfig
from draftsmith.model.eagle3 import Eagle3Drafter


class PEagleDrafter(Eagle3Drafter):
    def __init__(self, config: DrafterConfig) -> None:
        if config.mask_token_id is None:
            raise ValueError("a P-EAGLE drafter needs mask_token_id")
        super().__init__(config)
        # std 1, as the target's residual stream is of that order once normed; the peers start it the same way
        self.mask_hidden = nn.Parameter(torch.randn(config.num_aux_layers * config.hidden_size))

    def mask_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(embedding [H], state [H]) of a mask slot: the mask token's row and fc of mask_hidden."""
        emb = self.embed_tokens.weight[self.config.mask_token_id]
        return emb, self.fuse(self.mask_hidden)

    def step_inputs(self, k: int, ids: torch.Tensor, carried: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if k == 0:
            return super().step_inputs(k, ids, carried)
        emb, state = self.mask_inputs()
        B, L = ids.shape
        return emb.expand(B, L, -1), state.to(carried.dtype).expand(B, L, -1)

    def mask_slots(self, n: int, position: int, cache) -> torch.Tensor:
        """Logits [B, n, Dv] of n mask slots at positions position .. position+n-1, after everything `cache`
        holds (B rows): drafts 1..n once the forward over the accepted tokens has given draft 0, as vLLM's one
        parallel forward computes them (causal attention, so the same numbers). Their keys/values join the
        cache; a caller crops them before the next real tokens are read there."""
        B = 1 if cache.length == 0 else cache.layers[0][0].shape[0]
        device = self.mask_hidden.device
        state = self.fuse(self.mask_hidden).expand(B, n, self.config.hidden_size)
        ids = torch.full((B, n), self.config.mask_token_id, dtype=torch.long, device=device)
        pos = torch.arange(position, position + n, device=device).expand(B, n)
        logits, _ = self.forward(ids, state, pos, cache)
        return logits
