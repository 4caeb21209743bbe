"""Smoke test of scripts/bench_followup.py at a tiny scale (random weights, no downloads)."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_followup.py"


def _load():
    spec = importlib.util.spec_from_file_location("bench_followup", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_followup_smoke(capsys, tmp_path):
    bench_followup = _load()
    code = bench_followup.main(["--scale", "0.03", "--image-sizes", "224", "--vocab", "1024", "--text-tokens", "16",
                                "--answer-tokens", "4", "--followup-tokens", "8", "--repeats", "1", "--warmup", "0",
                                "--quiet", "--out", str(tmp_path)])
    assert code == 0
    out = capsys.readouterr().out.strip().splitlines()
    report = json.loads(out[-1])
    table = "\n".join(out[:-1])
    assert "cache gain" in table and "follow-up cached" in table and "follow-up scratch" in table
    rows = report["rows"]
    assert {(r["mode"], r["turn"]) for r in rows} == {(m, t) for m in ("full", "pop") for t in bench_followup.TURNS}
    assert len(rows) == 6 and {r["vision_tokens"] for r in rows} == {64}  # 224 px / 16 px patches / 2x2 merge
    by = {(r["mode"], r["turn"]): r for r in rows}
    for mode in ("full", "pop"):
        first, cached, scratch = (by[mode, t] for t in bench_followup.TURNS)
        assert first["cached_tokens"] == 0 and scratch["cached_tokens"] == 0
        # the whole first turn but the answer's last token comes from the cache
        assert cached["cached_tokens"] == first["prompt_tokens"] + 4 - 1 > 0
        assert cached["prompt_tokens"] == scratch["prompt_tokens"] == first["prompt_tokens"] + 4 + 8
        assert cached["vision_s"] < first["vision_s"] and cached["vision_s"] < scratch["vision_s"]
        assert cached["cache_gain"] > 0 and first["cache_gain"] is None
        for r in (first, cached, scratch):
            assert r["ttft_s"] >= r["prefill_s"] > 0
        assert first["k"] == (0 if mode == "full" else 9)
    lines = [line.split() for line in table.splitlines() if line.strip()[:1].isdigit()]
    assert len(lines) == 6
    assert report["meta"]["command"].startswith("PYTHONPATH=. python scripts/bench_followup.py")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["followup-qwen3-vl-2b-s0.03-cpu.json",
                                                        "followup-qwen3-vl-2b-s0.03-cpu.md"]
