"""`draftsmith estimate`: parameter counts from a config.json equal the real model's, and the
printed disk figure for the extract store is what extract writes per token."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from draftsmith.config import load_config
from draftsmith.estimate import (HARDWARE, _drafter_params, estimate, rate_sources, render, target_shape,
                                 train_memory)

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def memory_bench():
    """bench/bench_train_memory.py, the measurement of a training step's memory on fake tensors."""
    spec = importlib.util.spec_from_file_location("bench_train_memory", REPO / "bench" / "bench_train_memory.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _count(model) -> int:
    return sum(p.numel() for p in model.parameters())


def _save(cfg, tmp_path: Path, name: str) -> Path:
    path = tmp_path / f"{name}.json"
    path.write_text(cfg.to_json_string())
    return path


def test_dense_llama_count_equals_the_model(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    for tied in (True, False):
        cfg = LlamaConfig(vocab_size=500, hidden_size=64, intermediate_size=176, num_hidden_layers=3,
                          num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
        shape = target_shape(_save(cfg, tmp_path, f"llama{tied}"))
        # norms (a few hundred parameters) are the only thing not counted
        assert abs(shape.total_params - _count(LlamaForCausalLM(cfg))) <= 64 * (2 * 3 + 1)
        assert shape.active_params == shape.total_params and shape.experts == 0


def test_moe_counts_equal_the_models(tmp_path):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, MixtralConfig, MixtralForCausalLM

    mix = MixtralConfig(vocab_size=500, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=6, num_experts_per_tok=2)
    model = MixtralForCausalLM(mix)
    shape = target_shape(_save(mix, tmp_path, "mixtral"))
    assert abs(shape.total_params - _count(model)) <= 64 * 5
    expert = 3 * 64 * 96
    assert shape.total_params - shape.active_params == 2 * (6 - 2) * expert

    ds = DeepseekV3Config(vocab_size=500, hidden_size=64, intermediate_size=160, moe_intermediate_size=32,
                          num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=8, n_shared_experts=1,
                          num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24,
                          kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, n_group=1, topk_group=1)
    model = DeepseekV3ForCausalLM(ds)
    shape = target_shape(_save(ds, tmp_path, "deepseek"))
    # norms and the router's bias are left out: a few hundred parameters
    assert abs(shape.total_params - _count(model)) <= 600, (shape.total_params, _count(model))


def test_kimi_recipe_estimate_matches_the_case_we_learn_from():
    """10,000 samples of ~2,100 tokens (21 M tokens): the store is ~0.6 TB in fp8 (the default) and
    ~1.2 TB in bf16 with 4 layers of 7168 (the case wrote 828 GB of bf16 for 3), and generation takes
    hours, not minutes or days."""
    shape = target_shape(REPO / "configs" / "targets" / "kimi-k2-instruct.json", attention="gqa")
    assert 0.95e12 < shape.total_params < 1.1e12 and 28e9 < shape.active_params < 36e9
    cfg = load_config(REPO / "configs" / "kimi-k2-8xh200.yaml")
    e = estimate(cfg, shape, HARDWARE["h200"], 8, prompt_tokens=300, answer_tokens=1800)
    from draftsmith.store_format import bytes_per_token

    assert e["stages"]["extract"]["disk"] == e["tokens"] * bytes_per_token(3, 7168, cfg.extract.store_format)
    assert cfg.extract.store_format == "fp8" and 0.5e12 < e["stages"]["extract"]["disk"] < 0.7e12
    bf16 = estimate(load_config(REPO / "configs" / "kimi-k2-8xh200.yaml", ["extract.store_format=bf16"]), shape,
                    HARDWARE["h200"], 8, prompt_tokens=300, answer_tokens=1800)
    assert 1.0e12 < bf16["stages"]["extract"]["disk"] < 1.4e12
    assert 2 * 3600 < e["stages"]["generate"]["seconds"] < 10 * 3600
    assert e["stages"]["generate"]["memory"] < HARDWARE["h200"].mem  # the fp8 weights fit across 8 GPUs


def test_cli_prints_estimate_and_rejects_unknown_hardware(cli):
    p = cli("estimate", "configs/demo.yaml", "--json", check=True)
    e = json.loads(p.stdout)
    assert e["target"] == "SmolLM2-135M-Instruct" and set(e["stages"]) >= {"generate", "extract", "train", "eval"}
    assert all(s["seconds"] > 0 for s in e["stages"].values())
    p = cli("estimate", "configs/demo.yaml", "--hardware", "tpu")
    assert p.returncode == 2 and p.stderr.strip().count("\n") == 0 and "--hardware tpu" in p.stderr
    for bad, named in ((["--answer-tokens", "0"], "--answer-tokens 0"),
                       (["--prompt-tokens", "-5"], "--prompt-tokens -5"), (["--load-rate", "0"], "--load-rate 0")):
        p = cli("estimate", "configs/demo.yaml", *bad)
        assert p.returncode == 2 and p.stderr.strip().count("\n") == 0 and named in p.stderr, p.stderr


def test_backend_dataset_decodes_nothing():
    """Backend dataset keeps the file's replies: generate costs tokenizing, not hours of decoding,
    and loads no weights; the stages after it are estimated as for regenerated answers."""
    shape = target_shape(REPO / "configs" / "targets" / "kimi-k2-instruct.json", attention="gqa")
    cfg = load_config(REPO / "configs" / "kimi-k2-8xh200.yaml")
    served = estimate(cfg, shape, HARDWARE["h200"], 8, prompt_tokens=300, answer_tokens=1800)
    cfg.generate.backend = "dataset"
    kept = estimate(cfg, shape, HARDWARE["h200"], 8, prompt_tokens=300, answer_tokens=1800)
    assert kept["tokens_per_s"]["generate"] is None and served["tokens_per_s"]["generate"] > 0
    assert kept["stages"]["generate"]["seconds"] < 60 < served["stages"]["generate"]["seconds"]
    assert kept["stages"]["generate"]["memory"] < served["stages"]["generate"]["memory"]
    assert kept["stages"]["extract"] == served["stages"]["extract"] and kept["stages"]["train"] == served["stages"]["train"]
    from draftsmith.estimate import render

    assert "generate none (backend dataset" in render(kept)


def test_more_answers_per_prompt_cost_as_more_samples():
    shape = target_shape(REPO / "configs" / "targets" / "kimi-k2-instruct.json", attention="gqa")
    cfg = load_config(REPO / "configs" / "kimi-k2-8xh200.yaml")
    one = estimate(cfg, shape, HARDWARE["h200"], 8, prompt_tokens=300, answer_tokens=1800)
    cfg.generate.answers_per_prompt = 3
    three = estimate(cfg, shape, HARDWARE["h200"], 8, prompt_tokens=300, answer_tokens=1800)
    for stage in ("generate", "extract", "train"):  # the work scales; the servers' starts do not
        work = [e["stages"][stage]["seconds"] - e["stages"][stage].get("load_s", 0) for e in (one, three)]
        assert work[1] == pytest.approx(3 * work[0], rel=0.01)
        assert three["stages"][stage].get("load_s") == one["stages"][stage].get("load_s")
    assert three["stages"]["extract"]["disk"] == pytest.approx(3 * one["stages"]["extract"]["disk"], rel=0.01)


def test_cpu_training_ranks_take_their_share_of_each_step():
    """train.processes on a CPU: a step of max_steps takes batch_tokens from every rank, and two
    one-thread ranks train faster than one process (the measured gain); a GPU profile counts
    its devices as the ranks and ignores the setting."""
    from draftsmith.target import resolve_target

    folder, name = resolve_target("smollm2-135m", log=lambda *a, **k: None)
    shape = target_shape(folder / "config.json", name)
    cfg = load_config(REPO / "configs" / "smollm2-cpu-400.yaml")
    assert cfg.train.processes == 2 and cfg.train.max_steps
    two = estimate(cfg, shape, HARDWARE["cpu"], 1, prompt_tokens=100, answer_tokens=218)
    cfg.train.processes = 1
    one = estimate(cfg, shape, HARDWARE["cpu"], 1, prompt_tokens=100, answer_tokens=218)
    assert two["stages"]["train"]["tokens"] == pytest.approx(2 * one["stages"]["train"]["tokens"])
    assert two["tokens_per_s"]["train"] == pytest.approx(HARDWARE["cpu"].cpu_ranks_gain * one["tokens_per_s"]["train"])
    step_tokens = cfg.train.max_steps * cfg.train.batch_tokens * 2
    assert two["stages"]["train"]["tokens"] == pytest.approx(step_tokens, rel=0.02)
    gpu_one = estimate(cfg, shape, HARDWARE["h200"], 1, prompt_tokens=100, answer_tokens=218)
    cfg.train.processes = 2
    gpu_two = estimate(cfg, shape, HARDWARE["h200"], 1, prompt_tokens=100, answer_tokens=218)
    assert gpu_two["stages"]["train"] == gpu_one["stages"]["train"]


def test_drafter_size_follows_train_num_layers():
    """The estimate's drafter is the model/eagle3.py drafter: its trainable parameters for 1 and 2 decoder
    layers (norm weights aside), and a second layer slows the training estimate accordingly."""
    import torch
    from transformers import AutoConfig

    from draftsmith.model.config import DrafterConfig
    from draftsmith.model.eagle3 import Eagle3Drafter
    from draftsmith.target import resolve_target

    folder, name = resolve_target("smollm2-135m", log=lambda *a, **k: None)
    shape = target_shape(folder / "config.json", name)
    cfg = load_config(REPO / "configs" / "smollm2-cpu-400.yaml")
    hf = AutoConfig.from_pretrained(folder)
    got = {}
    for n in (1, 2):
        cfg.train.num_layers = n
        got[n] = estimate(cfg, shape, HARDWARE["cpu"], 1, prompt_tokens=100, answer_tokens=218)
        with torch.device("meta"):
            model = Eagle3Drafter(DrafterConfig.from_target_config(hf, cfg.vocab.draft_vocab_size, num_hidden_layers=n))
        real = sum(p.numel() for name_, p in model.named_parameters() if p.requires_grad and "norm" not in name_)
        assert got[n]["drafter_params"] == real
    assert got[2]["tokens_per_s"]["train"] < 0.8 * got[1]["tokens_per_s"]["train"]
    assert got[2]["stages"]["train"]["seconds"] > got[1]["stages"]["train"]["seconds"]


def test_a_fake_training_step_counts_the_bytes_a_real_one_allocates(memory_bench):
    """The memory bench's fake-tensor step (float tensors without data, integer ones real) counts,
    byte for byte, what the same step on real tensors allocates: in bf16 autocast and float32, with
    the whole-batch loss and the chunked one (tiny shapes, SDPA: the CPU has no flex backward)."""
    from draftsmith.model.config import DrafterConfig

    tc = load_config(None, ["train.ttt_steps=2"]).train
    dcfg = DrafterConfig(hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2,
                        vocab_size=3000, draft_vocab_size=1000)
    for variant in ("before", {"attention": "sdpa", "chunk_tokens": 100}):
        for precision in ("bf16", "fp32"):
            fake, real = (memory_bench.measure(dcfg, tc, variant, 2, 300, fake=f, precision=precision) for f in (True, False))
            assert fake == real and fake["peak"] > 2 * fake["resident"], (variant, precision, fake, real)


@pytest.mark.parametrize("row", ["llama-8b 4096 ttt3", "kimi-k2 8192 ttt7", "kimi-k2.5 mla 8192 ttt7"])
def test_training_memory_estimate_agrees_with_the_measured_step(memory_bench, row):
    """`estimate`'s training memory is within 15 % of the step measured at the recipes' shapes, and
    the recipes' steps fit their GPUs by that measurement (Llama-8B beside its bf16 target on an
    H100; Kimi-K2 on an H200 with DDP's gradient buckets; Kimi-K2.5's MLA drafter, by its own shapes)."""
    r = memory_bench.ROWS[row]
    cfg = r.config()
    shape = target_shape(REPO / r.target_config, attention=cfg.train.drafter_attention)  # the recipe's drafter
    hw = HARDWARE[r.hardware]
    measured = memory_bench.measure_row(r, "after")["peak"]
    est = train_memory(cfg.train, shape, hw, r.devices, cfg.vocab.draft_vocab_size)
    # DDP's gradient buckets (4 B per trainable parameter), on the multi-GPU rows
    buckets = 4 * _drafter_params(shape, cfg.vocab.draft_vocab_size, cfg.train.num_layers)[0] if r.devices > 1 else 0
    assert abs(est["total"] / (measured + buckets) - 1) < 0.15, (row, est, measured + buckets)
    assert measured + buckets < hw.mem
    recipe = load_config(REPO / r.recipe)
    e = estimate(recipe, shape, hw, r.devices, prompt_tokens=300, answer_tokens=800)
    assert e["train_memory"]["fits_with"] == [] and e["stages"]["train"]["memory"] < hw.mem


def test_estimate_says_which_knob_makes_training_fit():
    """A step too big for the device: the estimate names the micro-batch, the TTT depth and FSDP
    settings that each make it fit, and each of them does fit."""
    shape = target_shape(REPO / "configs" / "targets" / "kimi-k2-instruct.json", attention="gqa")
    # (a drafter with 8 kv heads of 128, the MLA rule of model/config.py: these settings are just over an H200)
    cfg = load_config(REPO / "configs" / "kimi-k2-8xh200.yaml", ["train.batch_tokens=24576", "train.ttt_steps=9"])
    hw = HARDWARE["h200"]
    e = estimate(cfg, shape, hw, 8, prompt_tokens=300, answer_tokens=1800)
    knobs = e["train_memory"]["fits_with"]
    assert e["train_memory"]["total"] > hw.mem and len(knobs) == 3, knobs
    assert knobs[0].startswith("train.batch_tokens=") and knobs[1].startswith("train.ttt_steps=") and knobs[2].startswith("train.fsdp=true")
    for change in ({"batch_tokens": int(knobs[0].split("=")[1].split()[0])},
                   {"ttt_steps": int(knobs[1].split("=")[1])}, {"fsdp": True}):
        assert train_memory(cfg.train.model_copy(update=change), shape, hw, 8, 32000)["total"] <= hw.mem
    assert "train does not fit" in render(e) and "train.fsdp=true" in render(e)
    # one GPU: no FSDP to offer, and not even one row of 8,192 tokens at 12 TTT steps fits an H100
    cfg = load_config(REPO / "configs" / "kimi-k2-8xh200.yaml", ["train.ttt_steps=12"])
    knobs = estimate(cfg, shape, HARDWARE["h100"], 1, prompt_tokens=300, answer_tokens=1800)["train_memory"]["fits_with"]
    assert not any("fsdp" in k for k in knobs) and any(k.startswith("train.seq_len=") or k.startswith("train.ttt_steps=") for k in knobs)


def test_a_wrappers_quantization_name_and_what_does_not_fit(tmp_path):
    """A multimodal wrapper (Kimi-K2.5's shape: text_config inside, quantization_config at the top):
    its int4 compressed-tensors weights count 4.5 bits a parameter (4 and a bf16 scale per group of 32), not
    16; the target is named
    after the file, not the folder it sits in; a stage whose weights per device exceed the device
    says so in a line."""
    text = json.loads((REPO / "configs" / "targets" / "kimi-k2-instruct.json").read_text())
    text.pop("quantization_config", None)
    text.pop("_name_or_path", None)
    int4 = {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "int", "group_size": 32},
                                          "targets": ["Linear"]}}}
    wrapper = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
               "text_config": text, "vision_config": {"hidden_size": 1152}, "quantization_config": int4}
    path = tmp_path / "kimi-k2.5.json"
    path.write_text(json.dumps(wrapper))
    shape = target_shape(path)
    assert shape.name == "kimi-k2.5" and shape.weight_bytes_per_param == 4.5 / 8
    assert 0.5e12 < shape.weight_bytes < 0.62e12  # ~1.03 T parameters at 4.5 bits
    for qc, want in (({"quant_method": "modelopt", "quant_algo": "NVFP4"}, 4.5 / 8), ({"quant_method": "fp8"}, 1),
                     ({"quant_method": "gptq", "bits": 8}, 1), ({"quant_method": "gptq", "bits": 4, "group_size": 128},
                                                                (4 + 20 / 128) / 8),
                     ({"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {
                         "num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 128}}}},
                      (4 + 20 / 128) / 8),
                     ({"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {
                         "num_bits": 8, "type": "float", "strategy": "channel"}}}}, 1)):
        path.write_text(json.dumps({**wrapper, "quantization_config": qc}))
        assert target_shape(path).weight_bytes_per_param == want, qc
    path.write_text(json.dumps({**wrapper, "quantization_config": {}}))  # bf16: 2 TB over one H200
    cfg = load_config(REPO / "configs" / "kimi-k2-8xh200.yaml")
    e = estimate(cfg, target_shape(path), HARDWARE["h200"], 1, prompt_tokens=300, answer_tokens=1800)
    assert {"generate", "extract", "eval"} <= set(e["does_not_fit"])
    assert "generate does not fit: 2.1 TB of weights per device exceed vLLM's cap of 126.9 GB" in render(e)
    fits = estimate(cfg, shape, HARDWARE["h200"], 8, prompt_tokens=300, answer_tokens=1800)
    assert fits["does_not_fit"] == {} and "does not fit" not in render(fits).replace("train does not fit", "")


def test_kimi_k25_int4_weights_within_ten_percent_of_the_released_checkpoint():
    """configs/targets/kimi-k2.5.json (the released config's sizing fields): routed experts in int4 groups of 32
    with a bf16 scale each, the rest bf16 by its `ignore` list. The released checkpoint takes ~595 GB (its
    published size; no network here to list its files): the estimate's weights within 10 % of it."""
    shape = target_shape(REPO / "configs" / "targets" / "kimi-k2.5.json")
    assert abs(shape.weight_bytes / 595e9 - 1) < 0.10, shape.weight_bytes
    assert 1.0e12 < shape.total_params < 1.06e12  # "1T parameters"


def test_offline_training_and_vllm_extraction_are_bounded_by_their_host_work(monkeypatch):
    """Offline, a step runs no faster than its ranks' data threads pack the store's bytes
    (bench/bench_data_thread.py's rate); through vLLM, extraction no faster than its requests'
    host work (read, check, norm, quantise) on extract.concurrency threads, at most the host's cores."""
    import draftsmith.estimate as est
    from draftsmith.store_format import bytes_per_token

    shape = target_shape(REPO / "configs" / "targets" / "kimi-k2-instruct.json", attention="gqa")
    cfg = load_config(REPO / "configs" / "kimi-k2-8xh200.yaml", ["extract.backend=vllm", "extract.concurrency=4"])
    e = estimate(cfg, shape, HARDWARE["h200"], 8, prompt_tokens=300, answer_tokens=1800)
    tps, stored = e["tokens_per_s"], bytes_per_token(3, 7168, "fp8")
    assert tps["train_data_thread"] == pytest.approx(8 * est.DATA_THREAD_BYTES_PER_S / stored)
    assert tps["train"] == min(tps["train_compute"], tps["train_data_thread"], HARDWARE["h200"].disk_bw / stored)
    assert tps["extract_host"] == pytest.approx(4 * est.EXTRACT_HOST_BYTES_PER_S / (4 * 7168 * 2))
    monkeypatch.setattr(est, "DATA_THREAD_BYTES_PER_S", 1e6)
    monkeypatch.setattr(est, "EXTRACT_HOST_BYTES_PER_S", 1e6)
    slow = estimate(cfg, shape, HARDWARE["h200"], 8, prompt_tokens=300, answer_tokens=1800)
    assert slow["tokens_per_s"]["train"] == pytest.approx(8e6 / stored)  # the data threads bind
    slow_extract = slow["stages"]["extract"]
    assert slow_extract["seconds"] - slow_extract["load_s"] == pytest.approx(e["tokens"] / (4e6 / (4 * 7168 * 2)))
    rendered = est.render(slow)
    assert "host work per request" in rendered and "data threads" in rendered
    cfg.extract.backend = "hf"  # states computed in-process: no connector files to read
    assert estimate(cfg, shape, HARDWARE["h200"], 8, prompt_tokens=300, answer_tokens=1800)[
        "tokens_per_s"]["extract_host"] is None


def test_train_max_minutes_caps_the_estimated_training():
    """The demo trains by the clock (train.max_minutes) over at most train.epochs passes: the estimate's
    training is the clock's minutes when they hold fewer passes, the passes' time otherwise."""
    from draftsmith.target import resolve_target

    folder, name = resolve_target("smollm2-135m", log=lambda *a, **k: None)
    shape = target_shape(folder / "config.json", name)
    cfg = load_config(REPO / "configs" / "demo.yaml")
    assert cfg.train.max_minutes == 6
    e = estimate(cfg, shape, HARDWARE["cpu"], 1, prompt_tokens=100, answer_tokens=110)
    assert e["stages"]["train"]["seconds"] == pytest.approx(360)
    cfg.train.max_minutes = 1e6
    assert estimate(cfg, shape, HARDWARE["cpu"], 1, prompt_tokens=100, answer_tokens=110)["stages"]["train"][
        "tokens"] == pytest.approx(cfg.train.epochs * e["tokens"])


def test_dflash_and_muon_estimates_say_they_are_upper_bounds():
    """The train figures model EAGLE-3's TTT step and AdamW: for train.method=dflash and train.optimizer=muon the
    estimate says they are upper bounds, with the queries a DFlash row holds against TTT's; eagle3 says nothing."""
    shape = target_shape(REPO / "configs" / "targets" / "kimi-k2-instruct.json", attention="gqa")
    cfg = load_config(REPO / "configs" / "kimi-k2-8xh200.yaml")
    plain = estimate(cfg, shape, HARDWARE["h200"], 8, prompt_tokens=300, answer_tokens=1800)
    assert plain["train_notes"] == []
    cfg.train.method, cfg.train.optimizer, cfg.train.fsdp = "dflash", "muon", False
    cfg.train.norm_before_fc = cfg.train.norm_output = False
    e = estimate(cfg, shape, HARDWARE["h200"], 8, prompt_tokens=300, answer_tokens=1800)
    text = render(e)
    queries = cfg.train.dflash_anchors * (cfg.train.ttt_steps + 1)  # block_size unset: ttt_steps + 1
    assert f"block queries against TTT's seq_len x steps = {cfg.train.seq_len * cfg.train.ttt_steps:,}" in text
    assert f"x block_size = {queries:,}" in text and queries < cfg.train.seq_len * cfg.train.ttt_steps
    assert "train.optimizer=muon" in text
    # the block is its own knob; DSpark sizes its Markov head beside DFlash's drafter
    cfg.train.block_size = 7
    assert f"x block_size = {cfg.train.dflash_anchors * 7:,}" in render(estimate(cfg, shape, HARDWARE["h200"], 8, 300,
                                                                                  1800))
    dflash = estimate(cfg, shape, HARDWARE["h200"], 8, prompt_tokens=300, answer_tokens=1800)
    cfg.train.method, cfg.train.drafter_options = "dspark", {"markov_rank": 128}
    dspark = estimate(cfg, shape, HARDWARE["h200"], 8, prompt_tokens=300, answer_tokens=1800)
    markov = (shape.vocab_size + cfg.vocab.draft_vocab_size) * 128
    assert dspark["drafter_params"] - dflash["drafter_params"] == markov


def test_served_stages_count_vllms_cap_and_the_kv_cache_of_their_context():
    """A served target fits when its weights and the KV cache of one request at the served context stay under
    vLLM's utilisation cap (vllm_memory.GPU_MEMORY_CAP): Kimi-K2's fp8 weights (~1.0 TB) on 8 x H200 do not, in
    one line that says why; a target that fits only with a shorter context names the --max-model-len that fits."""
    import dataclasses

    from draftsmith.estimate import serve_fit
    from draftsmith.vllm_memory import GPU_MEMORY_CAP

    k2 = target_shape(REPO / "configs" / "targets" / "kimi-k2-instruct.json", attention="gqa")
    # MLA: kv_lora_rank + qk_rope_head_dim bf16 values a layer, the whole latent on every rank (~8.6 GiB at 128k)
    assert k2.kv_cache_per_device(8) == k2.kv_cache_per_device(1) == 61 * (512 + 64) * 2
    assert k2.max_context == 131072 and 8.5 * 2**30 < 131072 * k2.kv_cache_per_device(8) < 8.7 * 2**30
    llama = target_shape(REPO / "configs" / "targets" / "llama-3.1-8b-instruct.json")
    # GQA: 2 x 8 kv heads x 128, split over at most 8 ranks
    assert llama.kv_cache_per_device(1) == 32 * 2 * 8 * 128 * 2 == 8 * llama.kv_cache_per_device(8)
    assert llama.kv_cache_per_device(16) == llama.kv_cache_per_device(8)

    cfg = load_config(REPO / "configs" / "kimi-k2-8xh200.yaml")
    e = estimate(cfg, k2, HARDWARE["h200"], 8, prompt_tokens=300, answer_tokens=1800)
    reason = e["does_not_fit"]["generate"]
    assert "exceed vLLM's cap" in reason and f"{GPU_MEMORY_CAP} x 141.0 GB" in reason
    line = next(x for x in render(e).splitlines() if x.startswith("generate does not fit: "))
    assert line.endswith("more devices or a smaller quantization")

    # a device where the weights fit under the cap but 128k tokens of cache do not
    hw = dataclasses.replace(HARDWARE["h200"], mem=150e9)
    fit = serve_fit(k2, hw, 8, 131072, 300 + 8192)
    weights, cap, kv = k2.weight_bytes / 8, GPU_MEMORY_CAP * 150e9, k2.kv_cache_per_device(8)
    room = int((cap - weights) / kv) // 256 * 256
    assert fit["memory"] > cap and fit["reason"].endswith(f"serve it with --max-model-len {room}")
    assert serve_fit(k2, hw, 8, room, 8492)["reason"] is None and serve_fit(k2, hw, 8, room + 256, 8492)["reason"]
    # a shorter context than a request needs is no way out
    assert "fewer than the" in serve_fit(k2, hw, 8, 131072, room + 256)["reason"]
    # the int4 Kimi-K2.5 holds its own 256k context on 8 x H200
    k25 = target_shape(REPO / "configs" / "targets" / "kimi-k2.5.json", attention="mla")
    fits = estimate(load_config(REPO / "configs" / "kimi-k2.5-8xh200.yaml"), k25, HARDWARE["h200"], 8, 300, 1800)
    assert fits["does_not_fit"] == {} and fits["served"]["generate"]["context"] == 262144


# What the seed measured (Kimi-K2.5, 8 x H200, 10,000 ShareGPT prompts, ~21 M tokens; issue 55): generate 5.3 h
# with 0 errors, 24 minutes of model load per server start, extraction at ~2.5 samples/s (~67 min)
SEED = {"generate_s": 5.3 * 3600, "load_s": 24 * 60, "extract_s": 67 * 60}


def seed_estimate() -> dict:
    """The seed's parameters: `draftsmith estimate configs/kimi-k2.5-8xh200.yaml --hardware h200 --devices 8
    --target-config configs/targets/kimi-k2.5.json --prompt-tokens 300 --answer-tokens 1800`."""
    shape = target_shape(REPO / "configs" / "targets" / "kimi-k2.5.json", attention="mla")
    return estimate(load_config(REPO / "configs" / "kimi-k2.5-8xh200.yaml"), shape, HARDWARE["h200"], 8, 300, 1800)


def test_the_estimate_reproduces_the_seeds_generate_and_load():
    """Generation with its thinking tail and its server's start, and one start's model load, within 30 % of what
    the seed measured; every modelled rate printed with where it comes from."""
    e = seed_estimate()
    assert abs(e["stages"]["generate"]["seconds"] / SEED["generate_s"] - 1) < 0.3, e["stages"]["generate"]
    assert abs(e["load"]["seconds"] / SEED["load_s"] - 1) < 0.3, e["load"]
    # generate, extract, eval with drafter and eval's baseline: four starts of the target
    assert e["load"]["starts"] == {"generate": 1, "extract": 1, "eval": 2}
    # the tail: the last wave runs to the longest of 64 answers, near generate.max_tokens
    g = e["generate_model"]
    assert 6000 < g["longest"] <= 8192 and g["tail_s"] > 60
    sources = "\n".join(rate_sources(e))
    for what in ("generate:", "thinking tail:", "model load:", "target prefill:", "extraction host work:", "train:"):
        assert what in sources
    assert sources.count("assumption") >= 5 and "spec sheet" in sources and "measured" in sources


def test_estimate_from_a_run_takes_its_measured_rates_and_scales_them(tiny_run, cli, tmp_path):
    """`estimate --from RUN`: each finished stage's rate from the run's manifests (generate: completion tokens over
    decoding seconds; extract, train: tokens over their seconds; eval: the tokens it asked for), scaled to the
    recipe's work, each saying which manifest it came from; stages it did not run stay modelled."""
    import shutil

    from draftsmith.estimate import apply_run_rates, run_rates

    run, config, _, _ = tiny_run
    rates = run_rates(run.path)
    gen = run.read_manifest("generate")["summary"]
    assert rates["generate"]["rate"] == pytest.approx(gen["completion_tokens"] / gen["seconds"])
    assert "load_s" not in rates["generate"]  # backend local: no server started
    ext = run.read_manifest("extract")
    assert rates["extract"]["rate"] == pytest.approx(ext["counts"]["tokens"] / ext["seconds"])
    assert set(rates) == {"generate", "extract", "train", "eval"}
    assert all(str(run.path / s / "manifest.json") in rates[s]["source"] for s in rates)

    cfg = load_config(config, ["generate.limit=40", "train.max_steps=60"])
    shape = target_shape(Path(run.read_manifest("generate")["settings"]["target"]) / "config.json")
    e = apply_run_rates(estimate(cfg, shape, HARDWARE["cpu"], 1, 60, 24), rates)
    for stage in ("generate", "extract", "train"):
        assert e["stages"][stage]["seconds"] == pytest.approx(e["stages"][stage]["tokens"] / rates[stage]["rate"])
    assert e["rate_from"]["prepare"] == "model" and e["rate_from"]["train"].endswith(")")
    # ten times the prompts: ten times generate's and extract's time at the run's rates
    big = apply_run_rates(estimate(load_config(config, ["generate.limit=400", "train.max_steps=60"]), shape,
                                   HARDWARE["cpu"], 1, 60, 24), rates)
    for stage in ("generate", "extract"):
        assert big["stages"][stage]["seconds"] == pytest.approx(10 * e["stages"][stage]["seconds"], rel=0.01)
    assert e["total"]["seconds"] == pytest.approx(sum(s["seconds"] for s in e["stages"].values()))

    # a run that stopped after generate: the rest stays modelled
    part = tmp_path / "part"
    part.mkdir()
    shutil.copy(run.path / "run.json", part / "run.json")
    shutil.copytree(run.path / "generate", part / "generate")
    p = cli("estimate", str(config), "--set", "generate.limit=40", "--from", str(part), check=True)
    assert "- generate: " in p.stdout and str(part / "generate" / "manifest.json") in p.stdout
    assert "- train: " in p.stdout.split("taken from the run")[0]  # modelled, with its source
    # not a run, or a run with nothing measured: one line, exit 2
    empty = tmp_path / "empty"
    empty.mkdir()
    shutil.copy(run.path / "run.json", empty / "run.json")
    for bad in (tmp_path / "nothing", empty):
        p = cli("estimate", str(config), "--set", "generate.limit=40", "--from", str(bad))
        assert p.returncode == 2 and p.stderr.strip().count("\n") == 0 and "--from" in p.stderr, p.stderr


def test_the_thinking_tail_and_the_batch_that_thins():
    """Answers exponential with the given mean, cut at max_tokens: a longer cap at the same mean leaves a longer
    last wave; transformers' batches (each runs to its longest answer at full width) decode slower than a server
    that refills its batch; the tail's expected longest answer is that of the in-flight answers."""
    from draftsmith.estimate import answer_survival, generate_time

    shape = target_shape(REPO / "configs" / "targets" / "kimi-k2.5.json", attention="mla")
    hw = HARDWARE["h200"]
    surv = answer_survival(1800, 8192)
    mean = 16 * sum(surv)  # E[min(X, cap)] from the survival function
    assert mean == pytest.approx(1800, rel=0.01) and surv[0] == 1.0 and surv[-1] < 0.02
    assert answer_survival(8192, 8192) == [1.0] * 512  # every answer at the cap
    short = generate_time(shape, hw, 8, 10_000, 64, 300, 1800, 4096, "vllm")
    long = generate_time(shape, hw, 8, 10_000, 64, 300, 1800, 32768, "vllm")
    assert long["longest"] > short["longest"] and long["tail_s"] > short["tail_s"]
    waves = generate_time(shape, hw, 8, 10_000, 64, 300, 1800, 8192, "hf")
    refilled = generate_time(shape, hw, 8, 10_000, 64, 300, 1800, 8192, "vllm")
    assert waves["seconds"] > 2 * refilled["seconds"]
    # the bulk decodes at a full batch: its tokens over (in flight / step) plus the tail
    bulk = (10_000 - 64) * 1800 / 64 * refilled["step"]["total"]
    assert refilled["seconds"] == pytest.approx(bulk + refilled["tail_s"])


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_estimate_sizes_the_attention_each_kind_trains(family, tmp_path):
    """Each kind with train.drafter_attention auto and mla: estimate sizes the drafter's attention training builds
    (DFlash's is gqa beside an MLA target), and refuses, in training's line, what training refuses (P-EAGLE or a
    block kind with an MLA drafter); the trainable parameters are those of the built drafter."""
    import torch
    from families import make_tiny

    from draftsmith import DraftsmithError, kinds
    from draftsmith.target import target_info
    from draftsmith.train.drafter import drafter_config

    folder = make_tiny(family, tmp_path / family)
    info = target_info(str(folder))
    checked = 0
    for kind in kinds.names():
        for asked in ("auto", "mla"):
            cfg = load_config(None, [f"target={folder}", f"train.method={kind}", f"train.drafter_attention={asked}",
                                     f"vocab.draft_vocab_size={info.vocab_size}"])
            try:
                dcfg = drafter_config(info, cfg, info.vocab_size, 3)
            except DraftsmithError as e:
                with pytest.raises(DraftsmithError) as est:
                    target_shape(folder / "config.json", train=cfg.train)
                assert str(est.value) == str(e), (kind, asked)
                continue
            shape = target_shape(folder / "config.json", train=cfg.train)
            assert (shape.drafter_mla is not None) == (dcfg.attention == "mla"), (kind, asked)
            with torch.device("meta"):
                model = kinds.drafter_class(dcfg)(dcfg)
            trainable = sum(p.numel() for n, p in model.named_parameters() if p.requires_grad and "norm" not in n)
            estimated = _drafter_params(shape, info.vocab_size, kind=kind, options=dcfg.options)[0]
            assert estimated == trainable, (kind, asked)
            checked += 1
    assert checked >= len(kinds.names())  # auto builds every kind beside either target


def test_the_disk_rate_bounds_offline_training_and_the_bound_is_named():
    """Kimi-K2.5's recipe trains offline from a 0.5 TB store: at the profile's 3 GB/s local disk the disk, not the
    drafter's compute, decides its rate (the issue's "35 % MFU" line was a disk bound), and a network volume's
    0.21 GB/s (--disk-rate) makes extract and train several times longer; the rate line names the bound and the
    disk's source."""
    from draftsmith.estimate import render

    shape = target_shape(REPO / "configs" / "targets" / "kimi-k2.5.json")
    cfg = load_config(REPO / "configs" / "kimi-k2.5-8xh200.yaml")
    local = estimate(cfg, shape, HARDWARE["h200"], 8, prompt_tokens=300, answer_tokens=1800)
    slow = estimate(cfg, shape, HARDWARE["h200"], 8, prompt_tokens=300, answer_tokens=1800, disk_rate=0.21e9)
    assert local["train_bound"] == slow["train_bound"] == "disk"
    assert local["tokens_per_s"]["train"] == pytest.approx(3.0e9 / local["bytes_per_token"])
    assert slow["tokens_per_s"]["train"] == pytest.approx(0.21e9 / slow["bytes_per_token"])
    assert local["tokens_per_s"]["train"] < local["tokens_per_s"]["train_compute"]
    for stage in ("extract", "train"):
        assert slow["stages"][stage]["seconds"] > 1.5 * local["stages"][stage]["seconds"], stage
    line = next(x for x in render(slow).splitlines() if x.startswith("- train:"))
    assert "bound by the disk reading the store" in line and "0.21 GB/s, --disk-rate" in line
    assert "assumption: the profile's local disk" in render(local)
    # where the drafter's compute is slower than the disk, it is the bound named
    fast = estimate(cfg, shape, HARDWARE["h200"], 8, prompt_tokens=300, answer_tokens=1800, disk_rate=1e12)
    assert fast["train_bound"] == "compute" and fast["tokens_per_s"]["train"] == fast["tokens_per_s"]["train_compute"]
    assert "bound by the drafter's compute" in render(fast)


def test_cli_disk_rate(cli):
    fast = json.loads(cli("estimate", "configs/demo.yaml", "--json", check=True).stdout)
    slow = json.loads(cli("estimate", "configs/demo.yaml", "--json", "--disk-rate", "0.001", check=True).stdout)
    assert slow["stages"]["extract"]["seconds"] > fast["stages"]["extract"]["seconds"]
    for bad in ("0", "-1", "inf", "nan"):
        p = cli("estimate", "configs/demo.yaml", "--disk-rate", bad)
        assert p.returncode == 2 and p.stderr.strip().count("\n") == 0 and "--disk-rate" in p.stderr, p.stderr
