"""The TTFT benchmark, the FLOP count and the real-architecture configs (tiny scales, no downloads)."""
from __future__ import annotations

import json

import pytest
import torch

from pop_vlm import archs, cli
from pop_vlm.cache import PreallocatedCache
from pop_vlm.flops import DecoderShape, flop_limit, prefill_flops


def test_bench_smoke_through_cli(capsys, tmp_path):
    code = cli.main(["bench", "--arch", "qwen3-vl-2b", "--scale", "0.03", "--tokens", "32,64", "--image-sizes", "448",
                     "--image-text-tokens", "16", "--repeats", "1", "--warmup", "0", "--threads", "1", "--vocab", "1024",
                     "--quiet", "--out", str(tmp_path)])
    assert code == 0
    out = capsys.readouterr().out.strip().splitlines()
    report = json.loads(out[-1])
    table = "\n".join(out[:-1])
    assert "speedup" in table and "limit" in table
    points = report["points"]
    seen = {(p["tokens"], p["image_size"], p["mode"]) for p in points}
    assert len(points) == 9 and len(seen) == 9
    for p in points:
        for key in ("arch", "tokens", "mode", "prefill_s", "ttft_s", "speedup", "flop_limit"):
            assert key in p
        assert p["prefill_s"] > 0 and p["ttft_s"] >= p["prefill_s"]
        assert p["arch"] == "qwen3-vl-2b"
        if p["mode"] == "full":
            assert p["speedup"] == 1.0 and p["flop_limit"] == 1.0
        else:
            assert p["flop_limit"] > 1.0
    image = [p for p in points if p["image_size"] == 448]
    assert {p["vision_tokens"] for p in image} == {196}  # 448 px / 16 px patches / 2x2 merge = 14 x 14
    rows = [line.split() for line in table.splitlines() if line.strip()[:1].isdigit()]
    assert sorted((r[0], r[1], r[3]) for r in rows) == sorted((str(p["tokens"]), str(p["image_size"] or "-"), p["mode"]) for p in points)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench-qwen3-vl-2b-s0.03-cpu.json", "bench-qwen3-vl-2b-s0.03-cpu.png"]


def _shape(**kw):
    base = dict(num_layers=4, hidden=8, intermediate=16, heads=2, kv_heads=1, head_dim=4, vocab=10,
                layer_types=("full_attention",) * 4)
    base.update(kw)
    return DecoderShape(**base)


def test_flops_match_a_hand_count():
    s = _shape()
    n = 3
    # per layer and token: q 8*8, k 8*4, v 8*4, o 8*8, mlp 3*8*16 multiply-adds
    linear = 2 * (64 + 32 + 32 + 64 + 384)
    attention = 4 * 8 * (1 + 2 + 3)  # q_dim 8, causal keys 1 + 2 + 3
    lm_head = 2 * 8 * 10
    assert prefill_flops(s, n, "full") == 4 * (n * linear + attention) + lm_head
    # POP, k = 1: 3 layers over all 3 tokens, K/V of 1 layer over 2 tokens, the last token through the 1 skipped
    # layer (3 keys) — the same count as 3 layers over 2 tokens and the last token through all 4 layers
    kv = 2 * 2 * 8 * 4
    pop = 3 * (n * linear + attention) + 1 * 2 * kv + 1 * (linear + 4 * 8 * 3) + lm_head
    assert pop == 3 * (2 * linear + 4 * 8 * (1 + 2)) + 1 * 2 * kv + 4 * (linear + 4 * 8 * 3) + lm_head
    assert prefill_flops(s, n, "pop", k=1) == pop
    assert prefill_flops(s, n, "static", k=1) == 3 * (n * linear + attention) + lm_head


def test_flop_limit_properties():
    s = DecoderShape.from_config(archs.make_config("qwen3-vl-2b", 0.25, 16384)[0])
    assert flop_limit(s, 2048, "pop", 0) == 1.0
    assert flop_limit(s, 2048, "full", 9) == 1.0
    limits = [flop_limit(s, n, "pop", 9) for n in (32, 512, 2048, 8192)]
    assert limits == sorted(limits) and limits[0] < limits[-1]  # attention's quadratic term grows with N
    assert 1.42 < flop_limit(s, 2048, "pop", 9) < 1.44  # linear + causal attention + K/V projections
    assert flop_limit(s, 2048, "pop", 9) < flop_limit(s, 2048, "static", 9) < 28 / 19 + 1e-9


def test_sliding_window_keys_are_capped():
    s = _shape(layer_types=("sliding_attention", "full_attention") * 2, sliding_window=4)
    assert s.keys_seen(0, 0, 10) == sum(min(i + 1, 4) for i in range(10))
    assert s.keys_seen(0, 6, 10) == sum(min(i + 1, 4) for i in range(6, 10))
    assert s.keys_seen(1, 0, 10) == sum(i + 1 for i in range(10))


@pytest.mark.parametrize("name", list(archs.ARCHS))
def test_arch_builds_at_tiny_scale_with_real_layers(name):
    built = archs.build(name, scale=0.02, vocab=512)
    text = built.text_config
    real = archs.text_config_dict(name)
    assert text.num_hidden_layers == real["num_hidden_layers"] == DecoderShape.from_config(real).num_layers
    assert text.head_dim == real["head_dim"]
    assert text.hidden_size < real["hidden_size"]
    if name == "gemma-3-4b":
        types = list(text.layer_types)
        assert types == ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(34)]
        assert text.sliding_window == 1024
        assert DecoderShape.from_config(real).layer_types == tuple(types)
    if name.startswith("qwen3-vl"):
        vision = built.model.config.vision_config
        assert list(vision.deepstack_visual_indexes) == archs.ARCHS[name]["vision_config"]["deepstack_visual_indexes"]
        assert vision.depth == archs.ARCHS[name]["vision_config"]["depth"]
        assert vision.out_hidden_size == text.hidden_size


def test_real_configs_have_the_published_sizes():
    # parameter counts of the decoder stacks at scale 1 (meta tensors: nothing is allocated)
    with torch.device("meta"):
        counts = {name: archs.parameter_count(archs.build(name, device="meta").model) / 1e9 for name in ("qwen3-vl-2b", "llama-3.1-8b")}
    assert 2.0 < counts["qwen3-vl-2b"] < 2.3
    assert 7.9 < counts["llama-3.1-8b"] < 8.1


def test_preallocated_cache_appends_in_place():
    from transformers import LlamaConfig

    cache = PreallocatedCache(config=LlamaConfig(num_hidden_layers=1, hidden_size=8, num_attention_heads=2, num_key_value_heads=1))
    k, v = torch.randn(1, 1, 5, 4), torch.randn(1, 1, 5, 4)
    keys, _ = cache.update(k, v, 0)
    ptr = keys.data_ptr()
    k2, v2 = torch.randn(1, 1, 1, 4), torch.randn(1, 1, 1, 4)
    keys, values = cache.update(k2, v2, 0)
    assert keys.data_ptr() == ptr and cache.get_seq_length(0) == 6
    torch.testing.assert_close(keys, torch.cat([k, k2], dim=-2))
    torch.testing.assert_close(values, torch.cat([v, v2], dim=-2))
    cache.crop(-2)
    keys, _ = cache.update(k2, v2, 0)
    torch.testing.assert_close(keys, torch.cat([k[..., :4, :], k2], dim=-2))


def test_a_benchmark_leaves_subnormal_floats_as_they_were(capsys):
    """Flushing subnormals is processor state for the whole process: the benchmark restores the default."""
    tiny = torch.tensor([1e-40], dtype=torch.float32)
    assert float(tiny * 1.0) != 0.0  # representable before
    assert cli.main(["bench", "--arch", "qwen3-vl-2b", "--scale", "0.03", "--tokens", "16", "--image-sizes", "",
                     "--repeats", "1", "--warmup", "0", "--threads", "1", "--vocab", "512", "--quiet", "--json"]) == 0
    capsys.readouterr()
    assert float(tiny * 1.0) != 0.0  # and still after


@pytest.mark.parametrize("device, threads, name", [("cpu", 1, "thread CPU time"), ("cpu", 2, "wall clock"),
                                                   ("cpu", None, "wall clock"), ("cuda", 1, "wall clock")])
def test_ttft_is_read_on_the_thread_cpu_clock_only_on_one_cpu_thread(device, threads, name):
    import time
    from types import SimpleNamespace

    from pop_vlm.bench import use_thread_clock

    pipe = SimpleNamespace(device=torch.device(device), timer=None)
    assert use_thread_clock(pipe, threads) == name
    assert pipe.timer is (time.thread_time if name == "thread CPU time" else time.perf_counter)
