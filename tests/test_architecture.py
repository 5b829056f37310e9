"""The rules of docs/architecture.md that code can check: no import cycle between draftsmith's
modules; the light paths (`draftsmith --help`, `status`, the sizing rules, estimate) import neither
torch nor pydantic; nothing of draftsmith imports the CLI."""

from __future__ import annotations

import ast
import builtins
import re
import subprocess
import symtable
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "draftsmith"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def top_level_imports(path: Path) -> set[str]:
    """The draftsmith modules `path` imports when it is imported (not those inside functions)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("draftsmith")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("draftsmith") and not node.level:
            found.add(node.module)
            # `from draftsmith.generate import openai`: a submodule, when there is one by that name
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                if (PACKAGE.parent / Path(*sub.split("."))).with_suffix(".py").is_file() or \
                        (PACKAGE.parent / Path(*sub.split(".")) / "__init__.py").is_file():
                    found.add(sub)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py") if "vllm_plugins" not in p.parts}
    return {m: {i for i in top_level_imports(p) if i in modules and i != m} for m, p in modules.items()}


def test_no_import_cycle_and_nothing_imports_the_cli():
    graph = import_graph()
    assert not [m for m, deps in graph.items() if "draftsmith.cli" in deps and m != "draftsmith.__main__"]
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(d):] + [d]))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


@pytest.mark.parametrize("code, heavy", [
    ("import draftsmith.cli", ("torch", "pydantic", "transformers", "draftsmith.config")),
    ("import draftsmith.status", ("torch", "pydantic", "transformers")),
    ("import draftsmith.model.config, draftsmith.estimate, draftsmith.checkpoint_format", ("torch", "pydantic")),
    # the target's identity and layout: what estimate and the sizing rules ask of the target
    ("import draftsmith.target.identity, draftsmith.target.layout", ("torch", "transformers")),
    # the held-out split and the acceptance length's error: vocab, train, eval, status and benches read them
    ("import draftsmith.heldout, draftsmith.acceptance", ("torch", "pydantic", "transformers")),
])
def test_light_paths_stay_light(code, heavy):
    probe = f"import sys; {code}; print(' '.join(m for m in {heavy!r} if m in sys.modules))"
    p = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "", p.stdout + p.stderr


@pytest.mark.parametrize("args", [
    ["estimate", "configs/llama-8b-1xh100.yaml", "--hardware", "h100", "--target-config",
     "configs/targets/llama-3.1-8b-instruct.json"],
    ["estimate", "configs/kimi-k2.5-8xh200.yaml", "--hardware", "h200", "--devices", "8", "--target-config",
     "configs/targets/kimi-k2.5.json", "--json"],
    ["status", "RUN"], ["status", "RUN", "--json"],
], ids=["estimate", "estimate-kimi-json", "status", "status-json"])
def test_light_commands_run_without_torch(args, tmp_path):
    """The commands themselves, run to the end, not only their imports: estimate (given a target config) and status
    never import torch or transformers (estimate reads the store's sizes from store_format.py)."""
    run = tmp_path / "run"
    (run / "generate").mkdir(parents=True)
    (run / "run.json").write_text("{}")
    args = [str(run) if a == "RUN" else a for a in args]
    probe = ("import sys\nfrom draftsmith.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n"
             "    assert not e.code, e.code\nprint('HEAVY', ' '.join(m for m in ('torch', 'transformers') "
             "if m in sys.modules))")
    p = subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True, timeout=120,
                       cwd=PACKAGE.parent)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().splitlines()[-1] == "HEAVY", p.stdout[-500:]


@pytest.mark.parametrize("stage", ["generate", "prepare", "vocab", "extract", "train", "export", "eval", "run"])
def test_a_config_error_is_told_before_the_stage_is_imported(stage, tmp_path):
    """A typo in --set is one line and exit 2 without importing torch (~3 s saved on every such error): each
    stage command reads its config before it imports its stage."""
    probe = ("import sys\nfrom draftsmith.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n"
             "    print('EXIT', e.code, ' '.join(m for m in ('torch', 'transformers') if m in sys.modules))")
    args = [stage, *(["configs/demo.yaml"] if stage == "run" else []), "--run", str(tmp_path / "run")]
    p = subprocess.run([sys.executable, "-c", probe, *args, "--set", "train.bogus=1"], capture_output=True,
                       text=True, timeout=120, cwd=PACKAGE.parent)
    assert p.stdout.strip() == "EXIT 2", p.stdout + p.stderr
    assert re.fullmatch(r"draftsmith: error: (configs/demo.yaml \+ )?--set: train.bogus: unknown key", p.stderr.strip())
    assert not (tmp_path / "run").exists()


def test_no_line_of_the_package_is_over_120_characters():
    long = [f"{p.relative_to(PACKAGE.parent)}:{n}" for p in sorted(PACKAGE.rglob("*.py"))
            for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if len(line) > 120]
    assert not long, long[:20]


MODULE_DUNDERS = {"__file__", "__name__", "__doc__", "__spec__", "__path__", "__builtins__", "__class__"}


def undefined_names(path: Path) -> list[str]:
    """Names a module's code reads as globals that neither the module (imports, definitions, assignments) nor
    Python's builtins define: each a NameError when that line runs (symtable: no import, no execution)."""
    top = symtable.symtable(path.read_text(), str(path), "exec")
    defined = {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported() or s.is_namespace()}
    found = []

    def walk(table: symtable.SymbolTable) -> None:
        for s in table.get_symbols():
            free_global = s.is_global() and not s.is_declared_global() if table is not top else not (
                s.is_assigned() or s.is_imported())
            name = s.get_name()
            if (s.is_referenced() and free_global and name not in defined and not hasattr(builtins, name)
                    and name not in MODULE_DUNDERS):
                found.append(f"{path.relative_to(PACKAGE.parent)}: {table.get_name()} reads {name}")
        for child in table.get_children():
            walk(child)

    walk(top)
    return found


def test_every_name_the_code_reads_is_defined():
    """A merge caught by CI: one branch removed an import as unused while another began to use it, and a
    two-process extract failed at its end with a NameError. Every module of the package, the benches and the tests
    reads only names it defines or imports."""
    roots = [PACKAGE, PACKAGE.parent / "bench", PACKAGE.parent / "tests"]
    found = [x for root in roots for path in sorted(root.rglob("*.py")) for x in undefined_names(path)]
    assert not found, "\n".join(found)


# The train keys read in more than one module, each with why (bench/config_trace.py: a reader following the YAML to
# where a key acts). A key that another module starts to read fails here until its reason is written down.
SHARED_TRAIN_KEYS = {
    "block_size": ("kinds/__init__.py", "kinds/dflash/__init__.py"),  # refused for chain kinds; a block's size
    # sized without torch; built; set against a released drafter's (train.init_from) refused before any stage
    "drafter_attention": ("estimate.py", "released.py", "train/drafter.py"),
    "max_minutes": ("demo.py", "train/schedule.py"),  # the demo's prompts around training's minutes; the budget
    # the kind's drafter sized without torch; a released drafter's kind held to it before any stage; built
    "method": ("estimate.py", "released.py", "train/drafter.py"),
    "mode": ("stages.py", "train/data.py"),  # extract runs for offline training; the source of the states
    "seed": ("train/data.py", "train/drafter.py"),  # the data's order; the drafter's first weights
    "validation": ("heldout.py", "train/stage.py"),  # the split vocab and train make; train's line that it is off
    # a chain's drafts; a block's default size (ttt_steps + 1); the objective's unrolled steps
    "ttt_steps": ("kinds/__init__.py", "kinds/dflash/__init__.py", "train/objective.py"),
}


def test_each_train_key_is_read_where_it_acts():
    sys.path.insert(0, str(PACKAGE.parent / "bench"))
    try:
        import config_trace
    finally:
        sys.path.pop(0)
    order, files, by_key = config_trace.trace(PACKAGE.parent)
    assert "train/stage.py" in files and "train/objective.py" in files  # the trace finds reads at all
    assert not set(order) - set(by_key), "a train key no module reads"
    shared = {k: tuple(v) for k, v in by_key.items() if len(v) > 1}
    assert shared == SHARED_TRAIN_KEYS
    # the kinds' objectives take ObjectiveOptions, never the config
    assert not [f for f in files if f.startswith("kinds/") and f.endswith("model.py")]


def test_no_function_of_the_package_is_over_80_lines():
    """docs/architecture.md: a function a reader holds in one screen; a longer one is split at its seams."""
    long = [f"{p.relative_to(PACKAGE.parent)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for p in sorted(PACKAGE.rglob("*.py")) for node in ast.walk(ast.parse(p.read_text(encoding="utf-8")))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 80]
    assert not long, long
