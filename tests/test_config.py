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
