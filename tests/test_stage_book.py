"""StageBook's up-to-date frame (draftsmith/stage.py): `skip` (the rule, its one line, a stage's closer look)
and `skip_or_begin` (skip, else begin), which every run_<stage> goes through."""

from draftsmith.rundir import RunDir
from draftsmith.stage import StageBook


class Cfg:
    """What StageBook asks of a config when it begins: its resolved YAML."""

    def __init__(self, text: str):
        self.text = text

    def to_yaml(self) -> str:
        return self.text


def book(run: RunDir, knob: int) -> StageBook:
    return StageBook(run, "vocab", Cfg(f"vocab: {{knob: {knob}}}\n"), settings={"knob": knob})


def finished(run: RunDir) -> dict:
    b = book(run, 1)
    assert b.skip_or_begin() is None and (run.path / "vocab/config.yaml").read_text() == "vocab: {knob: 1}\n"
    (run.path / "vocab/out.txt").write_text("x")
    return b.finish(counts={"done": 3}, outputs=["out.txt"])


def test_skip_returns_the_current_manifest_with_its_one_line_and_begins_nothing(tmp_path, capsys):
    run = RunDir(tmp_path / "run")
    assert book(run, 1).skip(said=lambda m: "never") is None  # nothing built yet: nothing said, nothing begun
    assert not (run.path / "vocab").exists() and "up to date" not in capsys.readouterr().out
    m = finished(run)
    assert book(run, 1).skip(said=lambda m: f"{m['counts']['done']} samples") == m
    assert capsys.readouterr().out.rstrip().endswith("[vocab] up to date (3 samples); nothing to do")
    assert book(run, 1).skip(outputs_ok=False) is None and run.read_manifest("vocab") == m  # skip never begins


def test_skip_or_begin_begins_a_stage_built_with_other_settings(tmp_path):
    run = RunDir(tmp_path / "run")
    m = finished(run)
    assert book(run, 1).skip_or_begin() == m
    assert book(run, 2).skip_or_begin() is None
    assert run.read_manifest("vocab") is None  # not done until it finishes again; its files stay
    assert (run.path / "vocab/config.yaml").read_text() == "vocab: {knob: 2}\n" and (run.path / "vocab/out.txt").exists()


def test_a_closer_look_that_finds_damage_means_not_up_to_date_and_no_line(tmp_path, capsys):
    run = RunDir(tmp_path / "run")
    m = finished(run)
    looked: list[dict] = []
    assert book(run, 1).skip(said=lambda m: "x", holds=lambda m: looked.append(m) or False) is None
    assert looked == [m] and "up to date" not in capsys.readouterr().out
    assert book(run, 1).skip(holds=lambda m: True) == m
    assert book(run, 2).skip(holds=lambda m: looked.append(m) or True) is None and len(looked) == 1  # only when current
