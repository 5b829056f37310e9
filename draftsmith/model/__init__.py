"""What the drafter kinds (draftsmith/kinds/, each a package found by name in its registry) share: their sizing,
the layers and the training-time-test attention; no files, no training.

    config.py   DrafterConfig and the rules that size it for a target family (no torch: estimate uses them)
    eagle3.py   the drafter's layers and the drafter: one drafting call, the unrolled TTT forward
    peagle.py   the P-EAGLE drafter: the EAGLE-3 drafter whose later draft steps read mask slots, all in one pass
    dflash.py   the DFlash drafter: one forward drafts a whole block, reading the target's states in every layer
    mla.py      multi-head latent attention for drafters of MLA targets (DeepSeek-V3, Kimi-K2, Kimi-K2.5)
    parts.py    the pieces the drafters share: RMSNorm, RoPE tables, the draft vocabulary's maps
    ttt.py      the TTT attention masks (dense, block-sparse SDPA, flex attention)
    init.py     starting a drafter from the target's weights

Nothing is imported here, so that `draftsmith.model.config` loads without torch.
"""
