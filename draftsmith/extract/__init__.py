"""The `extract` stage: the store and the hf and vLLM backends; its entry point is `stage.run_extract`."""
