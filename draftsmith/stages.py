"""The stages, each described once: what runs it, what it reads and writes, how `status` counts it,
where `estimate` costs it, its command (help, options, the line it prints when done), and whether `run`
runs it with a given config.

`run` (pipeline.py), `status`, `estimate`, the CLI (cli.py), the demo's cost model (demo.py), the
run directory (rundir.py: what makes a folder a run) and the model card read the stages from here,
in the order of STAGES, which is the order `run` runs them. A new stage is one record here and its
module (docs/architecture.md, "Where new code goes").

No torch, no pydantic, no stage code: `status` and `--help` import this module, so the run
function, the cost and the command's summary are named "module:function" and imported only when called.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from draftsmith import DraftsmithError


@dataclass(frozen=True)
class Count:
    """How `status` counts what a stage has on disk (status.COUNTERS holds how each `kind` is counted):

    - "lines": complete lines of the file `path` in the stage folder;
    - "files": files of the stage folder whose name ends with `path`;
    - "shard_files": files whose name ends with `path` in the stage folder's `rows_*` shard folders;
    - "checkpoint_step": the step of the newest complete checkpoint under `path` (a `step_N` folder
      holding state.json).

    `same_unit`: the count is of the units the stage's journal counts (samples, prompts), so that
    `status` notes when the two disagree."""

    kind: str
    path: str = ""
    same_unit: bool = False


@dataclass(frozen=True)
class Option:
    """One option of a stage's command (`draftsmith <stage> --help` lists them in the record's order). Besides
    RUN, CONFIG and SETS, which every stage command takes, an option either sets a config key (`key`) or is
    passed to the run function (`arg`)."""

    flags: tuple[str, ...]  # ("--max-length",) or ("--num-speculative-tokens", "-k"); the first one names it
    type: type  # of its value: str, int, float, Path; bool: a flag, off unless given
    help: str
    key: str = ""  # the config key it sets ("prepare.max_length"), as `--set key=value` would, winning over --set
    arg: str = ""  # the keyword argument of the run function it is passed as (its default when not given)
    multiple: bool = False  # repeatable: its value is the list of the values given
    json: bool = False  # its value set as JSON text: a list, or a string YAML would otherwise read as a number
    required: bool = False

    @property
    def name(self) -> str:
        """Its parameter's name: `--max-length` -> max_length."""
        return self.flags[0].lstrip("-").replace("-", "_")

    def override(self, value: Any) -> Any:
        """What `--set <key>=` takes for the value given; None when the option was not given (nothing set)."""
        if value is None or (self.multiple and not value):
            return None
        return json.dumps(value) if self.json else value


# The options every stage command takes. --run is a string, not a Path: typer turns --run '' into Path('.'),
# the current folder, which RunDir must refuse.
RUN = Option(("--run",), str, "The run directory (created if missing).", required=True)
CONFIG = Option(("--config",), Path, "YAML config file.")
SETS = Option(("--set",), str, "Override a config key: --set train.lr=3e-4 (repeatable).", multiple=True)
COMMON = (RUN, CONFIG, SETS)


def always(cfg: Any) -> bool:
    return True


def never(cfg: Any) -> bool:
    return False


def offline_training(cfg: Any) -> bool:
    """Extract stores the states training reads; online training computes them itself."""
    return cfg.train.mode != "online"


def local_generation(cfg: Any) -> bool:
    """Only the local backend decodes with torch in this process; the others wait on servers."""
    return cfg.generate.backend == "local"


@dataclass(frozen=True)
class Stage:
    """One stage of a run. Paths are relative to the run folder."""

    name: str  # its folder RUN/<name>/, its command `draftsmith <name>`, its name in pipeline.json and status
    run: str  # "module:function" of `run_<stage>(run, cfg, ...)`, imported when it runs (run_function)
    section: str  # its config section: `cfg.<section>` (config.py), what its manifest's settings hold
    inputs: tuple[str, ...]  # what it reads of other stages (their manifests first: stage.upstream)
    outputs: tuple[str, ...]  # what it writes (a trailing / is a folder); docs/run-directory.md says their format
    count: Count  # how `status` counts its files
    estimate: str  # "module:function" of its cost: (estimate.CostContext) -> estimate.StageCost, its row and rates
    help: str  # its command's help (`draftsmith <name> --help`, the first line in `draftsmith --help`)
    examples: tuple[str, ...]  # command lines of its --help epilog
    demo_group: str  # the demo's cost-model group that times it (demo.expected_seconds' keys)
    runs: Callable[[Any], bool] = always  # whether `run` runs it under a config (False: not planned at all)
    # its command's options, in the order --help lists them: COMMON's three and its own
    options: tuple[Option, ...] = COMMON
    # whether its command sets torch's threads by the thread policy (host.thread_policy) before running it under a
    # config: the stages that compute with torch in the command's process
    threads: Callable[[Any], bool] = never
    # "module:function" called with (run, manifest) after its command ran it, on rank 0: the line the command
    # prints (None: nothing); in the stage's own module. "": the command prints nothing more
    summary: str = ""

    def __post_init__(self) -> None:
        if not set(COMMON) <= set(self.options):
            raise ValueError(f"stage {self.name}: its options must include RUN, CONFIG and SETS")
        for o in self.options:
            if o not in COMMON and bool(o.key) == bool(o.arg):
                raise ValueError(f"stage {self.name}: option {o.flags[0]} needs a `key` or an `arg`, not both")

    @property
    def module(self) -> str:
        """The module of its run function (what running it imports)."""
        return self.run.partition(":")[0]

    def run_function(self) -> Callable[..., Any]:
        """The stage's `run_<stage>`, imported now (torch and the stage's libraries with it)."""
        return load(self.run)

    @property
    def epilog(self) -> str:
        return "Examples:\n\n" + "".join(f"  {line}\n\n" for line in self.examples).rstrip("\n") + "\n"


def load(ref: str) -> Callable[..., Any]:
    """The function a "module:function" reference names."""
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


REGISTRY: dict[str, Stage] = {s.name: s for s in (
    Stage(
        name="generate", run="draftsmith.generate.stage:run_generate", section="generate",
        inputs=(), outputs=("generate/samples.jsonl", "generate/failures.jsonl"),
        count=Count("lines", "samples.jsonl", same_unit=True), estimate="draftsmith.estimate:cost_generate",
        help="Regenerate the assistant turns of a prompt set with the target (in-process or via OpenAI-compatible "
        "servers), or keep the file's own (--backend dataset).",
        examples=(
            "draftsmith generate --run runs/r1 --limit 100",
            "draftsmith generate --run runs/r1 --backend openai --server http://127.0.0.1:8000/v1 --concurrency 32",
            "draftsmith generate --run runs/r1 --backend openai --server http://gpu1:8000 --server http://gpu2:8000 "
            "--prompts chats.jsonl --max-tokens 1024",
            "draftsmith generate --run runs/r1 --retry-failed",
            "draftsmith generate --run runs/r1 --set generate.backend=openai "
            "--set generate.servers=[http://127.0.0.1:8000/v1] --set generate.api_key_env=MY_KEY",
            "draftsmith generate --run runs/r1 --backend vllm --concurrency 64   "
            "(starts and stops its own vLLM server)",
        ),
        demo_group="generate",
        options=(
            *COMMON,
            Option(("--backend",), str, "local (in-process, the default), openai (served model at --server), vllm "
                   "(a vLLM server generate starts itself) or dataset (the prompt file's own replies, no decoding).",
                   key="generate.backend"),
            Option(("--server",), str, "Base URL of an OpenAI-compatible server (repeatable).",
                   key="generate.servers", multiple=True, json=True),
            Option(("--prompts",), str, "Prompt file, or sharegpt / mt-bench / humaneval.", key="generate.prompts",
                   json=True),
            Option(("--limit",), int, "How many prompts.", key="generate.limit"),
            Option(("--max-tokens",), int, "Maximum new tokens per answer.", key="generate.max_tokens"),
            Option(("--temperature",), float, "Sampling temperature (0 = greedy).", key="generate.temperature"),
            Option(("--concurrency",), int, "Requests in flight (backends openai, vllm).", key="generate.concurrency"),
            Option(("--retry-failed",), bool, "Retry the samples in generate/failures.jsonl.", arg="retry_failed"),
        ),
        threads=local_generation),
    Stage(
        name="prepare", run="draftsmith.prepare:run_prepare", section="prepare",
        inputs=("generate/samples.jsonl",), outputs=("prepare/samples.jsonl",),
        count=Count("lines", "samples.jsonl", same_unit=True), estimate="draftsmith.estimate:cost_prepare",
        help="Tokenize the generated conversations with the target's chat template; loss mask on assistant tokens.",
        examples=(
            "draftsmith prepare --run runs/r1",
            "draftsmith prepare --run runs/r1 --max-length 4096 --overflow drop",
            "draftsmith prepare --run runs/r1 --config my.yaml --set prepare.max_length=1024",
        ),
        demo_group="extract",
        options=(
            *COMMON,
            Option(("--max-length",), int, "Maximum tokens per sample (prepare.max_length).", key="prepare.max_length"),
            Option(("--overflow",), str, "Longer samples: `truncate` or `drop` (prepare.overflow).",
                   key="prepare.overflow"),
        )),
    Stage(
        name="vocab", run="draftsmith.vocab:run_vocab", section="vocab",
        inputs=("prepare/samples.jsonl",), outputs=("vocab/vocab.safetensors", "vocab/vocab.json"),
        count=Count("files", ".safetensors"), estimate="draftsmith.estimate:cost_vocab",
        help="Pick the draft vocabulary (d2t, t2d) from token frequencies under the loss mask; print its coverage.",
        examples=(
            "draftsmith vocab --run runs/r1",
            "draftsmith vocab --run runs/r1 --draft-vocab-size 32000",
        ),
        demo_group="extract",
        options=(
            *COMMON,
            Option(("--draft-vocab-size",), int, "Tokens in the draft vocabulary (vocab.draft_vocab_size).",
                   key="vocab.draft_vocab_size"),
        )),
    Stage(
        name="extract", run="draftsmith.extract.stage:run_extract", section="extract",
        inputs=("prepare/samples.jsonl",), outputs=("extract/meta.json", "extract/rows_*/"),
        count=Count("shard_files", ".safetensors", same_unit=True), estimate="draftsmith.estimate:cost_extract",
        help="Run the target over the prepared samples; store aux-layer and final hidden states per sample.",
        examples=(
            "draftsmith extract --run runs/r1",
            "draftsmith extract --run runs/r1 --set extract.layers='[2, 15, 27]' --set extract.batch_tokens=16384",
            "draftsmith extract --run runs/r1 --verify",
            "draftsmith extract --run runs/r1 --set extract.backend=vllm",
            "draftsmith extract --run runs/r1 --set extract.backend=vllm "
            "--set extract.servers='[http://gpu-node:8000/v1]'",
            "draftsmith extract --run runs/r1 --rank 1 --world-size 2",
            "torchrun --nproc-per-node 8 -m draftsmith extract --run runs/r1",
        ),
        demo_group="extract", runs=offline_training,
        options=(
            *COMMON,
            Option(("--verify",), bool, "Open every finished file (and check shard.json checksums); redo corrupt or "
                   "truncated ones.", arg="verify"),
            Option(("--force",), bool, "Go on even when the free disk space looks too small.", arg="force"),
            Option(("--rank",), int, "This process's rank (shard i goes to rank i % world-size); default $RANK or 0.",
                   arg="rank"),
            Option(("--world-size",), int, "Number of extract processes; default $WORLD_SIZE or 1.", arg="world_size"),
        ),
        threads=always, summary="draftsmith.extract.stage:summary"),
    Stage(
        name="train", run="draftsmith.train.stage:run_train", section="train",
        inputs=("vocab/vocab.safetensors", "extract/", "prepare/samples.jsonl"),
        outputs=("train/final/", "train/checkpoints/", "train/metrics.jsonl"),
        count=Count("checkpoint_step", "checkpoints"), estimate="draftsmith.estimate:cost_train",
        help="Train the drafter (train.method: one of the kinds, `draftsmith --help` lists them); checkpoints resume "
        "exactly.",
        examples=(
            "draftsmith train --run runs/r1",
            "draftsmith train --run runs/r1 --mode online --max-steps 200",
            "draftsmith train --run runs/r1 --mode online --set extract.backend=vllm   "
            "(states streamed from a vLLM server)",
            "draftsmith train --run runs/r1 --set train.lr=3e-4 --set train.ttt_steps=5",
            "torchrun --nproc-per-node 2 -m draftsmith -- train --run runs/r1",
            "(the `--` stops torchrun from reading `--run` as an abbreviation of its own `--run-path`)",
        ),
        demo_group="train",
        options=(
            *COMMON,
            Option(("--mode",), str, "`offline` (from extract/) or `online` (target in-process, or vLLM with "
                   "extract.backend=vllm) (train.mode).", key="train.mode"),
            Option(("--max-steps",), int, "Stop after this many optimizer steps (train.max_steps).",
                   key="train.max_steps"),
        ),
        threads=always, summary="draftsmith.train.stage:summary"),
    Stage(
        name="export", run="draftsmith.export:run_export", section="export",
        inputs=("train/final/", "train/checkpoints/"),
        outputs=("export/config.json", "export/model.safetensors", "export/README.md", "export/provenance.json"),
        count=Count("files", ".safetensors"), estimate="draftsmith.estimate:cost_export",
        help="Write the drafter in speculators format (config.json + model.safetensors) to RUN/export/, loadable "
        "by vLLM as is.",
        examples=(
            "draftsmith export --run runs/r1",
            "draftsmith export --run runs/r1 --checkpoint runs/r1/train/checkpoints/step_400",
            "vllm serve TARGET --speculative-config "
            "'{\"model\": \"runs/r1/export\", \"method\": \"eagle3\", \"num_speculative_tokens\": 3}'",
        ),
        demo_group="train",
        options=(
            RUN,
            Option(("--checkpoint",), str, "Checkpoint folder (default: train/final, else the newest complete one).",
                   key="export.checkpoint"),
            CONFIG, SETS,
        ),
        summary="draftsmith.export:summary"),
    Stage(
        name="eval", run="draftsmith.eval.stage:run_eval", section="eval",
        inputs=("export/config.json", "export/model.safetensors"),
        outputs=("eval/answers.jsonl", "eval/report.json", "eval/report.md"),
        count=Count("lines", "answers.jsonl", same_unit=True), estimate="draftsmith.estimate:cost_eval",
        help="Measure acceptance length, acceptance per position and speedup of the exported drafter; writes "
        "RUN/eval/report.json.",
        examples=(
            "draftsmith eval --run runs/r1",
            "draftsmith eval --run runs/r1 --prompts mt-bench --limit 10 --num-speculative-tokens 3 --max-tokens 128",
            "draftsmith eval --run runs/r1 --temperature 0.7 --prompts prompts.jsonl",
            "draftsmith eval --run runs/r1 --engine vllm   (starts vLLM with the export, and one without it for the "
            "baseline)",
            "draftsmith eval --run runs/r1 --engine vllm --server http://127.0.0.1:8000   (a running vLLM server "
            "with the drafter)",
            "draftsmith eval --run runs/r1 --engine vllm --set 'eval.vllm_args=[]'   (let vLLM compile: slower "
            "start-up)",
            "draftsmith eval --run runs/other --engine vllm --drafter path/to/drafter   (a speculators-format "
            "drafter from elsewhere)",
        ),
        demo_group="eval",
        options=(
            RUN,
            Option(("--engine",), str, "`local`: draftsmith's own speculative decoding with the transformers target; "
                   "`vllm`: a vLLM server, counts from its /metrics.", key="eval.engine"),
            Option(("--server",), str, "Engine vllm: a running vLLM server (URL) serving the target with this drafter, "
                   "instead of starting one (eval.server).", key="eval.server"),
            Option(("--drafter",), str, "A speculators-format drafter folder to evaluate instead of RUN/export "
                   "(eval.drafter).", key="eval.drafter"),
            Option(("--prompts",), str, "A prompt file or mt-bench, sharegpt, humaneval (default mt-bench).",
                   key="eval.prompts"),
            Option(("--limit",), int, "How many prompts.", key="eval.limit"),
            Option(("--offset",), int, "Skip this many prompts first.", key="eval.offset"),
            Option(("--num-speculative-tokens", "-k"), str, "K, draft tokens per verification step, or `auto` (the "
                   "trained drafts; the report names the fastest K).",
                   key="eval.num_speculative_tokens"),
            Option(("--temperature",), float, "Sampling temperature (0 = greedy).", key="eval.temperature"),
            Option(("--max-tokens",), int, "Tokens per answer.", key="eval.max_tokens"),
            CONFIG, SETS,
        ),
        threads=always, summary="draftsmith.eval.stage:summary"),
)}


def names() -> tuple[str, ...]:
    """Every stage's name, in the order `run` runs them."""
    return tuple(REGISTRY)


def get(name: str) -> Stage:
    """The record of a stage folder's stage (`eval-vllm`, a second evaluation, is an `eval`)."""
    try:
        return REGISTRY[name if name in REGISTRY else name.split("-", 1)[0]]
    except KeyError:
        raise DraftsmithError(f"{name}: not a stage (stages: {', '.join(REGISTRY)})") from None


def planned(cfg: Any) -> tuple[str, ...]:
    """The stages `run` runs under `cfg`, in order (extract not when training online)."""
    return tuple(s.name for s in REGISTRY.values() if s.runs(cfg))
