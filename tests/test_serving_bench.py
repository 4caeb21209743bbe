"""The serving benchmark: its client-side figures, a random-weight architecture saved to be served, and one small
sweep end to end (two `pop-vlm serve` processes on the bundled model)."""
from __future__ import annotations

import json

import pytest

from app.serving_bench import Record, summarize


def test_figures_of_completed_and_cancelled_requests():
    one_chunk_per_token = Record(0, sent=0.0, admitted=0.1, content=[0.5, 0.6, 0.8], done=0.8, tokens=3,
                                 finish_reason="length")
    tokens_without_text = Record(1, sent=0.0, admitted=0.1, content=[0.4], done=1.0, tokens=4, finish_reason="length")
    waiting = Record(2, sent=0.0, cancelled=True, cancelled_at=5.0)
    figures = summarize([one_chunk_per_token, tokens_without_text, waiting], wall_s=2.0, max_tokens=3)
    assert figures["completed"] == 2 and figures["cancelled"] == 1 and figures["failed"] == 0
    assert figures["tokens"] == 7 and figures["tokens_per_s"] == 3.5 and figures["requests_per_s"] == 1.0
    assert figures["wrong_length"] == 1  # 4 tokens where 3 were asked for
    assert figures["chunk_per_token"] == 1
    # the waiting request counts with the time it had waited, so the percentile is a lower bound
    assert figures["ttft_p99_s"] == 5.0 and figures["ttft_lower_bound"]
    # gaps 0.1 and 0.2 where each chunk is a token; else the mean, 0.2, once per token after the first
    assert sorted(one_chunk_per_token.gaps() + tokens_without_text.gaps()) == pytest.approx([0.1, 0.2, 0.2, 0.2, 0.2])
    assert json.dumps(summarize([waiting], wall_s=1.0, max_tokens=3))  # no NaN in what is written out


def test_a_random_architecture_is_saved_with_its_processor_and_served_like_a_download(tmp_path):
    import pop_vlm
    from pop_vlm import archs

    folder = archs.save_pretrained("qwen3-vl-2b", tmp_path / "model", scale=1 / 16)
    pipe = pop_vlm.load(str(folder), device="cpu")
    assert pipe.is_multimodal and pipe.num_layers == 28
    answer = pipe.answer(None, "Describe the picture.", mode="pop", max_new_tokens=3, ignore_eos=True)
    assert len(answer.token_ids) == 3 and answer.finish_reason == "length"
    with pytest.raises(NotImplementedError):
        archs.save_pretrained("llama-3.1-8b", tmp_path / "llama", scale=1 / 64)


@pytest.mark.slow
def test_a_small_sweep_end_to_end(tmp_path):
    from app.serving_report import format_table, write_outputs
    from app.serving_suite import SuiteConfig, run_suite

    config = SuiteConfig(models=("shapes-qwen3-vl",), modes=("pop",), clients=(3,), per_client=1, seconds=120)
    report = run_suite(config, log=lambda line: None)
    serial, batched = report["rows"]
    assert (serial["server"], batched["server"]) == ("serial", "batched")
    for row in report["rows"]:
        assert row["completed"] == 3 and row["failed"] == row["lost"] == row["wrong_length"] == 0
    assert batched["compared"] == 3 and batched["mismatches"] == 0
    assert report["meta"]["dtype_resolved"] == "float32"
    assert "batched / serial" in format_table(report)
    paths = write_outputs(report, tmp_path)
    assert [p.name for p in paths] == ["serving.json", "serving.md", "serving.png"]
    assert json.loads(paths[0].read_text())["ratios"][0]["clients"] == 3
