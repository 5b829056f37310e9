"""eval --engine local: speculative decoding equals plain greedy decoding, keeps the target's
distribution when sampling, counts acceptance like vLLM, feeds the drafter vLLM's inputs, and
writes a report that resumes."""

import json
import random
from pathlib import Path

import pytest
import torch

from conftest import build_tiny_target, write_drafter_checkpoint
from draftsmith import DraftsmithError
from draftsmith.config import load_config
from draftsmith.eval.local import SpecDecoder, speculative_verify
from draftsmith.eval.report import read_train_metrics
from draftsmith.eval.stage import ENGINES, drafter_source, run_eval
from draftsmith.export import exported_k, load_exported, run_export
from draftsmith.rundir import RunDir
from draftsmith.target import load_target

AUX = [1, 3, 5]
PROMPTS = [
    "Hello! How can I help you today?",
    "def add(a, b):\n    return a + b",
    "Write a short poem about the sea and the sky.",
    "1 2 3 4 5 6 7 8 9 10, numbers and letters: a b c d e f g",
]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def exported_run(lively_target, tmp_path_factory) -> RunDir:
    run = RunDir(tmp_path_factory.mktemp("evalrun") / "run").ensure()
    write_drafter_checkpoint(run.path / "train" / "final", str(lively_target), aux_layers=AUX, draft_vocab_size=96)
    run_export(run, load_config(None, [f"target={lively_target}"]))
    return run


@pytest.fixture(scope="module")
def loaded(lively_target, exported_run):
    target = load_target(str(lively_target), dtype="float32")
    drafter, info = load_exported(exported_run.path / "export", target_info=target.info,
                                  embed_weight=target.embed_weight(), dtype=target.dtype)
    return target, drafter, info


def decoder(loaded, K, temperature=0.0):
    target, drafter, info = loaded
    return SpecDecoder(target.model, drafter, info["aux_layers"], K, temperature, target.eos_ids())


def encode(loaded, text):
    return loaded[0].tokenizer(text).input_ids


# --- greedy: identical output ---------------------------------------------------------------------


@pytest.mark.parametrize("K", [1, 3])
def test_greedy_equals_plain_decoding(loaded, K):
    dec = decoder(loaded, K)
    for text in PROMPTS:
        ids = encode(loaded, text)
        spec, plain = dec.generate(ids, 40), dec.plain_generate(ids, 40)
        assert spec.tokens == plain.tokens
        assert spec.finish_reason == plain.finish_reason
        assert len(set(plain.tokens)) > 5, "target output too repetitive for a meaningful test"
        assert spec.num_drafts > 0 and spec.num_draft_tokens == K * spec.num_drafts
    dec.close()


def _oracle_decoder(loaded, K, plan):
    """A decoder whose drafts come from the target's own greedy continuation, wrong from the
    position plan() returns (K = all right). Returns (decoder, accepted counts it produced)."""
    dec = decoder(loaded, K)
    dec.eos_ids = set()  # the oracle only knows the continuation up to max_tokens + K
    expected: list[int] = []
    state = {}
    real = dec._draft

    def draft(unread_ids, unread_aux, first_pos, cache, gen):
        real(unread_ids, unread_aux, first_pos, cache, gen)  # keeps the drafter cache as in real use
        # the unread tokens sit at positions first_pos+1 .. first_pos+T: the sequence is one longer
        n_out = first_pos + len(unread_ids) + 1 - state["n_prompt"]
        right = state["oracle"][n_out: n_out + K]
        j = plan()
        drafts = right[:j] + [(t + 1) % dec.vocab_size for t in right[j:]]
        expected.append(j)
        return drafts, None

    dec._draft = draft
    return dec, expected, state


@pytest.mark.parametrize("K", [1, 2, 4])
def test_acceptance_accounting_and_cache_rollback(loaded, K):
    rng = random.Random(K)
    plans = {"perfect": lambda: K, "useless": lambda: 0, "mixed": lambda: rng.randint(0, K)}
    for name, plan in plans.items():
        dec, expected, state = _oracle_decoder(loaded, K, plan)
        for text in PROMPTS[:2]:
            ids = encode(loaded, text)
            expected.clear()
            state["n_prompt"] = len(ids)
            state["oracle"] = dec.plain_generate(ids, 30 + K + 1).tokens
            spec = dec.generate(ids, 30)
            # every accepted count and every cache crop in between still reproduces greedy
            assert spec.tokens == state["oracle"][:30], name
            assert spec.num_drafts == len(expected)
            assert spec.num_accepted == sum(expected)
            assert spec.accepted_per_pos == [sum(1 for a in expected if a > j) for j in range(K)]
            tau = 1 + spec.num_accepted / spec.num_drafts
            if name == "perfect":
                assert tau == K + 1 and spec.accepted_per_pos == [spec.num_drafts] * K
            if name == "useless":
                assert tau == 1 and spec.accepted_per_pos == [0] * K
        dec.close()


def test_drafter_reads_vllm_eagle3_inputs(loaded):
    """Every first drafting call of a round must compute what ttt_forward (training) computes at
    the same positions of the final sequence: token i+1 with the target's aux states at i, keys of
    earlier positions from the drafter cache, which rejections must have rolled back."""
    target, drafter, info = loaded
    K = 3
    dec = decoder(loaded, K)
    calls = []
    inner = drafter.forward

    def spy(input_ids, hidden, position_ids, cache=None):
        logits, h = inner(input_ids, hidden, position_ids, cache)
        if hidden.shape[-1] == 3 * drafter.config.hidden_size:
            calls.append((position_ids[0].tolist(), logits[0]))
        return logits, h

    drafter.forward = spy
    try:
        ids = encode(loaded, PROMPTS[2])
        spec = dec.generate(ids, 30)
    finally:
        del drafter.forward
        dec.close()
    seq = torch.tensor([ids + spec.tokens])
    with torch.no_grad():
        hs = target.model(seq, output_hidden_states=True).hidden_states
        aux = torch.cat([hs[k] for k in AUX], dim=-1)  # hidden_states[k] = the input of layer k
        ref = drafter.ttt_forward(seq, aux, steps=1)[0][0]  # [L, Dv]
    covered = []
    for positions, logits in calls:
        covered += positions
        torch.testing.assert_close(logits, ref[positions], atol=2e-4, rtol=1e-4)
    # the rounds' verified chunks tile the sequence without gaps or overlaps
    assert covered == list(range(len(covered)))
    assert len(calls) == spec.num_drafts


# --- sampling: the target's distribution ---------------------------------------------------------


def test_speculative_sampling_keeps_target_distribution():
    """First and second emitted tokens follow the target's p, not the drafter's q (tiny vocab,
    fixed seeds, 20k trials: a 4-sigma-plus bound)."""
    g = torch.Generator().manual_seed(0)
    V, K, N = 6, 2, 20000
    p_logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 0.3],
                             [0.0, 1.5, -0.5, 1.0, 0.2, -2.0],
                             [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]])  # [K+1, V]
    p = torch.softmax(p_logits, dim=-1)
    q = torch.softmax(torch.tensor([[0.0, 2.0, 1.0, 0.5, 0.5, -1.0],
                                    [1.0, 0.0, 1.0, -1.0, 0.5, 0.0]]), dim=-1)  # [K, V], far from p
    first = torch.zeros(V)
    second = torch.zeros(V)
    first_accepted = 0
    for _ in range(N):
        drafts = [int(torch.multinomial(q[j], 1, generator=g)) for j in range(K)]
        a, nxt = speculative_verify(p_logits, drafts, q, 1.0, g)
        out = drafts[:a] + [nxt]
        first[out[0]] += 1
        if len(out) > 1:
            second[out[1]] += 1
        first_accepted += a >= 1
    assert (first / N - p[0]).abs().max() < 0.015, (first / N, p[0])
    assert (second / second.sum() - p[1]).abs().max() < 0.02, (second / second.sum(), p[1])
    # the first draft is accepted with probability sum(min(p, q)) (Leviathan et al.)
    assert abs(first_accepted / N - torch.minimum(p[0], q[0]).sum().item()) < 0.015
    # sampling from q without verification would fail this test
    assert (q[0] - p[0]).abs().max() > 0.1


def test_speculative_sampling_temperature_and_greedy_limits():
    logits = torch.tensor([[3.0, 1.0, 0.0], [0.0, 3.0, 1.0]])
    assert speculative_verify(logits, [0], None, 0.0) == (1, 1)
    assert speculative_verify(logits, [2], None, 0.0) == (0, 0)
    # a draft that q proposes with certainty and p never takes is always rejected
    g = torch.Generator().manual_seed(0)
    q = torch.tensor([[0.0, 0.0, 1.0]])
    p_logits = torch.tensor([[0.0, 0.0, -1e9], [0.0, 0.0, 0.0]])
    for _ in range(50):
        a, nxt = speculative_verify(p_logits, [2], q, 1.0, g)
        assert a == 0 and nxt in (0, 1)


def test_sampling_decoding_is_seeded_and_consistent(loaded):
    dec = decoder(loaded, 3, temperature=0.8)
    ids = encode(loaded, PROMPTS[0])
    a = dec.generate(ids, 30, torch.Generator().manual_seed(5))
    b = dec.generate(ids, 30, torch.Generator().manual_seed(5))
    dec.close()
    assert a.tokens == b.tokens and len(a.tokens) <= 30
    assert all(0 <= t < loaded[2]["config"].vocab_size for t in a.tokens)
    assert a.num_accepted <= 3 * a.num_drafts
    assert a.accepted_per_pos == sorted(a.accepted_per_pos, reverse=True)


# --- the stage -------------------------------------------------------------------------------------


def _prompts_file(tmp_path: Path) -> Path:
    p = tmp_path / "prompts.jsonl"
    p.write_text("".join(json.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": t}]}) + "\n"
                         for i, t in enumerate(PROMPTS)))
    return p


def _cfg(target, prompts, *sets):
    return load_config(None, [f"target={target}", "dtype=float32", f"eval.prompts={prompts}",
                              "eval.max_tokens=12", "eval.num_speculative_tokens=2", *sets])


def test_run_eval_report_and_resume(exported_run, lively_target, tmp_path, monkeypatch):
    run = exported_run
    prompts = _prompts_file(tmp_path)
    metrics = run.path / "train" / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"step": s, "loss": [3.0 - s / 10, 3.5 - s / 10], "acc": [0.1 * s, 0.05 * s]}) + "\n"
                               for s in range(1, 6)))
    decoded = []
    local = ENGINES["local"]

    def counting(ctx):
        decoded.extend(p.id for _, p in ctx.todo)
        yield from local(ctx)

    monkeypatch.setitem(ENGINES, "local", counting)
    m = run_eval(run, _cfg(lively_target, prompts), warmup=False)
    d = run.path / "eval"
    report = json.loads((d / "report.json").read_text())
    for key in ("engine", "num_speculative_tokens", "temperature", "prompts", "acceptance_length",
                "acceptance_per_position", "tokens_per_s", "baseline_tokens_per_s", "speedup"):
        assert key in report, key
    assert report["engine"] == "local" and report["num_speculative_tokens"] == 2 and report["temperature"] == 0.0
    assert report["prompts"] == 4 and report["max_tokens"] == 12
    assert len(report["acceptance_per_position"]) == 2
    assert report["acceptance_length"] == pytest.approx(1 + report["num_accepted_tokens"] / report["num_drafts"])
    assert report["acceptance_per_position"][0] == pytest.approx(report["num_accepted_tokens_per_pos"][0] / report["num_drafts"])
    assert report["speedup"] == pytest.approx(report["tokens_per_s"] / report["baseline_tokens_per_s"])
    assert report["greedy_same_as_baseline"] == [4, 4]
    # K chosen by speed: the measured K's row is the measurement, the best K has its serve command
    kc = report["k_choice"]
    assert [r["k"] for r in kc["table"]] == [1, 2] and kc["measured_k"] == 2
    assert kc["table"][-1]["speedup"] == pytest.approx(report["speedup"])
    assert kc["serve"]["num_speculative_tokens"] == kc["best_k"] == max(kc["table"], key=lambda r: r["speedup"])["k"]
    assert 0 < report["draft_seconds"] < report["seconds"]
    assert kc["split"]["draft_pass"] > 0 and kc["split"]["verification"] > 0
    assert "## K chosen by speed" in (d / "report.md").read_text()
    lines = (d / "answers.jsonl").read_text().splitlines()
    assert [json.loads(x)["id"] for x in lines] == ["p0", "p1", "p2", "p3"]
    rec = json.loads(lines[0])
    assert rec["baseline"]["same_tokens"] is True and rec["output_tokens"] == len(rec["token_ids"]) <= 12
    assert (d / "report.md").read_text().startswith("# draftsmith eval")
    assert (d / "acceptance.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert m["counts"]["done"] == 4 and (d / "manifest.json").is_file()
    assert decoded == ["p0", "p1", "p2", "p3"]
    # nothing changed: up to date, the manifest is returned as it is (`run` skips the stage)
    assert run_eval(run, _cfg(lively_target, prompts), warmup=False) == m
    assert decoded == ["p0", "p1", "p2", "p3"]

    # a crash after the first answer, with the second cut mid-line: only the rest is decoded
    (d / "answers.jsonl").write_text(lines[0] + "\n" + lines[1][:40])
    run.invalidate("eval")
    decoded.clear()
    run_eval(run, _cfg(lively_target, prompts), warmup=False)
    assert decoded == ["p1", "p2", "p3"]
    lines2 = (d / "answers.jsonl").read_text().splitlines()
    assert [json.loads(x)["id"] for x in lines2] == ["p0", "p1", "p2", "p3"]
    assert json.loads((d / "report.json").read_text())["prompts"] == 4

    # fewer prompts: nothing to decode, answers.jsonl holds exactly the selection
    decoded.clear()
    run_eval(run, _cfg(lively_target, prompts, "eval.limit=2"), warmup=False)
    assert decoded == [] and len((d / "answers.jsonl").read_text().splitlines()) == 2
    # other settings: everything again
    run_eval(run, _cfg(lively_target, prompts, "eval.limit=2", "eval.num_speculative_tokens=1"), warmup=False)
    assert decoded == ["p0", "p1"]
    report = json.loads((d / "report.json").read_text())
    assert report["num_speculative_tokens"] == 1 and len(report["acceptance_per_position"]) == 1
    # auto: the drafts the export serves (its trained steps)
    decoded.clear()
    run_eval(run, _cfg(lively_target, prompts, "eval.num_speculative_tokens=auto"), warmup=False)
    report = json.loads((d / "report.json").read_text())
    trained = exported_k(run.path / "export")
    assert report["num_speculative_tokens"] == trained == 3
    assert decoded == ["p0", "p1", "p2", "p3"]
    decoded.clear()
    run_eval(run, _cfg(lively_target, prompts, f"eval.num_speculative_tokens={trained}"), warmup=False)
    assert decoded == []  # auto resolved before the fingerprint: its K given is the same evaluation


def test_run_eval_sampling(exported_run, lively_target, tmp_path):
    run = RunDir(tmp_path / "r2").ensure()
    # reuse the export: copy the folder with its manifest
    import shutil

    shutil.copytree(exported_run.path / "export", run.path / "export")
    report = json.loads(json.dumps(run_eval(run, _cfg(lively_target, _prompts_file(tmp_path),
                                                        "eval.temperature=0.9", "eval.limit=2"), warmup=False)["report"]))
    full = json.loads((run.path / "eval" / "report.json").read_text())
    assert full["temperature"] == 0.9 and full["greedy_same_as_baseline"] is None
    assert report["acceptance_length"] >= 1.0


def test_eval_of_a_drafter_from_elsewhere(exported_run, lively_target, tmp_path):
    """eval.drafter: a speculators-format folder made elsewhere (here: the export without its
    manifest) is evaluated in a run that has no export stage; changing its weights makes the
    up-to-date eval stale, and a folder that is no drafter is refused in one line."""
    import shutil

    foreign = tmp_path / "peer-drafter"
    shutil.copytree(exported_run.path / "export", foreign, ignore=shutil.ignore_patterns("manifest.json", "*.yaml"))
    run = RunDir(tmp_path / "r3").ensure()
    cfg = _cfg(lively_target, _prompts_file(tmp_path), f"eval.drafter={foreign}", "eval.limit=2")
    m = run_eval(run, cfg, warmup=False)
    report = json.loads((run.path / "eval" / "report.json").read_text())
    assert report["drafter"] == str(foreign.resolve()) and report["prompts"] == 2
    # the same drafter as RUN/export: the same acceptance, since only where it was read from differs
    ref = run_eval(exported_run, _cfg(lively_target, _prompts_file(tmp_path), "eval.limit=2"), warmup=False)
    assert m["report"]["acceptance_length"] == pytest.approx(ref["report"]["acceptance_length"])
    assert run_eval(run, cfg, warmup=False) == m  # up to date
    weights = next(foreign.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes() + b" ")  # any change to the weights' bytes
    assert m["inputs"]["export"] != drafter_source(run, str(foreign))[0]["fingerprint"]
    (foreign / "config.json").unlink()
    with pytest.raises(DraftsmithError, match="eval.drafter=.*not a drafter folder"):
        run_eval(run, cfg, warmup=False)


def test_eval_errors(exported_run, lively_target, tmp_path):
    with pytest.raises(DraftsmithError, match="eval.engine"):
        run_eval(exported_run, _cfg(lively_target, _prompts_file(tmp_path), "eval.engine=sglang"))
    empty = RunDir(tmp_path / "empty").ensure()
    with pytest.raises(DraftsmithError, match="stage 'export' has not completed"):
        run_eval(empty, _cfg(lively_target, _prompts_file(tmp_path)))
    other = build_tiny_target(tmp_path / "other", num_layers=5)
    with pytest.raises(DraftsmithError, match="exported for target"):
        run_eval(exported_run, _cfg(other, _prompts_file(tmp_path)))


def test_read_train_metrics(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text('{"step": 1, "loss": 2.5, "acc_0": 0.1, "acc_1": 0.05}\n'
                 '{"step": 2, "loss": [2.0, 2.5], "acc": [0.2, NaN], "acceptance_length": 1.4}\n'
                 '{"event": "checkpoint"}\n'
                 '{"split": "validation", "step": 2, "loss": [2.1, 2.6], "acc": [0.1, 0.0], "acceptance_length": 1.1}\n'
                 '{"step": 3, "lo')
    rows = read_train_metrics(p)
    assert rows[0] == {"step": 1, "split": "train", "loss": [2.5], "acc": [0.1, 0.05], "tau": None}
    assert rows[1]["loss"] == [2.0, 2.5] and rows[1]["acc"][0] == 0.2 and rows[1]["acc"][1] != rows[1]["acc"][1]
    assert rows[1]["tau"] == 1.4 and rows[2]["split"] == "validation" and rows[2]["tau"] == 1.1
    assert len(rows) == 3


def test_cli_eval(exported_run, lively_target, tmp_path, cli):
    p = cli("eval", "--help")
    assert p.returncode == 0 and "Examples" in p.stdout and "--num-speculative-tokens" in p.stdout
    assert "vllm" in p.stdout.split("--engine")[1].split("--prompts")[0]  # tests/test_evaluate_vllm.py
    run = tmp_path / "r3"
    import shutil

    shutil.copytree(exported_run.path / "export", run / "export")
    p = cli("eval", "--run", str(run), "--prompts", str(_prompts_file(tmp_path)), "--limit", "1",
            "--max-tokens", "4", "-k", "2", "--set", f"target={lively_target}", "--set", "dtype=float32",
            env={"OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr
    assert "acceptance length" in p.stdout
    assert json.loads((run / "eval" / "report.json").read_text())["prompts"] == 1
    # --drafter: a run with no export evaluates a drafter folder from elsewhere
    other = tmp_path / "r4"
    p = cli("eval", "--run", str(other), "--drafter", str(run / "export"), "--prompts", str(_prompts_file(tmp_path)),
            "--limit", "1", "--max-tokens", "4", "-k", "2", "--set", f"target={lively_target}", "--set", "dtype=float32",
            env={"OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr
    assert json.loads((other / "eval" / "report.json").read_text())["drafter"] == str((run / "export").resolve())


# --- the real target -------------------------------------------------------------------------------


@pytest.mark.integration
def test_smollm2_greedy_equals_plain(smol_target, tmp_path):
    run = RunDir(tmp_path / "run").ensure()
    write_drafter_checkpoint(run.path / "train" / "final", smol_target, draft_vocab_size=2048)
    cfg = load_config(None, [f"target={smol_target}", "dtype=float32", "eval.prompts=mt-bench", "eval.limit=2",
                             "eval.max_tokens=16", "eval.num_speculative_tokens=3"])
    run_export(run, cfg)
    run_eval(run, cfg)
    report = json.loads((run.path / "eval" / "report.json").read_text())
    assert report["prompts"] == 2 and report["greedy_same_as_baseline"] == [2, 2]
    assert report["num_drafts"] > 0 and report["acceptance_length"] >= 1.0


# --- agreement with vLLM's counting --------------------------------------------------------------

DASH = 29  # SmolLM2 token "-": the target keeps repeating it after a prompt of 64 of them


def _constant_drafter_run(tmp_path, smol_target) -> RunDir:
    """An export whose drafter always proposes DASH: norm.weight = 0 makes every draft logit 0, so
    the argmax is draft id 0, and d2t = 29 everywhere maps draft id i to target id i + 29."""
    from safetensors.torch import load_file, save_file

    run = RunDir(tmp_path / "const").ensure()
    ck = write_drafter_checkpoint(run.path / "train" / "final", smol_target, draft_vocab_size=8192)
    sd = load_file(str(ck / "model.safetensors"))
    sd["norm.weight"] = torch.zeros_like(sd["norm.weight"])
    sd["d2t"] = torch.full_like(sd["d2t"], DASH)
    t2d = torch.zeros_like(sd["t2d"])
    t2d[DASH: DASH + 8192] = True
    sd["t2d"] = t2d
    save_file(sd, str(ck / "model.safetensors"))
    run_export(run, load_config(None, [f"target={smol_target}"]))
    return run


@pytest.mark.integration
def test_counts_match_vllm_on_a_constant_drafter(smol_target, tmp_path):
    """vLLM 0.32 (measured, /tmp/notes/vllm.md section 5): this drafter, prompt [29] * 64, greedy,
    ignore_eos, 64 tokens -> num_drafts 16, accepted 48, per position 16/16/16. The local engine
    must count the same, including the last step cut by max_tokens."""
    run = _constant_drafter_run(tmp_path, smol_target)
    target = load_target(smol_target, dtype="bfloat16")
    drafter, info = load_exported(run.path / "export", target_info=target.info,
                                  embed_weight=target.embed_weight(), dtype=target.dtype)
    dec = SpecDecoder(target.model, drafter, info["aux_layers"], 3, 0.0, eos_ids=set())
    res = dec.generate([DASH] * 64, 64)
    dec.close()
    assert res.tokens == [DASH] * 64
    assert (res.num_drafts, res.num_accepted, res.accepted_per_pos) == (16, 48, [16, 16, 16])


@pytest.mark.vllm
def test_vllm_serves_export_and_counts_agree(smol_target, tmp_path):
    """A real vLLM server loads the export as is (constant drafter) and reports the same counts as
    the local engine for the same request."""
    import httpx

    from draftsmith.eval.vllm import spec_counters
    from draftsmith.target import target_info
    from draftsmith.vllm_server import VLLMServer

    run = _constant_drafter_run(tmp_path, smol_target)
    spec = {"model": str(run.path / "export"), "method": "eagle3", "num_speculative_tokens": 3}
    log = tmp_path / "vllm.log"
    with VLLMServer(target_info(smol_target).path, log_path=log,
                    extra_args=["--enforce-eager", "--speculative-config", json.dumps(spec)]) as srv:
        r = httpx.post(srv.base_url + "/completions", timeout=300, json={
            "model": srv.models()[0], "prompt": [DASH] * 64, "max_tokens": 64, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True})
        r.raise_for_status()
        counters = spec_counters(srv.metrics_text())
    text = log.read_text(errors="replace")
    assert "Using auxiliary layers from speculative config: (2, 15, 27)" in text
    assert r.json()["choices"][0]["token_ids"] == [DASH] * 64

    per_pos = [counters.per_pos.get(j, 0.0) for j in range(3)]
    assert (counters.drafts, counters.accepted, per_pos) == (16, 48, [16, 16, 16])
