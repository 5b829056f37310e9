"""The names in a training checkpoint folder (docs/run-directory.md, train/): what `train` writes
(train/checkpoint.py) and `export` reads.

A module of its own, without torch, rather than in train/checkpoint.py: that module is train's
checkpoint machinery (torch, torch.distributed's state dicts, the ranks), none of which export needs
to name a checkpoint's files; so the names two stages share belong to neither of them.
"""

# the files of a checkpoint folder; a folder is complete once it has state.json, written last
CKPT_WEIGHTS, CKPT_META, CKPT_OPTIM, CKPT_RNG, CKPT_STATE = (
    "model.safetensors", "drafter.json", "optimizer.pt", "rng.safetensors", "state.json")

# train/'s checkpoint folders besides checkpoints/step_N: the drafter training ends with, and the one whose
# validation pass measured the highest acceptance length so far (export.checkpoint: final | best)
FINAL_DIR, BEST_DIR = "final", "best"

# With train.fc_input_norm, the [3H] factor the aux states are multiplied by before fc, saved in
# model.safetensors beside the drafter's weights; export folds it into fc.weight.
FC_INPUT_SCALE = "fc_input_scale"
