"""Virtual-gate importance, "auto" pruning and the fidelity evaluation on tiny models."""
from __future__ import annotations

import json

import pytest
import torch

from pop_vlm import LayerImportance, Pipeline, PopConfig, plots, zoo
from pop_vlm import evaluate as ev
from pop_vlm.cli import main
from pop_vlm.importance import VirtualGates, frozen_parameters, gated_loss, text_samples


@pytest.fixture(scope="module")
def llama64():
    """tiny-llama in float64 (its RMSNorms still compute in float32, which bounds the finite-difference step)."""
    model, tokenizer = zoo.TINY["tiny-llama"]()
    return Pipeline(model.double(), tokenizer, name="tiny-llama-fp64")


def _loss(pipe, gates, sample, labels):
    with torch.no_grad():
        return float(gated_loss(pipe.adapter, gates, sample, labels)[0])


def test_gate_gradients_match_finite_differences(llama64):
    pipe = llama64
    sample = text_samples(pipe.tokenizer, n_prompts=1, prompt_tokens=24, answer_tokens=6, seed=3)[0]
    generator = torch.Generator().manual_seed(0)
    with frozen_parameters(pipe.model), VirtualGates(pipe.adapter, dtype=torch.float64) as gates:
        loss, labels = gated_loss(pipe.adapter, gates, sample, generator=generator)
        g_pre, g_dec = torch.autograd.grad(loss, [gates.prefill, gates.decode])
        eps = 1e-2  # central differences: O(eps²) error; smaller steps drown in the norms' float32 rounding
        checked = 0
        for stage, grad in (("prefill", g_pre), ("decode", g_dec)):
            for layer in range(pipe.num_layers):
                vector = getattr(gates, stage)
                with torch.no_grad():
                    vector[layer] = 1 + eps
                up = _loss(pipe, gates, sample, labels)
                with torch.no_grad():
                    vector[layer] = 1 - eps
                down = _loss(pipe, gates, sample, labels)
                with torch.no_grad():
                    vector[layer] = 1.0
                numeric = (up - down) / (2 * eps)
                assert float(grad[layer]) == pytest.approx(numeric, rel=5e-3, abs=2e-3), (stage, layer)
                checked += abs(numeric) > 1e-3
    assert checked >= pipe.num_layers  # the check compared real, non-zero gradients


def test_gates_at_one_leave_the_model_unchanged(llama64):
    pipe = llama64
    sample = text_samples(pipe.tokenizer, n_prompts=1, prompt_tokens=16, answer_tokens=4, seed=1)[0]
    labels = torch.zeros(4, dtype=torch.long)
    with VirtualGates(pipe.adapter, dtype=torch.float64) as gates:
        with_gates = _loss(pipe, gates, sample, labels)
        gates.prefill_positions = None
    plain_gates = VirtualGates(pipe.adapter, dtype=torch.float64)  # hooks not installed
    assert _loss(pipe, plain_gates, sample, labels) == pytest.approx(with_gates, rel=1e-12)


def test_stage_gates_touch_only_their_positions(llama64):
    """The loss covers answer positions only. The last layer's prompt-position outputs reach no answer token, so
    its prefill gate has zero gradient while every decode gate and the earlier prefill gates do not. And a loss on
    prompt positions' own predictions cannot depend on the decode gates (causality). A gate applied to the wrong
    positions fails one of these."""
    pipe = llama64
    adapter = pipe.adapter
    L = pipe.num_layers
    sample = text_samples(pipe.tokenizer, n_prompts=1, prompt_tokens=20, answer_tokens=5, seed=2)[0]
    with frozen_parameters(pipe.model), VirtualGates(adapter, dtype=torch.float64) as gates:
        loss, _ = gated_loss(adapter, gates, sample, generator=torch.Generator().manual_seed(1))
        g_pre, g_dec = torch.autograd.grad(loss, [gates.prefill, gates.decode])
        assert float(g_pre[L - 1]) == 0.0
        assert torch.all(g_pre[: L - 1].abs() > 0)
        assert torch.all(g_dec.abs() > 0)

        # the prompt's own next-token loss, under the same gates
        n = sample.inputs["input_ids"].shape[1]
        prompt = adapter.encode(sample.inputs)
        gates.prefill_positions = torch.arange(n) < n - 1
        gates.prefill_positions[-1] = False  # last prompt token: the decode gate's position
        hidden = adapter.run_layers(prompt.embeds, adapter.positions_between(prompt, 0, n), adapter.new_cache(),
                                    range(L), prompt=prompt, span=(0, n))
        logits = adapter.logits(hidden[:, : n - 2])[0]
        loss = torch.nn.functional.cross_entropy(logits, sample.inputs["input_ids"][0, 1 : n - 1], reduction="sum")
        g_pre, g_dec = torch.autograd.grad(loss, [gates.prefill, gates.decode], allow_unused=True)
        assert g_dec is None or float(g_dec.abs().max()) == 0.0
        assert torch.all(g_pre.abs() > 0)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma3-text", "tiny-qwen3-vl", "tiny-gemma3-vlm"])
def test_importance_profile_and_auto(pipelines, picture, name):
    pipe = pipelines(name)
    if pipe.is_multimodal:
        profile = pipe.importance([(picture, "What is in the picture?", "a red circle")], samples_per_prompt=2)
    else:
        profile = pipe.importance(n_prompts=2, samples_per_prompt=2, prompt_tokens=24, answer_tokens=4)
    L = pipe.num_layers
    assert len(profile.prefill) == len(profile.decode) == len(profile.block_influence) == L
    assert all(v >= 0 for v in profile.prefill + profile.decode)
    assert profile.prefill[-1] == 0.0 and profile.decode[-1] > 0
    assert all(0 <= b <= 2 for b in profile.block_influence)
    k = pipe.auto_k
    assert k == profile.auto_k() and 1 <= k <= L // 2
    assert not set(range(L - k, L)) & pipe.adapter.protected_layers
    answer = pipe.answer(picture if pipe.is_multimodal else None, "What is in the picture?", mode="pop",
                         pop=PopConfig(prune_layers="auto"), max_new_tokens=3)
    assert answer.pruned_layers == list(range(L - k, L))
    pipe.auto_k = None


def test_auto_k_rule():
    prefill = [5.0, 4.0, 3.0, 2.0, 1.0, 0.5, 0.3, 0.0]  # total 15.8
    profile = LayerImportance(prefill=prefill, decode=[1.0] * 8, block_influence=[0.1] * 8)
    assert profile.auto_k(0.0) == 1  # only the zero-importance last layer
    assert profile.auto_k(0.02) == 2  # 0.3/15.8 = 1.9 % ; adding 0.5 gives 5.1 %
    assert profile.auto_k(0.06) == 3
    assert profile.auto_k(1.0) == 4  # never more than L/2
    protected = LayerImportance(prefill=prefill, decode=[1.0] * 8, block_influence=[0.1] * 8, protected=[6])
    assert protected.auto_k(1.0) == 1
    with pytest.raises(ValueError):
        profile.auto_k(1.5)


def test_importance_json_table_plot(tmp_path):
    profile = LayerImportance(prefill=[3.0, 2.0, 1.0, 0.0], decode=[1.0, 2.0, 3.0, 4.0], block_influence=[0.5, 0.2, 0.1, 0.1],
                              model="m", n_prompts=2, n_samples=4, settings={"budget": 0.02})
    again = LayerImportance.from_json(profile.to_json(tmp_path / "imp.json"))
    assert again == profile
    assert LayerImportance.from_json(tmp_path / "imp.json") == profile
    assert json.loads(profile.to_json())["auto_k"] == 1
    rows = profile.as_table()
    assert [r["layer"] for r in rows] == [0, 1, 2, 3] and rows[3]["decode_share"] == pytest.approx(0.4)
    plots.importance_profile(profile, tmp_path / "imp.png")
    assert (tmp_path / "imp.png").read_bytes()[:4] == b"\x89PNG"


# ---- evaluation ------------------------------------------------------------------------------------------------
def test_forced_logits_follow_generation(pipelines):
    pipe = pipelines("tiny-gemma3-text")
    inputs = pipe.build_inputs(None, "what is the colour of the shape in the picture")
    for mode, pop in (("full", None), ("pop", PopConfig(prune_layers=2)), ("static", PopConfig(prune_layers=2))):
        answer = pipe.generate(inputs, mode=mode, pop=pop, max_new_tokens=6, output_scores=True)
        plan = ev.variant_plan(pipe.adapter, ev.Variant(mode, 0 if pop is None else 2))
        forced = ev.forced_logits(pipe.adapter, inputs, plan, answer.token_ids)
        torch.testing.assert_close(forced, torch.stack(answer.scores), rtol=1e-5, atol=1e-5)


def test_run_eval_on_tiny_model(pipelines, tmp_path):
    pipe = pipelines("tiny-llama")
    pipe.auto_k = 1
    results = ev.run_eval(pipe, ks=[1, 3], n_prompts=2, prompt_tokens=24, continuation=5, passkey_lengths=(64,),
                          passkey_trials=1, seed=0)
    pipe.auto_k = None
    fid = results["fidelity"]
    assert set(fid) == {"full", "pop@1", "static@1", "pop-no-kv@1", "pop-no-boundary@1", "pop@3", "static@3",
                        "pop-no-kv@3", "pop-no-boundary@3", "pop-auto@1"}
    # skipping only the last layer in prefill is exact: its projected KV is its real KV
    assert fid["pop@1"]["agreement"] == 1.0 and fid["pop@1"]["kl_mean"] < 1e-6
    assert fid["static@3"]["kl_mean"] > 0
    assert set(results["passkey"]["accuracy"]) == {"full", "pop@1", "static@1", "pop@3", "static@3"}
    paths = ev.save(results, tmp_path)
    assert "| pop@3 |" in paths["markdown"].read_text()
    assert paths["png"].read_bytes()[:4] == b"\x89PNG"


def test_image_qa_accuracy(pipelines, picture):
    pipe = pipelines("tiny-gemma3-vlm")
    expected = pipe.answer(picture, "what colour is it", mode="full", max_new_tokens=4).text
    variants = ev.variants_for([2], ("full", "pop", "static"))
    acc = ev.image_qa_accuracy(pipe, [(picture, "what colour is it", expected or "x"),
                                      {"image": picture, "question": "what shape", "answer": "zzzz"}], variants,
                               max_new_tokens=4)
    assert acc["full"] == (0.5 if expected.strip() else 0.0)
    assert set(acc) == {"full", "pop@2", "static@2"}
    with pytest.raises(ValueError):
        ev.image_qa_accuracy(pipelines("tiny-llama"), [], variants)


def test_variants_put_ablations_and_tails_at_their_ks():
    labels = [v.label for v in ev.variants_for([3, 6, 9], auto_k=4, ablation_ks=[6], full_tails=["text", 1, 4])]
    assert labels == ["full", "pop@3", "static@3", "pop@6", "static@6", "pop-no-kv@6", "pop-no-boundary@6",
                      "pop@6+tailtext", "pop@6+tail4", "pop@9", "static@9", "pop-auto@4"]
    tail = ev.variants_for([6], ("full", "pop"), full_tails=["text"])[-1]
    assert (tail.mode, tail.pop.full_tail, tail.pop.prune_layers) == ("pop", "text", 6)


def test_answer_matching():
    assert ev.answer_matches("It is Red.", "red") and not ev.answer_matches("It is Red.", "red", "exact")
    assert ev.answer_matches(" Red! ", "red", "exact") and not ev.answer_matches("reddish", "red", "exact")
    with pytest.raises(ValueError, match="unknown answer match"):
        ev.answer_matches("red", "red", "fuzzy")


def test_eval_on_shapes_records_without_text_parts(pipelines, tmp_path):
    """Image QA alone (no text fidelity, no passkey) on shapes-task records: exact match, every variant timed."""
    from pop_vlm import shapes

    pipe = pipelines("tiny-gemma3-vlm")
    records = shapes.make_records(range(800_000_000, 800_000_003))
    expected = pipe.answer(*shapes.sample_from_record(records[0])[:2], mode="full", max_new_tokens=3).text
    records[0] = dict(records[0], answer=expected or "-")  # the tiny model's own answer: a hit under full
    results = ev.run_eval(pipe, ks=[1, 2], n_prompts=0, passkey_trials=0, ablation_ks=[2], full_tails=["text"],
                          qa_samples=records, qa_max_new_tokens=3)
    assert results["fidelity"] == {} and "passkey" not in results
    assert results["settings"]["qa_match"] == "exact" and results["settings"]["qa_n"] == 3
    labels = ["full", "pop@1", "static@1", "pop@2", "static@2", "pop-no-kv@2", "pop-no-boundary@2", "pop@2+tailtext"]
    assert list(results["image_qa"]) == labels and list(results["image_qa_ttft_median_s"]) == labels
    assert results["image_qa"]["full"] >= (1 / 3 if expected.strip() else 0.0)
    assert all(t > 0 for t in results["image_qa_ttft_median_s"].values())
    paths = ev.save(results, tmp_path)
    table = paths["markdown"].read_text()
    assert "| pop@2+tailtext |" in table and "agreement" not in table and "TTFT full/variant" in table
    assert paths["png"].read_bytes()[:4] == b"\x89PNG"


def test_eval_command_on_shapes_records(tmp_path):
    from pop_vlm import shapes

    folder = zoo.save_tiny("tiny-gemma3-vlm", tmp_path / "model")
    qa = tmp_path / "qa.jsonl"
    qa.write_text("".join(json.dumps(r) + "\n" for r in shapes.make_records(range(800_000_000, 800_000_002))))
    out = tmp_path / "out"
    assert main(["eval", "--model", str(folder), "--out", str(out), "--ks", "2", "--prompts", "0",
                     "--passkey-trials", "0", "--full-tails", "text", "--qa", str(qa), "--threads", "1"]) == 0
    results = json.loads((out / "eval.json").read_text())
    assert set(results["image_qa"]) == {"full", "pop@2", "static@2", "pop-no-kv@2", "pop-no-boundary@2", "pop@2+tailtext"}
    assert results["settings"]["qa_match"] == "exact" and results["settings"]["clock"] == "thread CPU time"
    assert results["command"].startswith("pop-vlm eval --model ") and "--full-tails text" in results["command"]
    with pytest.raises(SystemExit):
        main(["eval", "--model", str(folder), "--out", str(out), "--full-tails", "0"])


def test_passkey_prompt_hides_the_key(pipelines):
    import random

    tokenizer = pipelines("tiny-llama").tokenizer
    text, key, depth = ev.passkey_prompt(tokenizer, 300, random.Random(0))
    assert len(key) == 5 and text.count(key) == 2 and 0 <= depth <= 1
    assert abs(len(tokenizer(text).input_ids) - 300) < 30


def test_cli_importance_and_eval(tmp_path, capsys):
    model_dir = zoo.save_tiny("tiny-llama", tmp_path / "model")
    out = tmp_path / "out"
    assert main(["importance", "--model", str(model_dir), "--out", str(out), "--prompts", "1", "--samples-per-prompt", "1",
                 "--prompt-tokens", "16", "--answer-tokens", "4"]) == 0
    profile = LayerImportance.from_json(out / "importance.json")
    assert len(profile.prefill) == 6 and (out / "importance.png").is_file()
    assert main(["eval", "--model", str(model_dir), "--out", str(out), "--ks", "1", "2", "--prompts", "1",
                 "--prompt-tokens", "16", "--continuation", "3", "--passkey-lengths", "64", "--passkey-trials", "1",
                 "--importance", str(out / "importance.json")]) == 0
    results = json.loads((out / "eval.json").read_text())
    assert results["auto_k"] == profile.auto_k() and (out / "eval.md").is_file() and (out / "eval.png").is_file()
    assert "pop@2" in capsys.readouterr().out


def test_each_variant_is_one_mode_and_one_pop_config():
    assert ev.Variant("full", 0).mode == "full" and ev.Variant("full", 0).pop is None
    assert ev.Variant("static", 2).mode == "static" and ev.Variant("static", 2).pop == PopConfig(prune_layers=2)
    assert ev.Variant("pop-no-kv", 3).pop == PopConfig(prune_layers=3, kv_projection=False)
    assert ev.Variant("pop-no-boundary", 3).pop == PopConfig(prune_layers=3, boundary=False)
    tail = ev.Variant("pop", 2, full_tail="text")
    assert tail.mode == "pop" and tail.pop == PopConfig(prune_layers=2, full_tail="text")
    assert len({v.label for v in (ev.Variant("pop", 2), tail, ev.Variant("pop", 2, full_tail=4))}) == 3
