"""The names in a training checkpoint folder (docs/run-directory.md, train/): what `train` writes
(train/checkpoint.py) and `export` reads.

A module of its own, without torch, rather than in train/checkpoint.py: importing anything under
draftsmith.train runs the train package's __init__, which imports the whole stage (its data
sources, extract, the target's loading), none of which export needs to read a checkpoint.
"""

# the files of a checkpoint folder; a folder is complete once it has state.json, written last
CKPT_WEIGHTS, CKPT_META, CKPT_OPTIM, CKPT_RNG, CKPT_STATE = (
    "model.safetensors", "drafter.json", "optimizer.pt", "rng.safetensors", "state.json")

# With train.fc_input_norm, the [3H] factor the aux states are multiplied by before fc, saved in
# model.safetensors beside the drafter's weights; export folds it into fc.weight.
FC_INPUT_SCALE = "fc_input_scale"
