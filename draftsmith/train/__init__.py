"""The `train` stage: data, objective, validation, checkpoints, ranks; its entry point is `stage.run_train`."""
