"""Models shipped without the pretrained language model they were trained around, assembled at load.

A demo model whose language model is pretrained and frozen (`shapes-gemma-3` around Gemma-3 270M) ships only
what was trained. Its folder holds the config, generation config, processor files and, in `model.safetensors`,
the trained weights alone, plus `base_model.json`, which says where the rest comes from::

    {"format": 1, "language_model": "gemma-3-270m", "prefix": "model.language_model.", "source_prefix": "model."}

`language_model` names a converted model of `pop_vlm.zoo`; its weights whose names start with `source_prefix` are
this model's weights under `prefix` (``model.layers.0...`` becomes ``model.language_model.layers.0...``). Tied
weights (Gemma's output head is its token embedding) are not stored anywhere: they follow the weight they are
tied to. Loading checks that every weight of the model is filled exactly once.

A model trained with low-rank adapters on its frozen language model also ships them, in `adapters.safetensors`,
and `base_model.json` (format 2) describes them: ``"adapters": {"rank": 4, "alpha": 8.0, "targets": ["q_proj",
...]}``. Each adapted weight ``<name>.weight`` of the language model has ``<name>.lora_A`` (rank x in) and
``<name>.lora_B`` (out x rank) there, and loading merges them into the pretrained weight,
W <- W + (alpha / rank)·B·A, before filling the model: the loaded model is a plain one. Every target weight of
every layer has its pair, and each adapter is used exactly once.

The tokenizer is assembled too when the pretrained model's own reproduces it: a folder without `tokenizer.json`
takes the pretrained model's, and its `tokenizer_config.json` adds the tokens the model adds (Gemma-3's image
tokens). `processor_folder` puts the two together in the cache; `shrink` leaves `tokenizer.json` out only when that
assembly gives back exactly the tokenizer it was trained with.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch

from . import zoo

BASE_MODEL_FILE = zoo.BASE_MODEL_FILE
WEIGHTS = "model.safetensors"
ADAPTERS_FILE = "adapters.safetensors"
TOKENIZER_FILE = "tokenizer.json"
SHIPPED_ONLY = (".safetensors", ".md", ".png")  # files of a shipped folder that its processor does not read
ADAPTER_A, ADAPTER_B = "lora_A", "lora_B"
FORMAT = 1
FORMAT_WITH_ADAPTERS = 2  # a reader of format 1 would load the model without its adapters: it must refuse it


def base_description(language_model: str, prefix: str, source_prefix: str = "model.", adapters: dict | None = None) -> dict:
    """The content of `base_model.json`; `adapters`: {"rank", "alpha", "targets"} of the adapters it ships."""
    if language_model not in zoo.CONVERTED:
        raise ValueError(f"unknown pretrained language model {language_model!r}; known: {', '.join(zoo.CONVERTED)}")
    base = {"format": FORMAT, "language_model": language_model, "prefix": prefix, "source_prefix": source_prefix}
    if adapters is None:
        return base
    rank, alpha, targets = adapters.get("rank"), adapters.get("alpha"), adapters.get("targets")
    if (set(adapters) != {"rank", "alpha", "targets"} or not isinstance(rank, int) or rank < 1
            or not isinstance(alpha, (int, float)) or not alpha > 0 or not isinstance(targets, list) or not targets
            or not all(isinstance(t, str) and t for t in targets)):
        raise ValueError(f"not a description of low-rank adapters (rank >= 1, alpha > 0, targets): {adapters}")
    return dict(base, format=FORMAT_WITH_ADAPTERS, adapters={"rank": rank, "alpha": float(alpha), "targets": targets})


def read_base(path: str | os.PathLike) -> dict:
    """A folder's `base_model.json`, checked."""
    file = Path(path) / BASE_MODEL_FILE
    with open(file, encoding="utf-8") as handle:
        base = json.load(handle)
    keys = {"format", "language_model", "prefix", "source_prefix"}
    if not ((base.get("format") == FORMAT and set(base) == keys)
            or (base.get("format") == FORMAT_WITH_ADAPTERS and set(base) == keys | {"adapters"})):
        raise ValueError(f"{file} is not a base model description of format {FORMAT} or {FORMAT_WITH_ADAPTERS}: {base}")
    return base_description(base["language_model"], base["prefix"], base["source_prefix"], base.get("adapters"))


def adapter_problems(adapters: dict, spec: dict, shapes: dict) -> list[str]:
    """What is wrong with filling the adapted weights of a language model (`shapes`: name -> shape of its weights)
    from `adapters` as `spec` describes them (empty when each target weight has its pair, of the right shapes, and
    no other tensor is there)."""
    targets, rank = set(spec["targets"]), spec["rank"]
    wanted = {name.removesuffix(".weight") for name in shapes
              if name.endswith(".weight") and name.removesuffix(".weight").rpartition(".")[2] in targets}
    given = {name.rpartition(".")[0] for name in adapters}
    problems = []
    if odd := sorted(n for n in adapters if n.rpartition(".")[2] not in (ADAPTER_A, ADAPTER_B)):
        problems.append(f"{len(odd)} tensor(s) that are not adapters: {', '.join(odd[:4])}")
    for what, stems in (("missing", wanted - given), ("for no target weight", given - wanted)):
        if stems:
            problems.append(f"{len(stems)} adapter(s) {what}: {', '.join(sorted(stems)[:4])}")
    for stem in sorted(wanted & given):
        out_features, in_features = shapes[stem + ".weight"]
        for suffix, shape in ((ADAPTER_A, (rank, in_features)), (ADAPTER_B, (out_features, rank))):
            held = adapters.get(f"{stem}.{suffix}")
            if held is None or tuple(held.shape) != shape:
                problems.append(f"{stem}.{suffix}: {'missing' if held is None else tuple(held.shape)}, not {shape}")
    return problems


def merge_adapters(weights: dict, adapters: dict, spec: dict, where) -> dict:
    """`weights` with the adapters merged into their targets: W + (alpha / rank)·B·A, computed in fp32."""
    shapes = {name: tuple(t.shape) for name, t in weights.items()}
    if problems := adapter_problems(adapters, spec, shapes):
        raise ValueError(f"{where}: the adapters do not fit the language model: " + "; ".join(problems[:4]))
    scale = spec["alpha"] / spec["rank"]
    merged = dict(weights)
    for stem in {name.rpartition(".")[0] for name in adapters}:
        weight = weights[stem + ".weight"]
        update = adapters[f"{stem}.{ADAPTER_B}"].float() @ adapters[f"{stem}.{ADAPTER_A}"].float()
        merged[stem + ".weight"] = (weight.float() + scale * update).to(weight.dtype)
    return merged


def pretrained_state(language_model: str, prefix: str, source_prefix: str = "model.", progress: bool = True) -> dict:
    """The converted model's weights, named as in the model that takes them (fp32, as converted)."""
    from safetensors.torch import load_file

    folder = zoo.CONVERTED[language_model](progress=progress)
    weights = load_file(Path(folder) / "model.safetensors")
    return {prefix + name.removeprefix(source_prefix): t for name, t in weights.items() if name.startswith(source_prefix)}


def tied_aliases(model) -> dict[str, str]:
    """State-dict names that share their parameter with an earlier name (tied weights): alias -> that name."""
    first: dict[int, str] = {}
    aliases = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in first:
            aliases[name] = first[id(tensor)]
        else:
            first[id(tensor)] = name
    return aliases


def split_problems(model, trained: set[str], pretrained: set[str]) -> list[str]:
    """What is wrong with filling `model`'s weights from these two sets of names (empty when each weight is
    filled exactly once, tied ones through the weight they are tied to)."""
    aliases = tied_aliases(model)
    expected = set(model.state_dict()) - set(aliases)
    problems = []
    for what, names in (("missing", expected - trained - pretrained), ("not in the model", (trained | pretrained) - expected),
                        ("given twice (trained and pretrained)", trained & pretrained)):
        if names:
            problems.append(f"{len(names)} weight(s) {what}: {', '.join(sorted(names)[:4])}{' ...' if len(names) > 4 else ''}")
    return problems


def write_trained(model, trained: dict, directory: str | os.PathLike, base: dict) -> Path:
    """Write the trained weights (`model.safetensors`) and `base_model.json` into `directory`, after checking that
    the weights left out are exactly those that the base's language model fills (only `model`'s names and ties
    are read). When the base names adapters, the trained adapters of the language model go to
    `adapters.safetensors` instead, checked as loading will check them."""
    prefix = base["prefix"]
    adapters = {}
    if spec := base.get("adapters"):
        adapters = {name: t for name, t in trained.items()
                    if name.startswith(prefix) and name.rpartition(".")[2] in (ADAPTER_A, ADAPTER_B)}
        trained = {name: t for name, t in trained.items() if name not in adapters}
    state = model.state_dict()
    under_prefix = {name for name in set(state) - set(tied_aliases(model)) - set(adapters) if name.startswith(prefix)}
    trained_there = sorted(name for name in trained if name.startswith(prefix))
    if trained_there:
        raise ValueError(f"weights under {prefix!r} were trained ({', '.join(trained_there[:4])}): the model cannot "
                         f"be shipped without them; export it whole")
    if problems := split_problems(model, set(trained) | set(adapters), under_prefix):
        raise ValueError("the trained weights and the pretrained language model do not make the model: " + "; ".join(problems))
    if spec and (problems := adapter_problems(adapters, spec, {n: tuple(state[n].shape) for n in under_prefix})):
        raise ValueError("the adapters do not fit the language model: " + "; ".join(problems[:4]))
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_weights(trained, directory / WEIGHTS)
    if adapters:
        save_weights(adapters, directory / ADAPTERS_FILE)
    with open(directory / BASE_MODEL_FILE, "w", encoding="utf-8") as handle:
        json.dump(base, handle, indent=1)
    return directory / WEIGHTS


def save_weights(tensors: dict, file: Path):
    from safetensors.torch import save_file

    save_file({name: t.detach().contiguous().cpu() for name, t in tensors.items()}, str(file), metadata={"format": "pt"})
    os.chmod(file, 0o644)  # save_file leaves it readable by its owner only


def save_shipped(model, trained: dict, directory: str | os.PathLike, base: dict) -> Path:
    """What `save_pretrained` writes (config, generation config, weights), the weights being the trained ones."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.config.architectures = [type(model).__name__]
    model.config.dtype = model.dtype
    model.config.save_pretrained(directory)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(directory)
    return write_trained(model, trained, directory, base)


def model_class_of(config):
    import transformers

    architecture = (getattr(config, "architectures", None) or ["?"])[0]
    if not hasattr(transformers, architecture):
        raise ValueError(f"unknown architecture {architecture!r} in the config")
    return getattr(transformers, architecture)


def load_model(path: str | os.PathLike, dtype: torch.dtype = torch.float32, attn_implementation: str | None = None,
               progress: bool = True, name: str | None = None):
    """Build the model of a shipped folder from its config and fill it: the language model from the pretrained
    model that `base_model.json` names (converted on first use, with a progress bar) with the folder's adapters, if
    any, merged into it, the rest from the folder."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, GenerationConfig
    from transformers.initialization import no_init_weights

    path = Path(path)
    base = read_base(path)
    zoo.require_package(base["language_model"], needed_by=name or str(path))
    config = AutoConfig.from_pretrained(path)
    kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
    with no_init_weights():  # every weight is overwritten below
        model = model_class_of(config)._from_config(config, dtype=dtype, **kwargs)
    model.tie_weights()  # skipped with the initialisation
    trained = load_file(path / WEIGHTS)
    if base.get("adapters") and not (path / ADAPTERS_FILE).is_file():
        raise ValueError(f"{path}: {BASE_MODEL_FILE} describes low-rank adapters but {ADAPTERS_FILE} is missing")
    pretrained = pretrained_state(base["language_model"], base["prefix"], base["source_prefix"], progress=progress)
    if spec := base.get("adapters"):
        pretrained = merge_adapters(pretrained, load_file(path / ADAPTERS_FILE), spec, path)
    if problems := split_problems(model, set(trained), set(pretrained)):
        raise ValueError(f"{path} and {base['language_model']} do not make the model: " + "; ".join(problems))
    model.load_state_dict({**pretrained, **trained}, strict=False)  # checked above; tied weights follow
    if (path / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(path)
    return model.eval()


def read_weights(path: str | os.PathLike) -> dict:
    """Every tensor of a folder's safetensors files (one file or shards)."""
    from safetensors.torch import load_file

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path} holds no safetensors weights")
    return {name: t for file in files for name, t in load_file(file).items()}


def shrink(full_dir: str | os.PathLike, out_dir: str | os.PathLike, language_model: str, prefix: str,
           source_prefix: str = "model.") -> Path:
    """Turn a folder that `save_pretrained` wrote (the whole model) into the shipped form in `out_dir` (replaced
    at once; it may be `full_dir` itself): the same files, the weights without the pretrained language model, and
    without `tokenizer.json` when the pretrained model's tokenizer gives it back (`tokenizer_reproduced`).

    The language model in the folder must equal the pretrained one (in the folder's dtype): a model whose
    language model was trained cannot be shipped without it."""
    from transformers import AutoConfig

    full_dir, out_dir = Path(full_dir), Path(out_dir)
    base = base_description(language_model, prefix, source_prefix)
    # loaded by transformers, which maps the names it writes (Gemma-3: "language_model.model.*") to the model's own
    model, info = model_class_of(AutoConfig.from_pretrained(full_dir)).from_pretrained(
        full_dir, dtype="auto", output_loading_info=True)
    if odd := [f"{kind}: {names[:4]}" for kind, names in info.items() if kind.endswith("_keys") and names]:
        raise ValueError(f"{full_dir} does not hold the whole model ({'; '.join(odd)})")
    weights, aliases = model.state_dict(), tied_aliases(model)
    check_pretrained_part(weights, pretrained_state(language_model, prefix, source_prefix), prefix, aliases, full_dir)
    trained = {name: t for name, t in weights.items() if not name.startswith(prefix) and name not in aliases}
    tmp = out_dir.with_name(out_dir.name + ".shrink")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(full_dir, tmp, ignore=lambda folder, names: [n for n in names if ".safetensors" in n])
    write_trained(model, trained, tmp, base)
    leave_out_tokenizer(tmp)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    return out_dir


def check_pretrained_part(weights: dict, pretrained: dict, prefix: str, aliases: dict, where) -> None:
    """The folder's language model (and what is tied to it) is the pretrained one, tensor for tensor."""
    held = {name for name in weights if name.startswith(prefix) and name not in aliases}
    if held != set(pretrained):
        odd = sorted(held ^ set(pretrained))
        raise ValueError(f"{where}: the language model's weights are not those of the pretrained model: {odd[:4]}")
    for name, tensor in pretrained.items():
        if not torch.equal(weights[name], tensor.to(weights[name].dtype)):
            raise ValueError(f"{where}: {name} differs from the pretrained model's: the language model was trained, "
                             "so the model cannot be shipped without it")
    for alias, target in aliases.items():
        if alias in weights and not torch.equal(weights[alias], weights[target]):
            raise ValueError(f"{where}: {alias} should be tied to {target} but differs from it")


def processor_folder(path: str | os.PathLike, progress: bool = True) -> Path:
    """The folder to load a shipped folder's processor from: the folder itself when it holds its `tokenizer.json`,
    else one in the cache with the folder's processor files and the `tokenizer.json` of the pretrained model that
    `base_model.json` names (converted on first use). The cache folder is named after a digest of those files, so
    a changed folder gets a fresh one."""
    path = Path(path)
    if (path / TOKENIZER_FILE).is_file():
        return path
    base = read_base(path)
    zoo.require_package(base["language_model"], needed_by=str(path))
    source = pretrained_tokenizer(base, progress)
    files = processor_files(path)
    digest = files_digest(files, start=str(source.stat().st_size).encode())
    target = zoo.cache_dir() / "processors" / f"{path.name}-{digest[:16]}"
    if (target / TOKENIZER_FILE).is_file():
        return target
    staging = target.with_name(f"{target.name}.{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    put_together(files, source, staging)
    try:
        os.replace(staging, target)
    except OSError:  # another process put it there first
        shutil.rmtree(staging, ignore_errors=True)
    return target


def leave_out_tokenizer(folder: str | os.PathLike) -> bool:
    """Remove the folder's `tokenizer.json` when the pretrained model's gives it back; whether it did."""
    if reproduced := tokenizer_reproduced(folder):
        (Path(folder) / TOKENIZER_FILE).unlink()
    return reproduced


#: digest of the files compared -> whether `tokenizer_reproduced` found them equal (the comparison parses two 33 MB
#: tokenizers, seconds; every export of a training run asks it again of the same files)
_REPRODUCED: dict[str, bool] = {}


def tokenizer_reproduced(folder: str | os.PathLike) -> bool:
    """Whether the folder's tokenizer is the pretrained model's with the folder's `tokenizer_config.json`: loaded
    that way, it serialises to the same `tokenizer.json`."""
    folder = Path(folder)
    if not (folder / TOKENIZER_FILE).is_file():
        return False
    files, source = processor_files(folder), pretrained_tokenizer(read_base(folder))
    key = files_digest([*files, folder / TOKENIZER_FILE, source])
    if key not in _REPRODUCED:
        _REPRODUCED[key] = _assembled_tokenizer_is(folder / TOKENIZER_FILE, files, source)
    return _REPRODUCED[key]


def _assembled_tokenizer_is(wanted_file: Path, files: list[Path], source: Path) -> bool:
    """Whether `files` with `source` as their `tokenizer.json` load as a tokenizer that serialises to `wanted_file`."""
    import tempfile

    from transformers import AutoTokenizer

    with open(wanted_file, encoding="utf-8") as handle:
        wanted = json.load(handle)
    with tempfile.TemporaryDirectory() as trial:
        put_together(files, source, Path(trial) / "processor")
        assembled = AutoTokenizer.from_pretrained(Path(trial) / "processor")
        return json.loads(assembled.backend_tokenizer.to_str()) == wanted


def files_digest(files: list[Path], start: bytes = b"") -> str:
    """SHA-256 (hex) of `start` and each file's name and bytes, in the order given."""
    digest = hashlib.sha256(start)
    for file in files:
        digest.update(file.name.encode() + b"\0" + file.read_bytes())
    return digest.hexdigest()


def pretrained_tokenizer(base: dict, progress: bool = True) -> Path:
    """The `tokenizer.json` of the pretrained model that a `base_model.json` names (converted on first use)."""
    return Path(zoo.CONVERTED[base["language_model"]](progress=progress)) / TOKENIZER_FILE


def processor_files(folder: Path) -> list[Path]:
    """The files of a shipped folder that its processor reads, its own `tokenizer.json` aside."""
    return sorted(f for f in folder.iterdir()
                  if f.is_file() and not f.name.endswith(SHIPPED_ONLY) and f.name != TOKENIZER_FILE)


def put_together(files: list[Path], tokenizer: Path, destination: Path) -> None:
    """A new folder `destination` holding copies of `files` and of `tokenizer` (as `tokenizer.json`)."""
    destination.mkdir(parents=True)
    for file in files:
        shutil.copyfile(file, destination / file.name)
    shutil.copyfile(tokenizer, destination / TOKENIZER_FILE)
