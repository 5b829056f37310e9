"""What a vLLM server may take of each GPU: the cap draftsmith passes, torch-free so that `estimate` sizes a served
stage by the same share that vllm_server.gpu_memory_utilization gives the server."""

from __future__ import annotations

# The most of each GPU's total memory a vLLM server draftsmith starts may take (--gpu-memory-utilization; vLLM's
# own default): weights, activations and the KV cache together. vllm_server lowers it to what is free at start.
GPU_MEMORY_CAP = 0.9
