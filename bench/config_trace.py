"""Where each `train.*` key of the YAML is read in the code: the files a reader follows from the config to where the
key acts (issue 57's measure of how spread the training config is).

    .venv/bin/python bench/config_trace.py [REPO]      # REPO: a checkout (default: this one)

Static and a lower bound: a read is `<x>.train.<key>`, or `<alias>.<key>` where the alias is bound to `<x>.train`
(an assignment, a parameter named tc, train_cfg or train or typed TrainConfig, an attribute named so); a value
passed on as an argument is followed no further. The keys are TrainConfig's fields in config.py. Prints the files
that read keys, the keys read in more than one file (those a reader must follow across files), and the walk: the
keys in the order TrainConfig declares them (the order the YAML's reference documents them), each followed into the
files that read it (by name); the files it crosses, and how often it comes back to a file it had left.
"""

import ast
import sys
from pathlib import Path

ALIAS_NAMES = ("tc", "train_cfg", "train")


def train_keys(root: Path) -> list[str]:
    """TrainConfig's fields, in the order config.py declares them."""
    tree = ast.parse((root / "draftsmith" / "config.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "TrainConfig":
            return [n.target.id for n in node.body if isinstance(n, ast.AnnAssign)]
    raise SystemExit(f"{root}/draftsmith/config.py: no TrainConfig")


def walk(keys: list[str], by_key: dict[str, list[str]]) -> tuple[int, int]:
    """(files crossed, returns to a file already left) following `keys` in order into the files reading each."""
    path = [f for k in keys for f in sorted(by_key.get(k, []))]
    entered = [f for i, f in enumerate(path) if i == 0 or path[i - 1] != f]
    return len(set(path)), len(entered) - len(set(entered))


def is_train(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "train"


def keys_read(path: Path, keys: set[str]) -> set[str]:
    tree = ast.parse(path.read_text())
    aliases = set(ALIAS_NAMES)
    for n in ast.walk(tree):
        if isinstance(n, ast.Assign) and is_train(n.value):
            aliases |= {x.id for x in n.targets if isinstance(x, ast.Name)}
        if isinstance(n, ast.arg) and n.annotation is not None and "TrainConfig" in ast.unparse(n.annotation):
            aliases.add(n.arg)
    read = set()
    for n in ast.walk(tree):
        if not (isinstance(n, ast.Attribute) and n.attr in keys):
            continue
        holder = n.value
        name = holder.id if isinstance(holder, ast.Name) else holder.attr if isinstance(holder, ast.Attribute) else None
        if is_train(holder) or name in aliases:
            read.add(n.attr)
    return read


def trace(root: Path) -> tuple[list[str], dict[str, set[str]], dict[str, list[str]]]:
    """(the train keys in declaration order, {file: keys it reads}, {key: files that read it, by name})."""
    order = train_keys(root)
    keys = set(order)
    files = {}
    for path in sorted((root / "draftsmith").rglob("*.py")):
        if path.name != "config.py" and (read := keys_read(path, keys)):
            files[str(path.relative_to(root / "draftsmith"))] = read
    by_key: dict[str, list[str]] = {}
    for name, read in files.items():
        for k in read:
            by_key.setdefault(k, []).append(name)
    return order, files, {k: sorted(v) for k, v in sorted(by_key.items())}


def main(root: Path) -> None:
    order, files, by_key = trace(root)
    print(f"{len(order)} train keys; {len(files)} files read them; {sum(map(len, files.values()))} (file, key) reads")
    for name, read in sorted(files.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        print(f"  {len(read):3d} {name}")
    spread = {k: v for k, v in by_key.items() if len(v) > 1}
    print(f"keys read in more than one file: {len(spread)}; never read: {sorted(set(order) - set(by_key)) or 'none'}")
    for k, names in spread.items():
        print(f"  {k}: {', '.join(names)}")
    crossed, returns = walk(order, by_key)
    print(f"the walk in TrainConfig's order: {crossed} files crossed, {returns} returns to a file it had left")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1])
