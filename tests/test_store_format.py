"""The store formats (draftsmith/store_format.py, their codecs in extract/codecs.py): one registry; each format
writes the bytes and trains on the numbers it did before the formats were objects; nothing else compares a
format's name; `estimate` and `status` run without torch on a real run."""

import ast
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from draftsmith import DraftsmithError
from draftsmith.extract import store
from draftsmith.extract.codecs import CODECS, codec_of
from draftsmith.extract.stage import run_extract
from draftsmith.store_format import FORMATS, store_format
from draftsmith.target import target_info
from draftsmith.train.data import OfflineSource
from draftsmith.train.stage import run_train
from draftsmith.vocab import run_vocab
from test_train import cfg_for, cycle_samples, write_prepare

PACKAGE = Path(__file__).resolve().parents[1] / "draftsmith"
FORMAT_MODULES = {PACKAGE / "store_format.py", PACKAGE / "extract" / "codecs.py"}

# sha256 of what main's code at 0bb4302 (the format a string, `== "fp8"` branches) gave for the inputs below:
# (length, hash) of one encoded sample file ...
SAMPLE_FILE = {"bf16": (1009, "544f62fbb22bcd4de435e059c05db0de3745048e481886425a253f2e92a067d7"),
               "fp8": (905, "027ac0f37e8ed7c17feed0513168060c28c065390c9b937d5db394960d8de051")}
# ... and of a store's files, its reads (bf16) and a training batch packed from it and moved to float32
STORE_READS = {"bf16": "dd1e4b9c354c96c7c8f536dd6803237ac25d377fb9f579aa26fbfef52b30afc5",
               "fp8": "1dcdda0cd7af2c12bbc6aff454a3cd4aa49f57c9ba982c3b0d5702e326ac7952"}


def test_every_format_has_one_codec_and_its_facts_match_the_files_it_writes():
    assert set(CODECS) == set(FORMATS) and all(codec_of(f).fmt is f for f in FORMATS.values())
    A, H, L = 3, 16, 4
    g = torch.Generator().manual_seed(0)
    aux, last = torch.randn(L, A, H, generator=g), torch.randn(L, H, generator=g)
    sample = {"id": "x", "input_ids": [1, 2, 3, 4], "loss_mask": [0, 1, 1, 1]}
    for fmt in FORMATS.values():
        t = store.sample_tensors(sample, aux, last, fmt)
        assert tuple(t) == fmt.fields, fmt.name
        assert str(t["aux_hidden"].dtype) == f"torch.{fmt.dtype}"
        assert sum(x.numel() * x.element_size() for x in t.values()) == L * fmt.bytes_per_token(A, H), fmt.name
        codec = codec_of(fmt)
        back = codec.decode(codec.parts_of(t, "aux"), torch.float32)
        assert back.shape == aux.shape and torch.allclose(back, aux, rtol=2 ** -3, atol=1e-6)
        assert [tuple(x.shape) for x in codec.parts_of(t, "last")] == [s for _, s in codec.specs((L, H))]
        zeros = tuple(torch.zeros(s, dtype=dt) for dt, s in codec.specs((L, A, H)))  # a batch's padding
        assert torch.equal(codec.decode(zeros, torch.float32), torch.zeros(L, A, H))
    with pytest.raises(DraftsmithError, match=r"extract.store_format: store format 'fp4' is not one"):
        store_format("fp4")


def _golden_inputs():
    g = torch.Generator().manual_seed(57)
    aux = torch.randn(6, 3, 16, generator=g) * 3
    last = torch.randn(6, 16, generator=g)
    aux[2, 1] = 0  # an all-zero row: fp8's scale 1
    return aux, last


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_a_sample_file_is_the_bytes_it_was(name):
    aux, last = _golden_inputs()
    sample = {"id": "s7", "input_ids": [5, 9, 2, 7, 1], "loss_mask": [0, 1, 1, 0, 1]}
    data = store.encode_sample(7, sample, aux, last, [1, 2, 3], FORMATS[name])
    assert (len(data), hashlib.sha256(data).hexdigest()) == SAMPLE_FILE[name]


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_a_store_reads_back_and_trains_on_the_numbers_it_did(tmp_path, name):
    """Written by the writer, read by ExtractStore (bf16) and packed by the offline source into a batch moved
    to float32 (what the loss sees): byte for byte what main's code gave."""
    g = torch.Generator().manual_seed(57)
    lengths = [5, 3, 7]
    w = store.ShardWriter(tmp_path, [1, 2, 3], threads=2, fmt=FORMATS[name])
    samples = [{"id": f"s{i}", "input_ids": list(range(1, n + 1)), "loss_mask": [1] * n} for i, n in enumerate(lengths)]
    w.write_batch((0, 3), [0, 1, 2], samples, torch.randn(3, 8, 3, 16, generator=g) * 4,
                  torch.randn(3, 8, 16, generator=g))
    w.finish_shard((0, 3))
    w.close()
    (tmp_path / "meta.json").write_text(json.dumps({"lengths": lengths, "layers": [1, 2, 3], "hidden_size": 16,
                                                    "shard_size": 3, "store_format": name}))
    st = store.ExtractStore(tmp_path)
    assert st.format is FORMATS[name]
    h = hashlib.sha256()
    for i in range(3):
        h.update((tmp_path / "rows_0-3" / f"{i}.safetensors").read_bytes())
        for k, t in sorted(st[i].items()):
            h.update(k.encode())
            h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    b = OfflineSource(st).batch([[0, 1], [2]], 8).to(torch.device("cpu"), torch.float32)
    for t in (b.input_ids, b.loss_mask, b.doc_ids, b.position_ids, b.aux_hidden, b.last_hidden):
        h.update(str(tuple(t.shape)).encode())
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    assert h.hexdigest() == STORE_READS[name]


def format_comparisons(source: str) -> list[int]:
    """Lines where code compares something named *format*/fmt with a store format's name, looks a format's
    name up in it, or defaults it to one: what belongs to the format objects."""
    tree = ast.parse(source)

    def names(node) -> bool:
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return any(names(e) for e in node.elts)
        return isinstance(node, ast.Constant) and node.value in FORMATS

    def about_format(node) -> bool:
        """A variable or attribute named *format* or *fmt*, or a key named *format* (the key "fmt" of a target's
        quantisation config is another thing)."""
        words = [n.id for n in ast.walk(node) if isinstance(n, ast.Name)]
        words += [n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)]
        keys = [n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
        return any("format" in w.lower() or "fmt" in w.lower() for w in words) or any("format" in k for k in keys)

    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(names(o) for o in operands) and any(about_format(o) for o in operands if not names(o)):
                hits.append(node.lineno)
        elif isinstance(node, ast.Subscript) and names(node.slice) and about_format(node.value):
            hits.append(node.lineno)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
              and len(node.args) == 2 and about_format(node.args[0]) and names(node.args[1])):
            hits.append(node.lineno)
        elif isinstance(node, ast.BoolOp) and names(node.values[-1]) and about_format(node.values[0]):
            hits.append(node.lineno)  # x.get("store_format") or "bf16"
        elif isinstance(node, ast.arguments):
            args = [*node.posonlyargs, *node.args][-len(node.defaults):] if node.defaults else []
            pairs = [*zip(args, node.defaults), *zip(node.kwonlyargs, node.kw_defaults)]
            hits += [d.lineno for a, d in pairs if d is not None and names(d) and about_format(ast.Name(a.arg))]
    return sorted(hits)


def test_no_module_but_the_formats_compares_a_format_name():
    # the check finds what the formats replaced (main at 0bb4302)
    before = ('if store_format == "fp8":\n    pass\nfp8 = self.store.store_format == "fp8"\n'
              'x = FORMAT_FIELDS["fp8"]\nheld = settings.get("store_format", "bf16")\n'
              'ok = precision == "bf16"\nq = "fp8" in str(qc.get("fmt", ""))\n'
              'def f(x, store_format: str = "bf16", precision="bf16"):\n    return meta.get("store_format") or "bf16"\n')
    assert format_comparisons(before) == [1, 3, 4, 5, 8, 9]
    found = {f"{p.relative_to(PACKAGE.parent)}:{n}" for p in sorted(PACKAGE.rglob("*.py")) if p not in FORMAT_MODULES
             for n in format_comparisons(p.read_text(encoding="utf-8"))}
    assert not found, sorted(found)


# -------------------------------------------------------------------------------------------------
# The light commands on a real run: prepare, vocab, an fp8 extract store and a few training steps


def run_lengths(run) -> list[int]:
    return json.loads((run.path / "extract" / "meta.json").read_text())["lengths"]


PROBE = ("import sys\nfrom draftsmith.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n"
         "    assert not e.code, e.code\nprint('HEAVY', ' '.join(m for m in ('torch', 'transformers') if m in sys.modules))")


def test_estimate_and_status_of_a_real_run_import_no_torch(tmp_path, tiny8):
    from draftsmith.rundir import RunDir

    run = RunDir(tmp_path / "run")
    info = target_info(str(tiny8))
    write_prepare(run, tiny8, cycle_samples(info.vocab_size, 12))
    run_vocab(run, cfg_for(tiny8))
    cfg = cfg_for(tiny8, max_steps=3, **{"extract.store_format": "fp8", "extract.shard_size": 8})
    run_extract(run, cfg)
    assert json.loads((run.path / "extract" / "meta.json").read_text())["store_format"] == "fp8"
    run_train(run, cfg)
    config = run.path / "train" / "config.yaml"
    assert config.is_file()
    commands = [["status", str(run.path)], ["status", str(run.path), "--json"],
                *(["estimate", str(config), "--set", "generate.limit=12", "--hardware", hw, "--target-config",
                   str(tiny8 / "config.json"), *more]
                  for hw, more in (("cpu", []), ("cpu", ["--from", str(run.path)]), ("h100", ["--json"]))),
                # the target read from the folder the config names (resolve_target), not from --target-config
                ["estimate", str(config), "--set", "generate.limit=12"]]
    outputs = []
    for args in commands:
        p = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, timeout=120,
                           cwd=PACKAGE.parent)
        assert p.returncode == 0, (args, p.stderr[-2000:])
        assert p.stdout.strip().splitlines()[-1] == "HEAVY", (args, p.stdout[-500:])
        outputs.append(p.stdout)
    status = json.loads(outputs[1].rsplit("HEAVY", 1)[0])
    extract = next(r for r in status["stages"] if r["name"] == "extract")
    stored = FORMATS["fp8"].bytes_per_token(3, info.hidden_size)  # + a file's header and metadata per sample
    assert stored < extract["bytes_per_token"] < stored + store.FILE_OVERHEAD * 12 / sum(run_lengths(run))
    assert "train" in outputs[0] and "extract" in outputs[0]
    assert "measured: " + str(run.path / "train" / "manifest.json") in outputs[3]  # --from the run's rates
    est = json.loads(outputs[4].rsplit("HEAVY", 1)[0])
    assert est["bytes_per_token"] == stored
    assert outputs[5].split("\n", 1)[0] == outputs[2].split("\n", 1)[0]  # the same target line either way


def test_the_file_formats_import_no_torch():
    probe = ("import sys, draftsmith.store_format, draftsmith.prepared_format, draftsmith.checkpoint_format; "
             "print(' '.join(m for m in ('torch', 'transformers', 'pydantic') if m in sys.modules))")
    p = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=PACKAGE.parent)
    assert p.returncode == 0 and p.stdout.strip() == "", p.stdout + p.stderr
