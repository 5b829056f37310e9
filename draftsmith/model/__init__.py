"""The EAGLE-3 drafter, its sizing and its training-time-test attention; no files, no training.

    config.py   Eagle3Config and the rules that size it for a target family (no torch: estimate uses them)
    eagle3.py   the drafter's layers and the drafter: one drafting call, the unrolled TTT forward
    ttt.py      the TTT attention masks (dense, block-sparse SDPA, flex attention)
    init.py     starting a drafter from the target's weights

Nothing is imported here, so that `draftsmith.model.config` loads without torch.
"""
