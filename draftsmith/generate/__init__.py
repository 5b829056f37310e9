"""The `generate` stage: its files, the reasoning split, the backends; its entry point is `stage.run_generate`."""
