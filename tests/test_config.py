import pytest
from pydantic import BaseModel

from draftsmith import DraftsmithError
from draftsmith.config import Config, load_config, parse_override
from draftsmith.rundir import RunDir, write_stage_config


def test_defaults_match_spec():
    c = Config()
    assert c.target == "smollm2-135m"
    assert c.generate.backend == "local"
    assert c.train.mode == "offline" and c.train.ttt_steps == 3
    assert c.eval.engine == "local" and c.eval.num_speculative_tokens == 3
    assert c.extract.store_format == "fp8"  # chosen by acceptance measured on validation (docs/experiments/extract.md)


def test_every_field_is_documented():
    def walk(model):
        for name, f in type(model).model_fields.items():
            val = getattr(model, name)
            if isinstance(val, BaseModel):
                walk(val)
            else:
                assert f.description, f"{type(model).__name__}.{name} has no description"
    walk(Config())


def test_yaml_plus_overrides(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("target: /models/x\ngenerate:\n  limit: 10\n  temperature: 0.7\ntrain:\n  lr: 0.001\n")
    c = load_config(p, ["generate.limit=20", "extract.layers=[2, 5, 9]", "train.mode=online"])
    assert c.target == "/models/x"
    assert c.generate.limit == 20 and c.generate.temperature == 0.7
    assert c.extract.layers == [2, 5, 9]
    assert c.train.mode == "online" and c.train.lr == 0.001


def test_override_values_parse_as_yaml():
    assert parse_override("a.b=3") == (["a", "b"], 3)
    assert parse_override("a=true") == (["a"], True)
    assert parse_override("a=[1, 2]") == (["a"], [1, 2])
    assert parse_override("a=http://x:8000/v1") == (["a"], "http://x:8000/v1")
    with pytest.raises(DraftsmithError, match="expected key=value"):
        parse_override("novalue")


@pytest.mark.parametrize(
    "sets, match",
    [
        (["generate.limt=3"], r"generate\.limt: unknown key"),
        (["bogus=1"], r"bogus: unknown key"),
        (["generate.limit=abc"], r"generate\.limit: .*integer.*'abc'"),
        (["train.mode=sideways"], r"train\.mode: .*'sideways'"),
        (["generate.temperature=-1"], r"generate\.temperature: .*greater than or equal"),
        (["train.max_minutes=0"], r"train\.max_minutes: .*greater than 0"),
        (["train=3"], r"train: .*"),
        (["train.method=medusa"], r"train\.method: .*'medusa'"),
        (["train.optimizer=muon", "train.fsdp=true"], r"train\.optimizer: muon does not run under fsdp"),
        (["train.fc_norm=true", "train.norm_before_fc=true"], r"train\.fc_norm: not with norm_before_fc"),
        (["train.fc_input_norm=true", "train.fc_norm=true"], r"train\.fc_input_norm: not with fc_norm"),
        (["train.mask_token_id=-1"], r"train\.mask_token_id: .*greater than or equal"),
    ],
)
def test_bad_keys_and_types_name_the_field(sets, match):
    with pytest.raises(DraftsmithError, match=match) as e:
        load_config(None, sets)
    assert "\n" not in str(e.value)


def test_bad_yaml_file_names_file_and_line(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("generate:\n  limit: 3\n  x: [1, 2\n")
    with pytest.raises(DraftsmithError, match=r"bad\.yaml:\d+: invalid YAML"):
        load_config(p)
    p.write_text("- a\n- b\n")
    with pytest.raises(DraftsmithError, match="top level must be a mapping"):
        load_config(p)
    with pytest.raises(DraftsmithError, match="config file not found"):
        load_config(tmp_path / "missing.yaml")
    p.write_text("generate:\n  limitt: 3\n")
    with pytest.raises(DraftsmithError, match=r"bad\.yaml: generate\.limitt: unknown key"):
        load_config(p)


def test_resolved_config_written_next_to_stage(tmp_path):
    run = RunDir(tmp_path / "run")
    c = load_config(None, ["generate.limit=7"])
    path = write_stage_config(run, "generate", c)
    assert path == run.path / "generate" / "config.yaml"
    again = load_config(path)
    assert again == c


@pytest.mark.parametrize("item, message", [
    ("train.lr=inf", r"train\.lr: Input should be a finite number"),
    ("train.lr=.nan", r"train\.lr: .*finite number|train\.lr: Input should be greater than 0"),
    ("train.max_minutes=.inf", r"train\.max_minutes: Input should be a finite number"),
    ("train.epochs=1e309", r"train\.epochs: Input should be a finite number"),
    ("generate.idle_timeout_s='inf'", r"generate\.idle_timeout_s: Input should be a finite number"),
    ("generate.idle_timeout_s=0", r"generate\.idle_timeout_s: Input should be greater than 0"),
    ("generate.timeout_s=600", r"^--set: generate\.timeout_s: unknown key \(renamed generate\.idle_timeout_s: the "
     r"longest wait for the next piece of a streamed answer, no longer a bound on the whole request\)$"),
    ("train.lr=true", r"train\.lr: expects a number, not true/false"),
    ("generate.limit=false", r"generate\.limit: expects a number, not true/false"),
    ("generate.skip_invalid=1", r"generate\.skip_invalid: expects true or false"),
    ("trust_remote_code='yes'", r"trust_remote_code: expects true or false"),
])
def test_no_non_finite_values_or_surprising_coercions(item, message):
    with pytest.raises(DraftsmithError, match=message) as e:
        load_config(None, [item])
    assert "\n" not in str(e.value)


def test_numbers_written_as_yaml_strings_still_load(tmp_path):
    """YAML 1.1 reads `1e-3` (no dot) as a string: that stays a number, as users write it."""
    p = tmp_path / "c.yaml"
    p.write_text("train:\n  lr: 1e-3\ngenerate:\n  limit: '7'\n  skip_invalid: yes\n")
    c = load_config(p)
    assert (c.train.lr, c.generate.limit, c.generate.skip_invalid) == (1e-3, 7, True)


# -------------------------------------------------------------------------------------------------
# Every numeric setting bounded (config.UPPER and each Field's lower bound)


def numeric_fields(model=Config, prefix=""):
    """(dotted key, field) of every int or float setting of the schema, nested sections walked."""
    import typing

    for name, f in model.model_fields.items():
        args = typing.get_args(f.annotation) or (f.annotation,)
        section = [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]
        if section:
            yield from numeric_fields(section[0], f"{prefix}{name}.")
        elif any(a in (int, float) for a in args):
            yield f"{prefix}{name}", f


NUMERIC = list(numeric_fields())


def test_every_numeric_setting_has_an_upper_bound_in_the_one_table():
    from draftsmith.config import UPPER

    tables = {k for section in UPPER.values() for k in section}
    assert len(NUMERIC) >= 60
    for key, f in NUMERIC:
        le = [m.le for m in f.metadata if getattr(m, "le", None) is not None]
        lt = [m.lt for m in f.metadata if getattr(m, "lt", None) is not None]
        assert le or lt or key.rsplit(".", 1)[-1] in tables, f"{key}: no upper bound"


@pytest.mark.parametrize("key", [k for k, _ in NUMERIC])
def test_every_numeric_setting_refuses_what_cannot_be_honoured_in_one_line(key):
    """0, -1, huge, non-finite and type-wrong values: each refused in one line that names the setting (0 and -1 may
    be valid: then they load and keep their value)."""
    for value in ("0", "-1", "1e300", "1" + "0" * 40, ".nan", ".inf", "-.inf", "x", "[1]",
                  "{a: 1}", "true"):
        try:
            cfg = load_config(None, [f"{key}={value}"])
        except DraftsmithError as e:
            assert key.rsplit(".", 1)[-1] in str(e) and "\n" not in str(e) and len(str(e)) < 400, (key, value, str(e))
            continue
        assert value in ("0", "-1"), f"{key}={value} accepted"
        section, _, name = key.rpartition(".")
        got = getattr(getattr(cfg, section) if section else cfg, name)
        assert got == float(value), (key, value, got)


@pytest.mark.parametrize("key,value", [("threads", "5000"), ("generate.concurrency", "1e12"),
                                       ("extract.concurrency", "100000"), ("train.processes", "99999"),
                                       ("train.validation", "0.999"), ("train.validation", "1000000"),
                                       ("eval.num_speculative_tokens", "1e9"), ("vllm_startup_timeout_s", ".inf"),
                                       ("train.lr", "x")])
def test_a_setting_past_its_bound_stops_the_cli_before_any_work(tmp_path, key, value):
    from conftest import REPO, run_cli

    run = tmp_path / "run"
    p = run_cli("run", str(REPO / "configs" / "demo.yaml"), "--run", str(run), "--set", f"{key}={value}", timeout=120)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert key.rsplit(".", 1)[-1] in p.stderr and "Traceback" not in p.stdout + p.stderr
    assert not run.exists()
