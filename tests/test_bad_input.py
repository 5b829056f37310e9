"""The bad-input catalogue (docs/reliability.md, "Bad input"): every case runs the real CLI
(`python -m draftsmith ...`) on the tiny random target and expects

- exit code 2 and exactly one line on stderr, `draftsmith: error: ...`, naming the file:line, the
  file or the config field at fault (no traceback);
- no half-written output: the command changes nothing in the run but its own bookkeeping
  (config.yaml, journal, stage.log, state.json, lock), writes no manifest, leaves no temporary file;
- `draftsmith status` showing the stage `failed` with that same line, even when the error was
  found before the stage's progress journal opened (config errors excepted: no stage started,
  and no run folder is created).

Cases covered here by the CLI and also, in more detail, by a stage's own tests are listed side by
side in docs/reliability.md.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest

from conftest import build_tiny_target, run_cli, write_drafter_checkpoint
from draftsmith.config import load_config
from draftsmith.rundir import RunDir
from draftsmith.stages import names as stage_names
from draftsmith.status import run_status
from draftsmith.target import target_info

STAGES = stage_names()

pytestmark = pytest.mark.usefixtures("one_thread")

# What a failed command may add or change in its own stage folder: never an output.
BOOKKEEPING = {"config.yaml", "progress.jsonl", "progress.prev.jsonl", "stage.log", "state.json"}
ANSWERS = ["The quick brown fox jumps over the lazy dog.", "Hello! How can I help you today?",
           "def add(a, b):\n    return a + b\n", "Write a short poem about the sea and the sky."]


def conversation(i: int) -> dict:
    return {"id": f"s{i}", "messages": [{"role": "user", "content": f"Question number {i}?"},
                                        {"role": "assistant", "content": ANSWERS[i % len(ANSWERS)]}],
            "finish_reasons": ["stop"]}


def write_generated(run: RunDir, target: Path, lines: list[str]) -> None:
    """generate/samples.jsonl as given (one string per line) and a generate manifest for `target`."""
    d = run.ensure().stage_dir("generate")
    (d / "samples.jsonl").write_text("".join(line + "\n" for line in lines))
    info = target_info(str(target))
    run.write_manifest("generate", fingerprint=f"gen-{len(lines)}",
                       inputs={"target": {"name": info.name, "fingerprint": info.fingerprint}},
                       settings={"target": str(target)}, counts={"done": len(lines), "total": len(lines), "unit": "samples"},
                       started=time.time(), outputs=["samples.jsonl"])


def base_cfg(target: Path, *sets: str):
    return load_config(None, [f"target={target}", "vocab.draft_vocab_size=32", "dtype=float32", *sets])


@dataclass
class Ctx:
    target: Path  # tiny random Llama, 8 layers, ChatML template
    no_template: Path
    other: Path  # another tiny target (6 layers)
    base: RunDir  # generate (by hand) -> prepare -> vocab -> extract -> train/final (by hand) -> export

    def copy(self, dst: Path, *stages: str) -> RunDir:
        """A copy of the base run holding only `stages` (the failing stage has not run there)."""
        dst.mkdir(parents=True)
        shutil.copy2(self.base.path / "run.json", dst / "run.json")
        for s in stages:
            shutil.copytree(self.base.path / s, dst / s)
        return RunDir(dst)


@pytest.fixture(scope="module")
def ctx(tiny_target, tmp_path_factory) -> Ctx:
    from draftsmith.export import run_export
    from draftsmith.extract.stage import run_extract
    from draftsmith.prepare import run_prepare
    from draftsmith.vocab import run_vocab

    tmp = tmp_path_factory.mktemp("bad-input")
    no_template = build_tiny_target(tmp / "notemplate", chat_template=None)
    other = build_tiny_target(tmp / "other", num_layers=6)
    base = RunDir(tmp / "base")
    write_generated(base, tiny_target, [json.dumps(conversation(i)) for i in range(6)])
    cfg = base_cfg(tiny_target)
    run_prepare(base, cfg)
    run_vocab(base, cfg)
    run_extract(base, cfg)
    write_drafter_checkpoint(base.path / "train" / "final", str(tiny_target), draft_vocab_size=32)
    run_export(base, cfg)
    return Ctx(target=tiny_target, no_template=no_template, other=other, base=base)


# -------------------------------------------------------------------------------------------------
# The cases: setup(ctx, run folder) -> CLI arguments


@dataclass
class Case:
    id: str
    stage: str | None  # the stage that must show `failed`; None: a config error, no run is created
    setup: Callable[[Ctx, Path], list[str]]
    match: str  # regex the error line must match (it names the file:line, file or field)
    outputs: set[str] = field(default_factory=set)  # files the failing stage may keep (resumable work)


def prompts_case(content: bytes) -> Callable[[Ctx, Path], list[str]]:
    def setup(c: Ctx, run: Path) -> list[str]:
        RunDir(run).ensure()
        (run.parent / "p.jsonl").write_bytes(content)
        return ["generate", "--run", str(run), "--set", f"target={c.target}", "--prompts", str(run.parent / "p.jsonl")]
    return setup


GOOD = b'{"id": "a", "conversations": [{"from": "human", "value": "Hello!"}]}\n'
ISOLATED = {"samples.jsonl", "failures.jsonl"}  # the valid records generated, the invalid one kept as a failure


def generated_case(lines: list[str] | None = None, *sets: str, target: str = "target", made_by: str | None = None):
    """prepare on a run whose generate stage holds `lines` (default: six good samples), made by
    the target `made_by` (default: the one prepare is given)."""
    def setup(c: Ctx, run: Path) -> list[str]:
        tgt = getattr(c, target)
        write_generated(RunDir(run), getattr(c, made_by or target), lines or [json.dumps(conversation(i)) for i in range(6)])
        return ["prepare", "--run", str(run), "--set", f"target={tgt}", *sets]
    return setup


def stage_case(stage: str, upstream: tuple[str, ...], *sets: str, target: str = "target",
               edit: Callable[[Ctx, RunDir], None] | None = None):
    """`draftsmith STAGE` with `target` on a copy of the base run holding `upstream`, after `edit`."""
    def setup(c: Ctx, run: Path) -> list[str]:
        rd = c.copy(run, *upstream)
        if edit is not None:
            edit(c, rd)
        return [stage, "--run", str(run), "--set", f"target={getattr(c, target)}", "--set", "vocab.draft_vocab_size=32",
                "--set", "dtype=float32", *sets]
    return setup


def long_prompts(c: Ctx, run: Path) -> list[str]:
    RunDir(run).ensure()
    p = run.parent / "p.jsonl"
    p.write_text("".join(json.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": text}]}) + "\n"
                         for i, text in enumerate(["Hello!", "word " * 3000, "Hi there."])))
    return ["generate", "--run", str(run), "--set", f"target={c.target}", "--prompts", str(p), "--max-tokens", "4"]


def no_template_generate(c: Ctx, run: Path) -> list[str]:
    RunDir(run).ensure()
    (run.parent / "p.jsonl").write_bytes(GOOD)
    return ["generate", "--run", str(run), "--set", f"target={c.no_template}", "--prompts", str(run.parent / "p.jsonl")]


def edit_json(path: Path, fn) -> None:
    obj = json.loads(path.read_text())
    fn(obj)
    path.write_text(json.dumps(obj))


def drop_tensor(path: Path, name: str) -> None:
    from safetensors.torch import load_file, save_file

    sd = load_file(str(path))
    del sd[name]
    save_file(sd, str(path))


def reprepare_shorter(c: Ctx, run: RunDir) -> None:
    from draftsmith.prepare import run_prepare

    run_prepare(run, base_cfg(c.target, "prepare.max_length=44"))  # the vocab was counted on other data


def config_case(text: str | None, *sets: str):
    def setup(c: Ctx, run: Path) -> list[str]:
        args = ["generate", "--run", str(run), *sets]
        if text is not None:
            (run.parent / "c.yaml").write_text(text)
            args += ["--config", str(run.parent / "c.yaml")]
        return args
    return setup


def pipeline_case(c: Ctx, run: Path) -> list[str]:
    (run.parent / "p.jsonl").write_bytes(GOOD + b'{"id": "b", "conversations": [{"from": "human", "value": "x"}\n')
    (run.parent / "c.yaml").write_text(f"target: {c.target}\ngenerate:\n  prompts: {run.parent / 'p.jsonl'}\n")
    return ["run", str(run.parent / "c.yaml"), "--run", str(run)]


CASES = [
    # -- prompt files (generate) --
    # a record that cannot be a prompt fails alone: the others are generated (kept for the rerun), the record is in
    # failures.jsonl with its line, and the stage exits with one line saying how many (issue 59: records isolated)
    Case("malformed-json-line", "generate",
         prompts_case(GOOD + b'{"id": "b", "conversations": [{"from": "human", "val\n'),
         r"^1 prompt record\(s\) invalid, the first .*/p\.jsonl:2: malformed JSON", outputs=ISOLATED),
    Case("empty-conversation", "generate",
         prompts_case(GOOD + b'{"id": "b", "conversations": [{"from": "gpt", "value": "only an answer"}]}\n'),
         r"invalid, the first .*/p\.jsonl:2: empty conversation", outputs=ISOLATED),
    Case("unknown-role", "generate",
         prompts_case(GOOD + b'{"messages": [{"role": "robot", "content": "beep"}]}\n'),
         r"invalid, the first .*/p\.jsonl:2: messages\[0\]: unknown role 'robot'", outputs=ISOLATED),
    Case("lone-surrogate", "generate",  # valid JSON, not valid Unicode: no tokenizer or server can take it
         prompts_case(GOOD + b'{"id": "b", "messages": [{"role": "user", "content": "Hi \\ud800"}]}\n'),
         r"invalid, the first .*/p\.jsonl:2: field 'messages\[0\]\.content' is not valid Unicode", outputs=ISOLATED),
    Case("nested-too-deep", "generate",
         prompts_case(GOOD + b'{"id": "b", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n"),
         r"invalid, the first .*/p\.jsonl:2: nested deeper than any conversation", outputs=ISOLATED),
    Case("invalid-utf8", "generate",
         prompts_case(GOOD + b'{"id": "b", "conversations": [{"from": "human", "value": "caf\xe9"}]}\n'),
         r"/p\.jsonl:2: invalid UTF-8"),
    Case("malformed-json-under-run", "generate", pipeline_case,
         r"invalid, the first .*/p\.jsonl:2: malformed JSON", outputs=ISOLATED),
    # -- prompts longer than the maximum length --
    Case("prompt-longer-than-target-context", "generate", long_prompts,
         r"1 samples failed, see .*/generate/failures\.jsonl",
         outputs={"samples.jsonl", "failures.jsonl"}),
    Case("nothing-left-within-prepare-max-length", "prepare",
         generated_case(None, "--max-length", "16", "--overflow", "drop"),
         r"/generate/samples\.jsonl: no sample kept \(6 dropped", outputs={"samples.jsonl"}),
    # -- generate's output fed to prepare --
    Case("malformed-json-line-in-generated", "prepare",
         generated_case([json.dumps(conversation(0)), '{"id": "s1", "messages": [{"role": "us']),
         r"/generate/samples\.jsonl:2: invalid JSON"),
    Case("unknown-role-in-generated", "prepare",
         generated_case([json.dumps(conversation(0)), json.dumps({"id": "s1", "messages": [{"role": "bot", "content": "hi"}]})]),
         r"/generate/samples\.jsonl:2: message 1: role must be one of system, user, assistant \(got 'bot'\)"),
    Case("generated-for-another-target", "prepare", generated_case(made_by="other"),
         r"/generate/manifest\.json: built for another target"),
    # -- targets without a chat template --
    Case("no-chat-template-generate", "generate", no_template_generate, r"target: .*/notemplate has no chat template"),
    Case("no-chat-template-prepare", "prepare", generated_case(target="no_template"),
         r"target notemplate: its tokenizer has no chat template"),
    # -- settings that do not fit the target --
    Case("aux-layer-out-of-range", "extract", stage_case("extract", ("generate", "prepare"), "--set", "extract.layers=[2, 4, 8]"),
         r"extract\.layers: layer id 8 is out of range for .* \(8 layers; valid 1\.\.7\)"),
    Case("aux-layer-out-of-range-in-checkpoint", "export",
         stage_case("export", ("train",),
                    edit=lambda c, r: edit_json(r.path / "train/final/drafter.json", lambda m: m.__setitem__("aux_layers", [2, 4, 9]))),
         r"/train/final/drafter\.json: aux_layers: layer id 9 is out of range"),
    Case("draft-vocab-larger-than-target", "vocab",
         stage_case("vocab", ("generate", "prepare"), "--set", "vocab.draft_vocab_size=100000"),
         r"vocab\.draft_vocab_size: 100000 is larger than the vocabulary of target"),
    # -- a vocabulary or extract store from another target or other settings --
    Case("vocab-of-another-size", "train",
         stage_case("train", ("generate", "prepare", "vocab", "extract"), "--set", "vocab.draft_vocab_size=64"),
         r"/vocab/vocab\.json: draft vocabulary of 32 tokens, but vocab\.draft_vocab_size is 64"),
    Case("vocab-of-other-prepared-data", "train",
         stage_case("train", ("generate", "prepare", "vocab"), "--set", "train.mode=online", edit=reprepare_shorter),
         r"/vocab/vocab\.json: built from other prepared data than the current prepare stage"),
    Case("extract-store-of-other-layers", "train",
         stage_case("train", ("generate", "prepare", "vocab", "extract"), "--set", "extract.layers=[1, 3, 5]"),
         r"extract\.layers: \[1, 3, 5\] differs from the layers \[2, 4, 5\] that .*/extract/meta\.json was extracted with"),
    Case("extract-store-of-another-target", "train",
         stage_case("train", ("generate", "prepare", "vocab", "extract"), target="other"),
         r"/extract/manifest\.json: built for another target"),
    Case("prepared-for-another-target", "extract",
         stage_case("extract", ("generate", "prepare"), "--set", "extract.layers=[1, 2, 3]", target="other"),
         r"/prepare/manifest\.json: built for another target"),
    # -- export folders --
    Case("export-missing-weights", "eval",
         stage_case("eval", ("export",), "--set", "eval.limit=1", edit=lambda c, r: (r.path / "export/model.safetensors").unlink()),
         r"/export/model\.safetensors: missing \(changed since export finished; `draftsmith eval` reads it\): rerun "
         r"`draftsmith export --run "),
    Case("export-missing-config", "eval",
         stage_case("eval", ("export",), "--set", "eval.limit=1", edit=lambda c, r: (r.path / "export/config.json").unlink()),
         r"/export/config\.json: missing \(changed since export finished"),
    Case("export-config-mismatches-weights", "eval",
         stage_case("eval", ("export",), "--set", "eval.limit=1",
                    edit=lambda c, r: edit_json(r.path / "export/config.json", lambda j: j.__setitem__("draft_vocab_size", 16))),
         # checked by what it is: the edited config is not what export wrote (load_exported's shape checks refuse
         # the same folder given as eval.drafter: test_export)
         r"/export/config\.json: \d+ bytes, written with \d+ \(changed since export finished"),
    Case("checkpoint-missing-tensor", "export",
         stage_case("export", ("train",), edit=lambda c, r: drop_tensor(r.path / "train/final/model.safetensors", "fc.weight")),
         r"/train/final/model\.safetensors: missing tensor 'fc\.weight'"),
    # -- configs --
    Case("config-unknown-key", None, config_case(None, "--set", "generate.limt=3"), r"^--set: generate\.limt: unknown key$"),
    Case("config-unknown-key-in-file", None, config_case("generate:\n  limit: 3\n  temprature: 0.5\n"),
         r"/c\.yaml: generate\.temprature: unknown key$"),
    Case("config-wrong-type", None, config_case("train:\n  lr: fast\n"), r"/c\.yaml: train\.lr: .*number.*\(got 'fast'\)"),
    Case("config-invalid-yaml", None, config_case("generate:\n  limit: 3\n  servers: [a, b\n"), r"/c\.yaml:\d+: invalid YAML"),
    Case("config-duplicate-section", None, config_case("generate:\n  limit: 3\ngenerate:\n  limit: 4\n"),
         r"/c\.yaml:3: invalid YAML \(key 'generate' given twice \(first on line 1\)\)$"),
    Case("config-duplicate-key", None, config_case("generate:\n  limit: 3\n  seed: 1\n  limit: 4\n"),
         r"/c\.yaml:4: invalid YAML \(key 'limit' given twice \(first on line 2\)\)$"),
    Case("config-duplicate-key-in-set", None, config_case(None, "--set", "generate={limit: 3, limit: 4}"),
         r"key 'limit' given twice"),
]


# -------------------------------------------------------------------------------------------------
# The checks


def snapshot(root: Path) -> dict[str, str]:
    if not root.exists():
        return {}
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_one_line_and_leaves_nothing_behind(case: Case, ctx: Ctx, tmp_path):
    run = tmp_path / "run"
    args = case.setup(ctx, run)
    before = snapshot(run)

    p = run_cli(*args, timeout=300)

    assert p.returncode == 2, (p.returncode, p.stdout[-2000:], p.stderr[-2000:])
    assert "Traceback" not in p.stdout + p.stderr, p.stderr
    lines = p.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("draftsmith: error: "), p.stderr
    msg = lines[0].removeprefix("draftsmith: error: ")
    assert re.search(case.match, msg), msg

    if case.stage is None:  # a config error: nothing starts, not even the run folder
        assert not run.exists()
        return
    after = snapshot(run)
    changed = {k for k in before.keys() | after.keys() if before.get(k) != after.get(k)}
    for rel in changed:
        parts = Path(rel).parts
        if rel in ("run.json", "pipeline.json") and rel not in before:
            continue  # the run folder's marker; `draftsmith run`'s own record
        if parts[0] == ".locks" and len(parts) == 2 and parts[1].endswith(".lock"):
            continue  # the one-process-per-stage locks (RunDir.stage_lock, run_lock)
        assert parts[0] == case.stage and len(parts) == 2 and parts[1] in BOOKKEEPING | case.outputs, \
            f"{rel} was written or changed by a failed {case.stage}"
    assert not (run / case.stage / "manifest.json").exists()
    assert not [rel for rel in after if ".tmp" in rel], "temporary files left behind"
    for name in case.outputs:  # kept for a resume: whole records only
        path = run / case.stage / name
        if path.exists():
            text = path.read_text()
            assert not text or text.endswith("\n")
            assert all(isinstance(json.loads(line), dict) for line in text.splitlines())

    st = {s["name"]: s for s in run_status(run)["stages"]}
    assert st[case.stage]["state"] == "failed" and st[case.stage]["error"] == msg, st[case.stage]
    for s in STAGES:
        if s != case.stage:
            assert st[s]["state"] in ("pending", "done"), (s, st[s])
    if args[0] == "run":
        pipe = run_status(run)["pipeline"]
        assert pipe["state"] == "failed" and pipe["error"] == msg


@pytest.mark.parametrize("args", [["generate", "--run", ""], ["prepare", "--run", ""], ["train", "--run", ""],
                                  ["eval", "--run", ""], ["run", "RECIPE", "--run", ""], ["status", ""], ["watch", ""]],
                         ids=lambda a: a[0])
def test_an_empty_run_path_is_refused_and_nothing_lands_in_the_current_folder(ctx: Ctx, tmp_path, args):
    """`--run ''` would be the current folder (typer turns it into Path('.')): refused in one line,
    the folder the command ran in left as it was."""
    (tmp_path / "c.yaml").write_text(f"target: {ctx.target}\n")
    p = run_cli(*[str(tmp_path / "c.yaml") if a == "RECIPE" else a for a in args], cwd=tmp_path)
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        "draftsmith: error: --run: an empty path; name the run's folder (e.g. --run runs/r1)"], p.stderr
    assert sorted(q.name for q in tmp_path.iterdir()) == ["c.yaml"]
