"""The drafters (EAGLE-3 and EAGLE-3.1, P-EAGLE), their sizing and the training-time-test attention; no files,
no training.

    config.py   DrafterConfig and the rules that size it for a target family (no torch: estimate uses them)
    eagle3.py   the drafter's layers and the drafter: one drafting call, the unrolled TTT forward
    peagle.py   the P-EAGLE drafter: the EAGLE-3 drafter whose later draft steps read mask slots, all in one pass
    drafters.py which class a drafter config builds (EAGLE-3 or P-EAGLE)
    ttt.py      the TTT attention masks (dense, block-sparse SDPA, flex attention)
    init.py     starting a drafter from the target's weights

Nothing is imported here, so that `draftsmith.model.config` loads without torch.
"""
