"""The GPU check (issues 39, 55): the parts bench/device_check.sh runs, each in its own process under its own timeout.

    python bench/device_check.py probe                      # the distributions this Python lacks, one line
    python bench/device_check.py pipeline --out O --work W  # every stage on the device, hf backends
    python bench/device_check.py online --out O --work W    # train.mode=online on the pipeline's run
    python bench/device_check.py flex --out O               # flex against SDPA, states and gradients, every GPU recipe
    python bench/device_check.py memory --out O             # one real training step's peak beside the fake-tensor one
    python bench/device_check.py speed --out O              # training tokens/s at Llama-8B widths, flex and SDPA
    python bench/device_check.py soak|ranks|extract --out O --work W   # issue 55's parts: bench/device_parts.py
    python bench/device_check.py summary --out O [--parts "pipeline flex ..."]   # one line; O/device_check.json

Each part writes O/<part>.json: {"ok": bool, "device": ..., "seconds": ..., "checks": [...], ...}. On a machine
without CUDA (the CPU rehearsal, tests/test_device_check.py) every part runs the same code at widths a CPU
finishes in seconds, and says so ("cpu fallback"): what the rehearsal proves is that the script, its imports
and the carried wheels work, not the GPU's figures.

What it needs is what the GPU machine has (../shared/FACTS.md): torch with CUDA, transformers, safetensors,
pyyaml, typer, rich, httpx, numpy, matplotlib; pydantic comes from the wheels carried in bench/device/wheels
(bench/device/fetch_wheels.sh). The target is built on the device: random weights from the committed
bench/device/target/config.json (an 8-layer Llama with SmolLM2's tokenizer, committed as text), prompts from
bench/device/prompts.jsonl (64 ShareGPT first turns) and questions.jsonl (8 MT-bench questions).
"""

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import device_parts  # beside this file: issue 55's parts (no torch imported at its top: the probe runs first)

REPO = Path(__file__).resolve().parents[1]
DEVICE_DIR = REPO / "bench" / "device"
# module -> the distributions that provide it; CARRIED: what bench/device/wheels holds
NEEDED = {"torch": "torch", "transformers": "transformers", "safetensors": "safetensors", "yaml": "pyyaml",
          "typer": "typer", "rich": "rich", "httpx": "httpx", "numpy": "numpy", "matplotlib": "matplotlib",
          "pydantic": "pydantic pydantic-core annotated-types typing-inspection typing-extensions"}
CARRIED = {"pydantic"}


def _present(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a finder that refuses the name outright
        return False


def probe() -> int:
    missing = [m for m in NEEDED if not _present(m)]
    lacking = [m for m in missing if m not in CARRIED]
    if lacking:
        print(f"device check: this Python ({sys.executable}) lacks {', '.join(lacking)}, which no carried wheel "
              "provides", file=sys.stderr)
        return 1
    print(" ".join(NEEDED[m] for m in missing))
    return 0


# -------------------------------------------------------------------------------------------------
# The parts (they import torch and draftsmith: the probe above must not)


def device():
    import torch

    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def device_name() -> str:
    import torch

    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
    return f"cpu fallback (no CUDA), torch {torch.__version__}"


class Checks:
    """The part's checks; after each one OUT/<part>.json is written again, so that a part its timeout
    kills still hands back what it measured."""

    def __init__(self, path: Path | None = None, part: str = ""):
        self.items: list[dict] = []
        self.path, self.part = path, part

    def add(self, name: str, ok: bool, detail: str, **figures) -> None:
        print(f"{'ok  ' if ok else 'FAIL'} {name}: {detail}", flush=True)
        self.items.append({"name": name, "ok": bool(ok), "detail": detail, **figures})
        if self.path is not None:
            self.path.write_text(json.dumps({"part": self.part, "ok": False, "device": device_name(),
                                             "unfinished": True, "checks": self.items}, indent=1))

    @property
    def ok(self) -> bool:
        return bool(self.items) and all(c["ok"] for c in self.items)


def build_target(folder: Path) -> Path:
    """The committed config with random weights (seed 0), saved with the committed tokenizer files."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    src = DEVICE_DIR / "target"
    cfg = AutoConfig.from_pretrained(str(src))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(str(folder))
    for f in src.iterdir():
        if f.name != "config.json":
            shutil.copy(f, folder / f.name)
    return folder


def pipeline(out: Path, work: Path, checks: Checks) -> dict:
    """`draftsmith run` through every stage on the device with the in-process backends, as a user runs it."""
    target = build_target(work / "target")
    run = work / "run"
    shutil.rmtree(run, ignore_errors=True)
    gpu = device().type == "cuda"
    sets = [f"target={target}", f"device={'cuda' if gpu else 'cpu'}",
            "generate.backend=local", f"generate.prompts={DEVICE_DIR / 'prompts.jsonl'}",
            f"generate.limit={64 if gpu else 8}", f"generate.max_tokens={64 if gpu else 16}", "generate.batch_size=32",
            "generate.skip_invalid=true", "prepare.max_length=512", "vocab.draft_vocab_size=4096",
            "extract.backend=hf", "train.mode=offline", "train.processes=1", "train.init_layer=null",
            "train.max_minutes=null", "train.epochs=2", f"train.batch_tokens={2048 if gpu else 256}",
            f"train.seq_len={1024 if gpu else 256}", "train.checkpoint_every=1000", "train.log_every_s=5",
            "eval.engine=local", f"eval.prompts={DEVICE_DIR / 'questions.jsonl'}", f"eval.limit={8 if gpu else 2}",
            f"eval.max_tokens={32 if gpu else 8}"]
    # the ranks part trains on this run with the same settings
    (work / "pipeline-sets.json").write_text(json.dumps(sets))
    cmd = [sys.executable, "-m", "draftsmith", "run", str(REPO / "configs" / "demo.yaml"), "--run", str(run)]
    for s in sets:
        cmd += ["--set", s]
    t0 = time.time()
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    (out / "pipeline.log").write_text(p.stdout + p.stderr)
    stages = ("generate", "prepare", "vocab", "extract", "train", "export", "eval")
    manifests = {}
    for s in stages:
        f = run / s / "manifest.json"
        if f.is_file():
            manifests[s] = json.loads(f.read_text())
    done = p.returncode == 0 and set(manifests) == set(stages)
    tail = (p.stdout + p.stderr).strip().splitlines()[-1:] or [""]
    checks.add("every stage on the device", done, f"exit {p.returncode}, stages done: {', '.join(manifests)}"
               + ("" if done else f"; last line: {tail[0][:200]}"))
    figures = {"stage_seconds": {s: m.get("seconds") for s, m in manifests.items()}, "seconds": time.time() - t0}
    if "train" in manifests:
        t = manifests["train"]
        figures["train_peak_memory_bytes"] = t.get("peak_memory_bytes")
        figures["train_tokens"] = (t.get("counts") or {}).get("tokens")
    if "eval" in manifests:
        figures["tau"] = (manifests["eval"].get("report") or {}).get("acceptance_length")
    return figures


def online(out: Path, work: Path, checks: Checks) -> dict:
    """train.mode=online (the Llama recipe's: the target runs in the training process and hands its states to
    each batch) on the pipeline part's prepared data, with its settings: the stage as a user runs it."""
    run = work / "run"
    if not (run / "prepare" / "manifest.json").is_file() or not (work / "pipeline-sets.json").is_file():
        checks.add("online training", False, f"no prepared run at {run}: the pipeline part must run first")
        return {}
    sets = json.loads((work / "pipeline-sets.json").read_text())
    copy = work / "run-online"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("extract", "train", "export", "eval"))
    more = ["train.mode=online", "train.epochs=1"]
    t0 = time.time()
    logs = []
    cmd = [sys.executable, "-m", "draftsmith", "train", "--run", str(copy), "--config",
           str(REPO / "configs" / "demo.yaml")] + [a for x in sets + more for a in ("--set", x)]
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    (out / "pipeline-online.log").write_text(p.stdout + p.stderr)
    f = copy / "train" / "manifest.json"
    m = json.loads(f.read_text()) if f.is_file() else {}
    tokens = (m.get("counts") or {}).get("tokens")
    mode = ((m.get("settings") or {}).get("train") or {}).get("mode")
    ok = p.returncode == 0 and mode == "online" and bool(tokens) and (copy / "train" / "final").is_dir()
    tail = (p.stdout + p.stderr).strip().splitlines()[-1:] or [""]
    checks.add("online training (train.mode=online) on the device", ok,
               f"exit {p.returncode}, {tokens} tokens trained with the target in-process in {time.time() - t0:.0f}s"
               + ("" if ok else f"; last line: {tail[0][:200]}"))
    return {"seconds": time.time() - t0, "tokens": tokens, "peak_memory_bytes": m.get("peak_memory_bytes")}


def _recipe_drafters():
    """{name: DrafterConfig} of the drafters the GPU recipes train (device_parts.RECIPES: Kimi-K2.5's MLA drafter,
    Kimi-K2's GQA drafter, Llama-3.1-8B's), at their real widths, one layer, each with its kind's options."""
    from draftsmith.config import load_config

    out = {}
    for recipe in device_parts.RECIPES:
        cfg = load_config(REPO / "configs" / recipe, [])
        dcfg = device_parts.recipe_drafter(recipe, cfg, num_layers=1)
        out[f"{recipe.split('-', 2)[0]}-{recipe.split('-')[1]} {cfg.train.method}"] = dcfg
    return out


def _paths(d, ids, aux, pos, doc, autocast: bool, names) -> dict:
    """{path: (states, gradients)} of a random linear function of ttt_forward's states."""
    import torch

    dev = ids.device
    kwargs = {"flex": {"attention": "flex"}, "sdpa": {}, "dense": {"attn_block": None}}
    out = {}
    for name in names:
        d.zero_grad()
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast):
            states = d.ttt_forward(ids, aux, 3, position_ids=pos, doc_ids=doc, return_hidden=True, **kwargs[name])
        g = torch.Generator(device=dev).manual_seed(1)
        sum((s.float() * torch.randn(s.shape, device=dev, generator=g)).sum() for s in states).backward()
        out[name] = ([s.detach().float() for s in states],
                     {n: p.grad.clone() for n, p in d.named_parameters() if p.grad is not None})
    return out


def flex(out: Path, checks: Checks) -> dict:
    """Flex attention (what train.attention auto picks on CUDA) against the block-sparse SDPA path and the
    dense mask: the states and every parameter's gradient, float32 (TF32 off) and bf16 autocast, on packed
    documents with padding. The CPU has no flex backward: there, SDPA against the dense mask only."""
    import torch

    from draftsmith import kinds

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = device()
    gpu = dev.type == "cuda"
    names = ("flex", "sdpa", "dense") if gpu else ("sdpa", "dense")
    L = 1000 if gpu else 300
    for cname, cfg in _recipe_drafters().items():
        cfg = cfg if gpu else device_parts.toy(cfg)
        torch.manual_seed(0)
        d = kinds.drafter_class(cfg)(cfg)
        with torch.no_grad():  # random norm weights: a swapped or skipped norm shows
            for n, p in d.named_parameters():
                if n.endswith("norm.weight"):
                    p.uniform_(0.5, 1.5)
        d.to(dev)
        g = torch.Generator().manual_seed(L)
        ids = torch.randint(0, cfg.vocab_size, (2, L), generator=g).to(dev)
        aux = torch.randn(2, L, 3 * cfg.hidden_size, generator=g).to(dev)
        a, b, c = L * 3 // 10, L // 2, L - L * 3 // 10 - L // 2 - 40
        doc = torch.tensor([[0] * L, [0] * a + [1] * b + [2] * c + [0] * 20 + [-1] * 20]).to(dev)
        pos = torch.stack([torch.arange(L), torch.cat([torch.arange(a), torch.arange(b), torch.arange(c),
                                                       torch.arange(20), torch.zeros(20, dtype=torch.long)])]).to(dev)
        for autocast, tol in ((False, 1e-4), (True, 3e-2)):
            res = _paths(d, ids, aux, pos, doc, autocast, names)
            first = names[0]
            for ref in names[1:]:
                fwd = max(_rel(x, y) for x, y in zip(res[first][0], res[ref][0]))
                grad = max(_rel(res[first][1][n], res[ref][1][n]) for n in res[ref][1])
                same = res[first][1].keys() == res[ref][1].keys()
                checks.add(f"{first} == {ref}, {cname} drafter ({cfg.attention}, hidden {cfg.hidden_size}), "
                           f"{'bf16' if autocast else 'fp32'}", same and fwd < tol and grad < tol,
                           f"max relative difference: states {fwd:.2e}, gradients {grad:.2e} (tolerance {tol:g})",
                           states=fwd, gradients=grad)
        del d
        if gpu:
            torch.cuda.empty_cache()
    return {}


def _rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def memory(out: Path, checks: Checks) -> dict:
    """One real training step at the recipes' shapes (bench_train_memory's build and step) on the device:
    torch.cuda.max_memory_allocated of the second step beside the fake-tensor measurement of the same row
    (docs/scaling.md's table). Rows the card cannot hold are left out and named. The CPU has no device
    memory counter: there the smallest row's fake-tensor measurement only, at a toy width."""
    import torch

    sys.path.insert(0, str(REPO / "bench"))
    import bench_train_memory as bm

    figures = {"rows": []}
    if device().type != "cuda":
        from draftsmith.config import load_config

        dcfg = device_parts.toy(_recipe_drafters()["llama-8b eagle3"])
        tc = load_config(None, ["train.ttt_steps=3"]).train
        fake = bm.measure(dcfg, tc, "after", 2, 256)["peak"]
        checks.add("memory (cpu fallback: fake tensors only)", fake > 0, f"toy drafter, 2 x 256 tokens: "
                   f"{fake / 1e6:.1f} MB by fake tensors; no device counter here", fake=fake)
        return figures
    card = torch.cuda.get_device_properties(0).total_memory
    for name in ("llama-8b 4096 ttt3", "kimi-k2 8192 ttt3"):  # the two recipes' shapes; each fake one ~15 s here
        row = bm.ROWS[name]
        fake = bm.measure_row(row, "after")["peak"]
        if fake > 0.9 * card:
            figures["rows"].append({"row": name, "fake": fake, "skipped": "larger than the card"})
            print(f"skip memory {name}: the fake-tensor peak {fake / 1e9:.1f} GB exceeds 90% of the card", flush=True)
            continue
        dcfg, tc, n_rows, online = bm.row_shapes(row)
        torch.cuda.empty_cache()
        objective, optimizer, params, batch, _ = bm.build(dcfg, tc, bm.VARIANTS["after"], n_rows, row.seq_len, online,
                                                       torch.device("cuda"), "bf16", device="cuda")
        objective.cuda()
        bm.train_step(objective, optimizer, params, batch, tc, "bf16")
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        bm.train_step(objective, optimizer, params, batch, tc, "bf16")
        torch.cuda.synchronize()
        real = torch.cuda.max_memory_allocated()
        del objective, optimizer, params, batch, _
        figures["rows"].append({"row": name, "fake": fake, "real": real, "ratio": real / fake})
        checks.add(f"memory {name}", abs(real / fake - 1) < 0.10,
                   f"max_memory_allocated {real / 1e9:.2f} GB, fake tensors {fake / 1e9:.2f} GB (ratio {real / fake:.3f})")
    return figures


def speed(out: Path, checks: Checks) -> dict:
    """Forward + backward of ttt_forward at Llama-8B's drafter widths (4 x 4,096 tokens, 3 TTT steps, bf16),
    flex and SDPA, best of 3 after a warm-up (flex's compile): training tokens/s of the step's attention and
    layers (the loss and optimizer are bench_train.py's)."""
    import torch

    from draftsmith import kinds

    dev = device()
    gpu = dev.type == "cuda"
    cfg = _recipe_drafters()["llama-8b eagle3"]
    cfg = cfg if gpu else device_parts.toy(cfg)
    rows, L = (4, 4096) if gpu else (1, 256)
    torch.manual_seed(0)
    d = kinds.drafter_class(cfg)(cfg).to(dev)
    ids = torch.randint(0, cfg.vocab_size, (rows, L), device=dev)
    aux = torch.randn(rows, L, 3 * cfg.hidden_size, device=dev, dtype=torch.bfloat16 if gpu else torch.float32)
    figures = {}
    for name, kw in ((("flex", {"attention": "flex"}),) if gpu else ()) + (("sdpa", {}),):
        best = None
        for rep in range(4):
            if gpu:
                torch.cuda.synchronize()
            t = time.perf_counter()
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=gpu):
                states = d.ttt_forward(ids, aux, 3, return_hidden=True, **kw)
            sum(s.float().square().mean() for s in states).backward()
            if gpu:
                torch.cuda.synchronize()
            if rep:
                best = min(best or 1e9, time.perf_counter() - t)
            d.zero_grad(set_to_none=True)
        figures[f"{name}_tokens_per_s"] = rows * L / best
    detail = ", ".join(f"{k.split('_')[0]} {v:,.0f} tokens/s" for k, v in figures.items())
    checks.add(f"training speed at {'Llama-8B' if gpu else 'toy (cpu fallback)'} drafter widths",
               all(v > 0 for v in figures.values()), f"{rows} x {L} tokens, 3 TTT steps: {detail}", **figures)
    return figures


PARTS = {"pipeline": pipeline, "online": online, "flex": flex, "memory": memory, "speed": speed, "soak": device_parts.soak,
         "ranks": device_parts.ranks, "extract": device_parts.extract}
WITH_WORK = {"pipeline", "online", "soak", "ranks", "extract"}  # parts that take the scratch folder too


def run_part(name: str, out: Path, work: Path | None) -> int:
    checks = Checks(out / f"{name}.json", name)
    t0 = time.time()
    try:
        figures = PARTS[name](out, work, checks) if name in WITH_WORK else PARTS[name](out, checks)
    except Exception as e:  # the part's own failure, recorded as such: the next part still runs
        checks.add(name, False, f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
        figures = {}
    result = {"part": name, "ok": checks.ok, "device": device_name(), "seconds": round(time.time() - t0, 1),
              "checks": checks.items, **figures}
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    return 0 if checks.ok else 1


def summary(out: Path, names: list[str]) -> int:
    parts = {}
    for name in names:
        f = out / f"{name}.json"
        parts[name] = json.loads(f.read_text()) if f.is_file() else {"part": name, "ok": False,
                                                                     "checks": [], "missing": "no result (timed out?)"}
    ok = all(p["ok"] for p in parts.values())
    dev = next((p["device"] for p in parts.values() if p.get("device")), "?")
    bits = [f"{n} {'ok' if p['ok'] else 'cut by its timeout' if p.get('unfinished') else 'FAILED'}"
            + (f" ({p['seconds']:.0f}s)" if p.get("seconds") else "") for n, p in parts.items()]
    sp = parts.get("speed", {})
    if sp.get("flex_tokens_per_s") or sp.get("sdpa_tokens_per_s"):
        bits.append("train " + ", ".join(f"{k.split('_')[0]} {sp[k]:,.0f} tok/s" for k in ("flex_tokens_per_s", "sdpa_tokens_per_s")
                                         if sp.get(k)))
    mem = [r for r in parts.get("memory", {}).get("rows", []) if r.get("real")]
    if mem:
        bits.append("memory real/fake " + ", ".join(f"{r['row']} {r['ratio']:.3f}" for r in mem))
    for r in parts.get("soak", {}).get("drafters", []):
        bits.append(f"soak {r['drafter']}: {r['graphs']} graphs, {r['tokens_per_s']:,.0f} tok/s "
                    f"({r['rate_ratio']:.2f} of the estimate)"
                    + (f", peak/estimate {r['ratio']:.3f}" if "ratio" in r else ""))
    if parts.get("extract", {}).get("samples_per_s"):
        bits.append(f"extract host {parts['extract']['samples_per_s']:.1f} samples/s")
    line = f"device check on {dev}: {'PASSED' if ok else 'FAILED'}; " + "; ".join(bits)
    (out / "device_check.json").write_text(json.dumps({"ok": ok, "device": dev, "line": line, "parts": parts,
                                                       "time": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())},
                                                      indent=1))
    print(line, flush=True)
    return 0 if ok else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("part", choices=["probe", *PARTS, "summary"])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/draftsmith-device-check")))
    ap.add_argument("--work", type=Path, default=None, help="scratch folder (the pipeline's target and run)")
    ap.add_argument("--parts", default=" ".join(PARTS), help="summary: the parts that ran (space-separated)")
    args = ap.parse_args()
    if args.part == "probe":
        return probe()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.part == "summary":
        return summary(args.out, args.parts.split())
    work = args.work or args.out / "work"
    return run_part(args.part, args.out, work)


if __name__ == "__main__":
    sys.exit(main())
