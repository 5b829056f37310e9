import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from draftsmith import DraftsmithError
from draftsmith.host import pick_dtype
from draftsmith.target import (language_model_names, load_target, read_tensor, resolve_target,
                               target_info)
from families import WRAPPERS, make_tiny_wrapper


def test_tiny_target_info(tiny_target):
    info = target_info(str(tiny_target))
    assert info.architecture == "LlamaForCausalLM"
    assert (info.num_layers, info.hidden_size) == (8, 64)
    assert info.has_chat_template
    assert info.default_aux_layers() == [2, 4, 5]
    assert info.fingerprint == target_info(str(tiny_target)).fingerprint


def test_layer_checks(tiny_target):
    info = target_info(str(tiny_target))
    assert info.check_layers([1, 2, 5]) == [1, 2, 5]
    with pytest.raises(DraftsmithError, match=r"extract\.layers: layer id 8 is out of range .*8 layers"):
        info.check_layers([1, 2, 8])
    with pytest.raises(DraftsmithError, match="expected at least 2"):
        info.check_layers([1])
    with pytest.raises(DraftsmithError, match="distinct and increasing"):
        info.check_layers([3, 2, 1])


def test_load_tiny_target_picks_the_fast_dtype_on_cpu(tiny_target):
    import torch

    from draftsmith.host import bf16_is_fast

    t = load_target(str(tiny_target))
    expected = torch.bfloat16 if bf16_is_fast(torch.device("cpu")) else torch.float32
    assert t.device.type == "cpu" and t.dtype == expected
    assert next(t.model.parameters()).dtype == expected
    assert load_target(str(tiny_target), dtype="bfloat16").dtype == torch.bfloat16
    assert not any(p.requires_grad for p in t.model.parameters())
    assert pick_dtype("float32") == torch.float32


def test_bad_targets(tmp_path):
    with pytest.raises(DraftsmithError, match="not a model folder, a .gguf file, or a known name"):
        resolve_target("no-such-model")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DraftsmithError, match=r"empty: no config.json"):
        resolve_target(str(tmp_path / "empty"))
    with pytest.raises(DraftsmithError, match=r"missing\.gguf: GGUF file not found"):
        resolve_target(str(tmp_path / "missing.gguf"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    os.environ["DRAFTSMITH_CACHE"] = str(tmp_path / "cache")
    try:
        with pytest.raises(DraftsmithError, match=r"bad\.gguf: cannot read as a GGUF model"):
            resolve_target(str(bad))
    finally:
        del os.environ["DRAFTSMITH_CACHE"]
    assert not any((tmp_path / "cache" / "models").glob("bad-*-bf16")), "no half-converted folder left behind"
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    with pytest.raises(DraftsmithError, match=r"broken/config\.json: cannot read the model config"):
        target_info(str(broken))


@pytest.mark.integration
def test_smollm2_loads_applies_template_and_runs_forward(smol_target):
    import torch

    t = load_target(smol_target)
    info = t.info
    assert (info.num_layers, info.hidden_size, info.vocab_size) == (30, 576, 49152)
    assert (info.num_attention_heads, info.num_key_value_heads) == (9, 3)
    assert info.has_chat_template and info.tie_word_embeddings
    assert info.default_aux_layers() == [2, 15, 27]
    enc = t.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                          add_generation_prompt=True, return_dict=True, return_tensors="pt")
    text = t.tokenizer.decode(enc["input_ids"][0])
    assert text.endswith("<|im_start|>assistant\n") and "<|im_start|>user\nWhat is the capital of France?<|im_end|>" in text
    with torch.inference_mode():
        out = t.model(input_ids=enc["input_ids"])
    assert out.logits.shape == (1, enc["input_ids"].shape[1], 49152)
    assert torch.isfinite(out.logits).all()
    with torch.inference_mode():
        gen = t.model.generate(**enc, max_new_tokens=8, do_sample=False)
    assert "Paris" in t.tokenizer.decode(gen[0, enc["input_ids"].shape[1]:])


@pytest.mark.integration
def test_conversion_is_safe_against_concurrency_and_crashes(tmp_path, smol_target):
    """Two processes convert the same GGUF at once into a fresh cache that holds the debris of a
    crashed conversion: both end with the same complete folder and no debris is left."""
    cache = tmp_path / "cache"
    debris = cache / "models" / "smollm2-135m-bf16.tmp-999999"
    debris.mkdir(parents=True)
    (debris / "config.json").write_text("{}")  # a crash half-way: never mistaken for finished
    code = "from draftsmith.target import resolve_target; print(resolve_target('smollm2-135m')[0])"
    env = {**os.environ, "DRAFTSMITH_CACHE": str(cache)}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    paths = {o[0].strip().splitlines()[-1] for o in outs}
    assert paths == {str(cache / "models" / "smollm2-135m-bf16")}
    dest = Path(paths.pop())
    assert json.loads((dest / "config.json").read_text())["num_hidden_layers"] == 30
    assert sum("converting" in o[0] for o in outs) == 1, "exactly one process converts"
    assert sorted(p.name for p in (cache / "models").iterdir()) == ["smollm2-135m-bf16", "smollm2-135m-bf16.lock"]


@pytest.mark.parametrize("cores, load, ranks, env, requested, want", [
    (8, 0.0, 1, None, None, 8),      # a quiet machine: every core
    (8, 3.2, 1, None, None, 5),      # three cores busy with other work
    (8, 0.0, 4, None, None, 2),      # four ranks on this node share the cores
    (2, 2.6, 1, None, None, 1),      # oversubscribed: one thread, never zero
    (8, 0.0, 1, "3", None, 3),       # OMP_NUM_THREADS wins over the policy
    (8, 0.0, 1, "3", 6, 6),          # the `threads` key wins over everything
])
def test_thread_policy(monkeypatch, cores, load, ranks, env, requested, want):
    import torch

    from draftsmith.host import thread_policy

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(cores)))
    monkeypatch.setattr("draftsmith.host.busy_cores", lambda: (load, "test"))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(ranks))
    if env is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", env)
    before = torch.get_num_threads()
    try:
        n, line = thread_policy(requested)
        assert n == want and torch.get_num_threads() == want
        assert line.startswith(f"{want} torch thread")
        assert ("the machine is busy" in line) == (load > cores - 0.5 and env is None and requested is None)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("gpu, elastic, omp, want", [
    (True, True, "1", 12),    # torchrun's own 1 on a GPU rank: its share of the cores (host work only)
    (False, True, "1", 1),    # on the CPU the ranks compute: torchrun's 1 stands
    (True, False, "1", 1),    # not under torchrun: someone set 1 on purpose
    (True, True, "4", 4),     # any other number is the user's
])
def test_a_gpu_rank_under_torchrun_gets_its_share_of_the_cores(monkeypatch, gpu, elastic, omp, want):
    """Kimi-K2's offline training: each rank's data thread reads and packs ~0.5 GB of fp8 states a
    micro-batch; with torchrun's OMP_NUM_THREADS=1 its copies ran on one core of the node's 96."""
    from draftsmith.host import threads_per_rank

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(96)))
    monkeypatch.setattr("draftsmith.host.busy_cores", lambda: (0.0, "test"))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.setenv("OMP_NUM_THREADS", omp)
    if elastic:
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "r1")
    else:
        monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    n, line = threads_per_rank(gpu=gpu)
    assert n == want
    assert ("torchrun's OMP_NUM_THREADS=1 not taken" in line) == (want == 12)


def test_launched_ranks_share_the_free_cores(monkeypatch):
    """train.processes=N: the launcher hands each rank its share of the cores the load leaves free
    (torchrun alone would give every rank one thread)."""
    from draftsmith.host import threads_per_rank

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setattr("draftsmith.host.busy_cores", lambda: (4.2, "test"))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert threads_per_rank(None, 2)[0] == 6  # (16 cores - 4 busy) // 2 ranks
    assert threads_per_rank(None, 16)[0] == 1
    assert threads_per_rank(3, 2)[0] == 3


class FakeCuda:
    """torch.cuda as a node of 8 GPUs of 80 GB would answer (the device rule without a GPU)."""

    def __init__(self, monkeypatch, count=8, memory=80e9):
        import torch

        self.current = None
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "set_device", lambda d: setattr(self, "current", d))
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: type("P", (), {"total_memory": memory})())


@pytest.mark.parametrize("spec, local_rank, want", [("auto", "3", "cuda:3"), ("cuda", "5", "cuda:5"),
                                                    ("auto", None, "cuda:0"), ("cuda:1", "5", "cuda:1")])
def test_each_rank_gets_its_own_gpu(monkeypatch, spec, local_rank, want):
    import torch

    from draftsmith.host import pick_device

    cuda = FakeCuda(monkeypatch)
    if local_rank is None:
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    else:
        monkeypatch.setenv("LOCAL_RANK", local_rank)
    dev = pick_device(spec)
    assert dev == torch.device(want) and cuda.current == dev


def test_a_rank_beyond_the_gpus_is_one_line(monkeypatch):
    from draftsmith.host import pick_device

    FakeCuda(monkeypatch, count=2)
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(DraftsmithError, match=r"device: cuda:2 asked for, but this node has 2 GPU\(s\)"):
        pick_device("auto")


@pytest.mark.parametrize("gb, ranks, want", [(16, 1, "one"), (16, 8, "one"), (500, 1, "auto"), (500, 8, "error")])
def test_target_placement(monkeypatch, tmp_path, gb, ranks, want):
    """A target that fits goes straight onto this rank's GPU; a larger one is spread over the node
    for a single process, and refused under torchrun (each rank would need the whole node)."""
    import torch

    from draftsmith.target import TargetInfo, target_device_map

    FakeCuda(monkeypatch)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(ranks))
    with open(tmp_path / "model.safetensors", "wb") as f:  # a sparse file of the weights' size
        f.truncate(int(gb * 1e9))
    info = TargetInfo(name="big", path=str(tmp_path), architecture="LlamaForCausalLM", num_layers=32, hidden_size=4096,
                      vocab_size=128256, num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336,
                      tie_word_embeddings=False, has_chat_template=True, fingerprint="x")
    dev = torch.device("cuda", 0)
    if want == "error":
        with pytest.raises(DraftsmithError, match="do not fit one GPU .* use extract.backend=vllm"):
            target_device_map(info, dev, torch.bfloat16, log=lambda *a: None)
    else:
        assert target_device_map(info, dev, torch.bfloat16, log=lambda *a: None) == ({"": dev} if want == "one" else "auto")
    assert target_device_map(info, torch.device("cpu"), torch.bfloat16) is None


@pytest.mark.parametrize("kind", list(WRAPPERS))
def test_a_wrapper_loads_its_language_model_alone(kind, tmp_path):
    """Gemma 3, Qwen3-VL and Llama 4 wrappers (tests/families.py WRAPPERS), as Kimi-K2.5's in the family tests:
    draftsmith loads the text model alone as a ForCausalLM (Qwen3-VL's decoder under a plain head: transformers
    has no class for it) with no vision tensor, and its logits on text equal the whole wrapper's; the norm, head
    and embedding are found under the language model's own prefix."""
    import transformers as tf

    folder = make_tiny_wrapper(kind, tmp_path / kind)
    info = target_info(str(folder))
    t = load_target(str(folder), device="cpu", dtype="float32", log=lambda *a: None)
    assert type(t.model).__name__.endswith("ForCausalLM")
    assert not any("vision" in k or "visual" in k for k in t.model.state_dict())
    names = language_model_names(info)
    assert names.norm == names.base + "norm.weight" and names.embed == names.base + "embed_tokens.weight"
    assert names.head == {"gemma3": names.embed, "qwen3_vl": "lm_head.weight",
                          "llama4": "language_model.lm_head.weight"}[kind]
    full = getattr(tf, info.architecture).from_pretrained(str(folder), dtype=torch.float32).eval()
    if kind == "llama4":  # its wrapper's forward fails on text alone (transformers 5.24: no `image_outputs`)
        full = full.language_model  # its own Llama4ForCausalLM, as the wrapper loaded it
    ids = torch.randint(10, 40000, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        alone, whole = t.model(input_ids=ids).logits, full(input_ids=ids).logits
    assert alone.std() > 0.1 and torch.allclose(alone, whole, atol=1e-5), (alone - whole).abs().max()
    assert torch.equal(t.final_norm_weight(), read_tensor(folder, names, names.norm).float())


def test_busy_cores_reads_what_runs_now_not_the_load_average(monkeypatch):
    """Right after a busy spell the 1-minute load average still reads ~1 on an idle machine (FACTS.md): the
    rule reads the CPU time of the last fraction of a second instead, so an idle machine gets every core even
    when the average says otherwise, and a spinning process is seen at once."""
    import multiprocessing
    import time as _time

    from draftsmith.host import busy_cores, threads_per_rank

    monkeypatch.setattr("os.getloadavg", lambda: (5.0, 5.0, 5.0))  # a stale average that would say "all busy"
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    idle, how = busy_cores(0.5)
    cores = os.cpu_count()
    assert "/proc/stat" in how and 0 <= idle <= cores + 0.1  # read off /proc/stat, not the stale 5.0
    if idle > cores - 1:
        pytest.skip(f"{idle:.1f} of {cores} cores busy already: no core left to see a spinner on")
    spin = multiprocessing.get_context("spawn").Process(target=_spin, args=(_time.time() + 3.0,))
    spin.start()
    try:
        _time.sleep(0.5)
        loaded, _ = busy_cores(0.5)
    finally:
        spin.join()
    assert loaded >= idle + 0.6, (idle, loaded)  # one more core kept busy by the spinner
    n, line = threads_per_rank(None, 1)
    assert "/proc/stat" in line and n >= 1


def _spin(until: float) -> None:
    import time as _time

    while _time.time() < until:
        pass


def test_a_fused_phi3_layer_reads_as_a_llama_layer(tmp_path):
    """Phi-3's fused qkv_proj and gate_up_proj (its adapter in draftsmith/target/layout.py) split into the Llama
    layer train.init_layer copies: each part is its rows of the fused tensor, and the drafter's layer check takes it."""
    import transformers as tf

    from draftsmith.model.config import DrafterConfig
    from draftsmith.model.init import check_target_layer
    from draftsmith.train.drafter import read_target_layer

    cfg = tf.Phi3Config(vocab_size=128, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                        num_key_value_heads=2, intermediate_size=96, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                        architectures=["Phi3ForCausalLM"])
    tf.Phi3ForCausalLM(cfg).save_pretrained(tmp_path)
    info = target_info(str(tmp_path))
    layer = read_target_layer(info, 2)
    names = language_model_names(info)
    qkv = read_tensor(tmp_path, names, "model.layers.2.self_attn.qkv_proj.weight")  # [(4 + 2 + 2) x 16, 64]
    gate_up = read_tensor(tmp_path, names, "model.layers.2.mlp.gate_up_proj.weight")  # [2 x 96, 64]
    assert layer["self_attn.q_proj.weight"].equal(qkv[:64]) and layer["self_attn.k_proj.weight"].equal(qkv[64:96])
    assert layer["self_attn.v_proj.weight"].equal(qkv[96:]) and layer["mlp.up_proj.weight"].equal(gate_up[96:])
    assert not any("qkv" in k or "gate_up" in k for k in layer)
    check_target_layer(DrafterConfig.from_target_config(info.identity.view(), draft_vocab_size=32), layer)
