"""Property test of the command line: random configs, `--set` values, prompt lines, journal lines,
environment variables draftsmith reads, and edits of a target's and a drafter's config.json, drawn
by a seeded generator, fed to the CLI entries in-process (draftsmith.cli.main). For every input: an
exit code in {0, 1, 2}, at most one line on stderr, and no traceback, nothing escaping main. Nothing
here names a case: the values are drawn from shapes that break parsers (wrong types, empty, huge,
negative, non-finite, NUL bytes, lone surrogates, any code point, any depth, cut JSON, duplicate
keys), so a new field or format is fuzzed without a new line of test."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest
import yaml

from draftsmith.cli import main
from draftsmith.config import Config

REPO = Path(__file__).resolve().parents[1]
SEED = 43
BUDGET_S = 20.0  # per category: the four stay under two minutes on the 2-core CI machine

NASTY_TEXT = ["", " ", "-1", "0", "1e309", "-1e309", "nan", "inf", "9" * 40, "0.5", "true", "null", "[]", "{}",
              "[1, 2", "{a: 1, a: 2}", "\x00", "é\u202e", "../../..", "/dev/null", "a" * 5000, "'", "\"", "!!python/object:os.system",
              "&a [*a]", "1:2", "-", "--run", "${HOME}", "%s", "[[[[[[[[[[1]]]]]]]]]]"]


def any_text(rng: random.Random) -> str:
    """Text of any code points, lone surrogates included (valid in JSON as escapes, not as Unicode)."""
    return "".join(chr(rng.choice([rng.randint(0, 0x7F), rng.randint(0xD800, 0xDFFF), rng.randint(0, 0x10FFFF)]))
                   for _ in range(rng.randint(1, 12)))


def deep(rng: random.Random):
    """A list nested deeper than any chat (and than Python's recursion limit, sometimes)."""
    v: list = []
    for _ in range(rng.choice([50, 900, 5000])):
        v = [v]
    return v


def nasty_value(rng: random.Random, json_only: bool = False):
    """A value of a shape that breaks parsers and validators (YAML-able unless `json_only`: then also lone
    surrogates, any depth, numbers past any float)."""
    pick = rng.random()
    if json_only and pick < 0.15:
        return rng.choice([any_text(rng), "Hi \ud800", deep(rng), 10 ** 400, -(10 ** 400), 1e9, -1e9])
    if pick < 0.5:
        return rng.choice(NASTY_TEXT)
    if pick < 0.7:
        return rng.choice([-(2 ** 63), -1, 0, 1, 2 ** 31, 10 ** 12, 2 ** 64])
    if pick < 0.85:
        return rng.choice([0.0, -0.0, 1e-320, 1e308, -3.5, float("nan"), float("inf")])
    return rng.choice([[], [None], [1, "x"], {"k": None}, {"": 1}, None, True, False])


def dumps(value) -> str:
    """JSON of any value nasty_value draws (NaN and infinities as JSON5 writes them; too deep: cut to a marker)."""
    try:
        return json.dumps(value, allow_nan=True)
    except (RecursionError, ValueError):
        return "[" * 3000 + "]" * 3000


def config_keys() -> list[str]:
    """Every leaf key of the config, `section.field`, from the models themselves."""
    keys = []
    for name, field in Config.model_fields.items():
        ann = field.annotation
        sub = getattr(ann, "model_fields", None) if isinstance(ann, type) else None
        if sub:
            keys += [f"{name}.{k}" for k in sub]
        else:
            keys.append(name)
    return keys


def run_main(capsys, *args: str) -> tuple[int, str]:
    """(exit code, stderr) of `draftsmith ARGS` in this process; anything escaping main fails the test."""
    capsys.readouterr()
    try:
        main(list(args))
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return code, capsys.readouterr().err


def check(code: int, err: str, what) -> None:
    assert code in (0, 1, 2), (code, err, what)
    assert "Traceback" not in err and len(err.strip().splitlines()) <= 1, (err[-2000:], what)


def rounds(rng_seed: int):
    """Seeded generators for as many rounds as BUDGET_S allows (at least 5)."""
    rng, t0, n = random.Random(rng_seed), time.monotonic(), 0
    while n < 5 or time.monotonic() - t0 < BUDGET_S:
        yield rng
        n += 1


@pytest.fixture(scope="module")
def smol_recipe(tmp_path_factory, tiny_target) -> Path:
    path = tmp_path_factory.mktemp("fuzz") / "recipe.yaml"
    path.write_text(yaml.safe_dump({"target": str(tiny_target), "vocab": {"draft_vocab_size": 32}}))
    return path


def test_set_values_on_every_key(capsys, smol_recipe):
    """`estimate RECIPE --set key=value` for random keys of the schema and nasty values."""
    keys = config_keys()
    for rng in rounds(SEED):
        sets = []
        for _ in range(rng.randint(1, 3)):
            value = nasty_value(rng)
            raw = value if isinstance(value, str) else yaml.safe_dump(value, default_flow_style=True).strip()
            sets += ["--set", f"{rng.choice(keys + ['nope', 'train.nope', ''])}={raw}"]
        code, err = run_main(capsys, "estimate", str(smol_recipe), *sets)
        check(code, err, sets)


def test_random_config_files(capsys, smol_recipe, tmp_path):
    """Recipes mutated at random: keys deleted, duplicated, retyped, nested wrong, cut bytes."""
    base = yaml.safe_load(smol_recipe.read_text())
    keys = config_keys()
    path = tmp_path / "c.yaml"
    for rng in rounds(SEED + 1):
        data = json.loads(json.dumps(base))
        for _ in range(rng.randint(1, 4)):
            key = rng.choice(keys).split(".")
            node = data
            for part in key[:-1]:
                node = node.setdefault(part, {}) if isinstance(node.get(part, {}), dict) else {}
            node[key[-1]] = nasty_value(rng)
        text = yaml.safe_dump(data, allow_unicode=True)
        shape = rng.random()
        if shape < 0.15:
            text = text[: rng.randint(0, len(text))]  # cut anywhere
        elif shape < 0.3:
            line = rng.choice(text.splitlines() or [""])
            text += line + "\n"  # a line twice: a duplicate key, or worse
        elif shape < 0.4:
            text = "".join(chr(rng.randint(0, 0x2FF)) for _ in range(rng.randint(1, 80)))
        path.write_text(text, encoding="utf-8", errors="surrogatepass")
        code, err = run_main(capsys, "estimate", str(path))
        check(code, err, text[:500])


def test_random_prompt_lines(capsys, tiny_target, tmp_path):
    """generate (backend dataset: the file's own replies, no decoding) on prompt files of random lines."""
    good = {"id": "g", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    for i, rng in enumerate(rounds(SEED + 2)):
        lines = []
        for _ in range(rng.randint(1, 4)):
            rec = json.loads(json.dumps(good))
            shape = rng.random()
            if shape < 0.3:
                rec[rng.choice(["id", "messages", "conversations", "system"])] = nasty_value(rng, json_only=True)
            elif shape < 0.5:
                rec["messages"][rng.randint(0, 1)][rng.choice(["role", "content"])] = nasty_value(rng, json_only=True)
            line = dumps(rec)
            if rng.random() < 0.2:
                line = line[: rng.randint(0, len(line))]
            if rng.random() < 0.1:
                line = line.replace('"hi"', '"h\x00i"')
            lines.append(line)
        prompts = tmp_path / f"p{i}.jsonl"
        prompts.write_text("\n".join(lines) + "\n", encoding="utf-8", errors="surrogatepass")
        code, err = run_main(capsys, "generate", "--run", str(tmp_path / f"run{i}"), "--prompts", str(prompts),
                             "--backend", "dataset", "--set", f"target={tiny_target}", "--set", "generate.limit=4")
        check(code, err, lines)


def test_random_journal_lines(capsys, tmp_path):
    """A finished stage's journal with random lines appended: status and status --json answer 0."""
    run = tmp_path / "run"
    (run / "generate").mkdir(parents=True)
    (run / "run.json").write_text("{}")
    fields = ["ev", "t", "pt", "done", "total", "pid", "rank", "world_size", "phase", "error", "stall_after_s", "unit"]
    good = [{"ev": "start", "t": 1.0, "pid": 1, "total": 3, "unit": "samples", "done": 0},
            {"ev": "end", "t": 2.0, "done": 3, "total": 3}]
    for rng in rounds(SEED + 3):
        lines = [json.dumps(e) for e in good]
        for _ in range(rng.randint(1, 3)):
            ev = {k: (nasty_value(rng) if rng.random() < 0.4 else v) for k, v in
                  {"ev": rng.choice(["p", "start", "end", "error"]), "t": 3.0, "done": 2}.items()}
            ev.update({rng.choice(fields): nasty_value(rng) for _ in range(rng.randint(0, 2))})
            line = json.dumps(ev, allow_nan=True)
            lines.append(line[: rng.randint(0, len(line))] if rng.random() < 0.2 else line)
        (run / "generate" / "progress.jsonl").write_text("\n".join(lines) + "\n")
        for args in (("status", str(run)), ("status", str(run), "--json")):
            code, err = run_main(capsys, *args)
            assert code == 0 and not err.strip(), (err, lines)


# what draftsmith reads from its environment (bounds.py bounds each where it is read)
ENV_VARS = ["DRAFTSMITH_LOG_INTERVAL_S", "OMP_NUM_THREADS", "LOCAL_WORLD_SIZE", "RANK", "WORLD_SIZE", "LOCAL_RANK",
            "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT"]


@pytest.fixture(scope="module")
def prepared_run(tmp_path_factory, tiny_target) -> Path:
    """A run with generate and prepare done on the tiny target (for vocab, the quickest stage that writes)."""
    from draftsmith.config import load_config
    from draftsmith.pipeline import run_pipeline
    from draftsmith.rundir import RunDir

    root = tmp_path_factory.mktemp("fuzz-run")
    prompts = root / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": f"hi {i}"},
                                                                       {"role": "assistant", "content": "hello"}]})
                               + "\n" for i in range(3)))
    cfg = load_config(None, [f"target={tiny_target}", f"generate.prompts={prompts}", "generate.backend=dataset",
                             "vocab.draft_vocab_size=32"])
    run_pipeline(RunDir(root / "run"), cfg, until_stage="prepare")
    return root / "run"


def test_random_environment(capsys, monkeypatch, prepared_run, tiny_target):
    """vocab (a stage that writes) and status under random values of the variables draftsmith reads."""
    for rng in rounds(SEED + 4):
        with monkeypatch.context() as m:
            for name in rng.sample(ENV_VARS, rng.randint(1, 3)):
                value = nasty_value(rng)
                m.setenv(name, (value if isinstance(value, str) else json.dumps(value, allow_nan=True)).replace(
                    "\x00", ""))
            for args in (("vocab", "--run", str(prepared_run), "--set", f"target={tiny_target}",
                          "--set", f"vocab.draft_vocab_size={rng.choice([32, 33])}"), ("status", str(prepared_run))):
                code, err = run_main(capsys, *args)
                check(code, err, (args, {k: v for k, v in __import__("os").environ.items() if k in ENV_VARS}))


def test_random_target_and_drafter_config_edits(capsys, tmp_path, tiny_target):
    """estimate on a target config.json, and eval of a drafter folder, each edited at random: any field of the model
    config (or its text_config) set to any value, the file cut or replaced by another JSON value."""
    import shutil

    from conftest import write_drafter_checkpoint
    from draftsmith.bounds import MODEL_INTS
    from draftsmith.config import load_config
    from draftsmith.export import run_export
    from draftsmith.rundir import RunDir

    target_cfg = json.loads((Path(tiny_target) / "config.json").read_text())
    run = RunDir(tmp_path / "run").ensure()
    write_drafter_checkpoint(run.path / "train" / "final", str(tiny_target), aux_layers=[1, 3, 5], draft_vocab_size=32)
    run_export(run, load_config(None, [f"target={tiny_target}"]))
    drafter_cfg = json.loads((run.path / "export" / "config.json").read_text())
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "messages": [{"role": "user", "content": "hi"}]}) + "\n")
    fields = list(MODEL_INTS) + ["rms_norm_eps", "rope_theta", "architectures", "text_config",
                                 "transformer_layer_config", "eagle_aux_hidden_state_layer_ids", "speculators_config"]
    for i, rng in enumerate(rounds(SEED + 5)):
        for which, base in (("target", target_cfg), ("drafter", drafter_cfg)):
            data = json.loads(json.dumps(base))
            for _ in range(rng.randint(1, 3)):
                node = data.get("transformer_layer_config") if which == "drafter" and rng.random() < 0.5 else data
                if isinstance(node, dict):
                    node[rng.choice(fields)] = nasty_value(rng, json_only=True)
            text = dumps(data)
            if rng.random() < 0.1:
                text = text[: rng.randint(0, len(text))]
            elif rng.random() < 0.05:
                text = dumps(nasty_value(rng, json_only=True))
            if which == "target":
                path = tmp_path / f"target{i}.json"
                path.write_text(text)
                args = ("estimate", str(REPO / "configs" / "llama-8b-1xh100.yaml"), "--hardware", "h100",
                        "--target-config", str(path))
            else:
                folder = tmp_path / f"drafter{i}"
                shutil.copytree(run.path / "export", folder)
                (folder / "config.json").write_text(text)
                args = ("eval", "--run", str(tmp_path / f"eval{i}"), "--drafter", str(folder), "--prompts",
                        str(prompts), "--set", f"target={tiny_target}", "--max-tokens", "2", "--set",
                        "eval.baseline=false")
            code, err = run_main(capsys, *args)
            check(code, err, (which, text[:300]))
