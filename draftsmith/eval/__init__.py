"""The `eval` stage: the engines, their agreement and the report; its entry point is `stage.run_eval`."""
