"""Low-rank adapters of the training code (`pop_vlm.train.lora`) and their merge at load (`pop_vlm.assembly`), on
a small stack of decoder-like layers: the adapters start at the pretrained function, the merged weights compute
what the adapted layers compute, and the shipped description and tensors are checked as loading checks them.
(`tests/test_shapes_gemma.py` does the same through export and `pop_vlm.load` with the real Gemma-3 270M.)"""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from pop_vlm import assembly
from pop_vlm.train import lora, options

WIDTH, FFN = 12, 20


class Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn = torch.nn.Module()
        for name, (n_in, n_out) in {"q_proj": (WIDTH, 16), "k_proj": (WIDTH, 8), "v_proj": (WIDTH, 8),
                                    "o_proj": (16, WIDTH)}.items():
            setattr(self.self_attn, name, torch.nn.Linear(n_in, n_out, bias=False))
        self.mlp = torch.nn.Module()
        for name, (n_in, n_out) in {"gate_proj": (WIDTH, FFN), "up_proj": (WIDTH, FFN), "down_proj": (FFN, WIDTH)}.items():
            setattr(self.mlp, name, torch.nn.Linear(n_in, n_out, bias=False))


class Stack(torch.nn.Module):
    def __init__(self, n_layers=2):
        super().__init__()
        self.layers = torch.nn.ModuleList(Layer() for _ in range(n_layers))
        for parameter in self.parameters():
            parameter.requires_grad_(False)


FAMILY = SimpleNamespace(text_layers=lambda model: model.layers, PRETRAINED={"language_model": "gemma-3-270m"},
                         MODEL_NAME="stack")
SETTINGS = lora.Settings(4, 8.0, ("q_proj", "v_proj", "down_proj"))


def adapted(seed=0, random_b=True):
    torch.manual_seed(seed)
    model = lora.attach(Stack(), FAMILY, SETTINGS)
    if random_b:
        with torch.no_grad():
            for _, module in lora.adapted_modules(model):
                module.lora_B.normal_(std=0.3)
    return model


def test_adapters_start_at_the_pretrained_function_and_only_they_train():
    torch.manual_seed(0)
    plain = Stack()
    torch.manual_seed(0)
    model = lora.attach(Stack(), FAMILY, SETTINGS)
    names = [n for n, _ in lora.adapted_modules(model)]
    assert names == [f"layers.{i}.{m}" for i in range(2) for m in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")]
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {
        f"{n}.{ab}" for n in names for ab in ("lora_A", "lora_B")}
    assert set(model.state_dict()) - set(plain.state_dict()) == {f"{n}.{ab}" for n in names for ab in ("lora_A", "lora_B")}
    x = torch.randn(3, WIDTH)
    for name in ("self_attn.q_proj", "mlp.down_proj"):
        module = model.layers[0].get_submodule(name)
        given = x if name.startswith("self") else torch.randn(3, FFN)
        assert torch.equal(module(given), plain.layers[0].get_submodule(name)(given))  # B = 0
        assert module.lora_A.abs().sum() > 0 and not module.lora_B.any()
    assert lora.settings_of(model) == SETTINGS and lora.settings_of(plain) is None
    assert lora.count(model) == 2 * 4 * ((WIDTH + 16) + (WIDTH + 8) + (FFN + WIDTH))


def test_the_merged_weights_compute_what_the_adapters_compute():
    model = adapted()
    state = model.state_dict()
    frozen = {n: t for n, t in state.items() if not lora.is_adapter(n)}
    adapters = {n: t for n, t in state.items() if lora.is_adapter(n)}
    merged = assembly.merge_adapters(frozen, adapters, SETTINGS.description(), "here")
    assert merged.keys() == frozen.keys()
    for stem, module in lora.adapted_modules(model):
        x = torch.randn(5, module.in_features)
        torch.testing.assert_close(torch.nn.functional.linear(x, merged[stem + ".weight"]), module(x))
        assert not torch.allclose(merged[stem + ".weight"], frozen[stem + ".weight"])
    for name in frozen.keys() - {stem + ".weight" for stem, _ in lora.adapted_modules(model)}:
        assert torch.equal(merged[name], frozen[name]), name


def test_adapters_that_do_not_fit_are_named():
    state = adapted().state_dict()
    frozen = {n: tuple(t.shape) for n, t in state.items() if not lora.is_adapter(n)}
    adapters = {n: t for n, t in state.items() if lora.is_adapter(n)}
    spec = SETTINGS.description()
    assert assembly.adapter_problems(adapters, spec, frozen) == []
    broken = dict(adapters)
    del broken["layers.1.mlp.down_proj.lora_A"], broken["layers.0.self_attn.v_proj.lora_A"]
    del broken["layers.0.self_attn.v_proj.lora_B"]
    broken["layers.0.mlp.up_proj.lora_B"] = torch.zeros(FFN, 4)
    broken["layers.0.self_attn.q_proj.lora_B"] = torch.zeros(16, 3)
    broken["layers.0.self_attn.q_proj.bias"] = torch.zeros(16)
    problems = assembly.adapter_problems(broken, spec, frozen)
    assert problems == [
        "1 tensor(s) that are not adapters: layers.0.self_attn.q_proj.bias",
        "1 adapter(s) missing: layers.0.self_attn.v_proj",
        "1 adapter(s) for no target weight: layers.0.mlp.up_proj",
        "layers.0.self_attn.q_proj.lora_B: (16, 3), not (16, 4)",
        "layers.1.mlp.down_proj.lora_A: missing, not (4, 20)",
    ]
    with pytest.raises(ValueError, match="here: the adapters do not fit the language model: 1 tensor"):
        assembly.merge_adapters({n: state[n] for n in frozen}, broken, spec, "here")


def test_base_model_json_describes_the_adapters(tmp_path):
    plain = assembly.base_description("gemma-3-270m", "model.language_model.")
    assert plain["format"] == 1 and "adapters" not in plain
    base = assembly.base_description("gemma-3-270m", "model.language_model.", adapters=SETTINGS.description())
    assert base == dict(plain, format=2, adapters={"rank": 4, "alpha": 8.0, "targets": ["q_proj", "v_proj", "down_proj"]})
    (tmp_path / "base_model.json").write_text(json.dumps(base))
    assert assembly.read_base(tmp_path) == base
    for odd in (dict(base, format=1), {k: v for k, v in base.items() if k != "adapters"}, dict(plain, adapters=base["adapters"])):
        (tmp_path / "base_model.json").write_text(json.dumps(odd))
        with pytest.raises(ValueError, match="is not a base model description of format 1 or 2"):
            assembly.read_base(tmp_path)
    for adapters in ({"rank": 0, "alpha": 1.0, "targets": ["q_proj"]}, {"rank": 2, "alpha": -1, "targets": ["q_proj"]},
                     {"rank": 2, "alpha": 1.0, "targets": []}, {"rank": 2, "alpha": 1.0}):
        with pytest.raises(ValueError, match="not a description of low-rank adapters"):
            assembly.base_description("gemma-3-270m", "model.language_model.", adapters=adapters)


def test_the_options_give_the_adapters():
    args = options.parse_args(["--family", "gemma3", "--lora-rank", "4", "--lora-targets", "down,q"])
    assert lora.settings(args) == lora.Settings(4, 8.0, ("q_proj", "down_proj"))  # alpha 2R, in layer order
    args = options.parse_args(["--family", "gemma3", "--lora-rank", "16", "--lora-alpha", "16"])
    assert lora.settings(args) == lora.Settings(16, 16.0, ("q_proj", "k_proj", "v_proj", "o_proj"))
    assert lora.settings(options.parse_args(["--family", "gemma3"])) is None
