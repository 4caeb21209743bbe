"""Fidelity of POP against the full model and static layer removal, on the same weights.

Variants (each at several prune depths k): ``full``; ``pop``; ``static`` (the same k layers removed in prefill
and decode, ShortGPT-style); ``pop-no-kv`` (no K/V projection for the skipped layers); ``pop-no-boundary``
(first token from the pruned stack); ``pop-auto`` (k from the importance profile, one depth).

Measures:
- **Agreement and KL, teacher-forced.** The full model greedily continues a prompt for T tokens; every variant
  is then fed exactly those tokens through its own prefill and decode path (`forced_logits`). Agreement is the
  fraction of steps at which the variant's argmax equals the full model's token; KL is KL(p_full ‖ p_variant)
  at the first token and averaged along the continuation.
- **Passkey retrieval.** A 5-digit key at a random depth of real filler text (CPython's pydoc topics), asked for
  at the end; accuracy by context length.
- **Image QA** (VLMs): accuracy over given (image, question, answer) triples, the answer containing the expected
  one or equal to it (`pop_vlm.scoring`).

Prompts, keys and depths come from a seeded generator at run time; nothing is chosen per mode.
"""
from __future__ import annotations

import json
import math
import random
import statistics
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import torch

from . import plots
from .config import PopConfig, check_mode
from .families.base import FamilyAdapter
from .generate import decode_one_token, generate_tokens
from .importance import pydoc_corpus, text_passages
from .pop import PrefillPlan, make_plan, prefill
from .scoring import QA_MATCHES, answer_matches, check_match, normalise  # noqa: F401 (still importable from here)

VARIANTS = ("full", "pop", "static", "pop-no-kv", "pop-no-boundary", "pop-auto")
ABLATIONS = ("pop-no-kv", "pop-no-boundary")


@dataclass(frozen=True)
class Variant:
    """A way to run the model: a name of `VARIANTS` at depth k (and, for POP, a full tail of `full_tail` tokens)."""

    name: str
    k: int
    full_tail: int | str = 1

    @property
    def label(self) -> str:
        if self.name == "full":
            return "full"
        return f"{self.name}@{self.k}" + (f"+tail{self.full_tail}" if self.full_tail != 1 else "")

    @property
    def mode(self) -> str:
        return self.name if self.name in ("full", "static") else "pop"

    @property
    def pop(self) -> PopConfig | None:
        """The `PopConfig` of this variant (None for full): the one place a variant's name becomes settings."""
        if self.name == "full":
            return None
        return PopConfig(prune_layers=self.k, kv_projection=self.name != "pop-no-kv",
                         boundary=self.name != "pop-no-boundary", full_tail=self.full_tail)


def variant_plan(adapter: FamilyAdapter, variant: Variant) -> PrefillPlan:
    return make_plan(adapter, variant.mode, variant.pop)


def variants_for(ks: Sequence[int], names: Sequence[str] = VARIANTS, auto_k: int | None = None,
                 ablation_ks: Sequence[int] | None = None, full_tails: Sequence[int | str] = ()) -> list[Variant]:
    """Full, then per k the named variants; the ablations (`pop-no-kv`, `pop-no-boundary`) and POP with each of
    `full_tails` only at `ablation_ks` (default: every k), then POP at the importance profile's `auto_k`."""
    ablation_ks = set(ks if ablation_ks is None else ablation_ks)
    out = [Variant("full", 0)] if "full" in names else []
    for k in ks:
        out += [Variant(n, k) for n in names
                if n not in ("full", "pop-auto") and (n not in ABLATIONS or k in ablation_ks)]
        if k in ablation_ks:
            out += [Variant("pop", k, full_tail=tail) for tail in full_tails if tail != 1]
    if "pop-auto" in names and auto_k is not None:
        out.append(Variant("pop-auto", auto_k))
    return out


# ---- teacher forcing ---------------------------------------------------------------------------------------------
@torch.inference_mode()
def forced_logits(adapter: FamilyAdapter, inputs: dict, plan: PrefillPlan, tokens: Sequence[int],
                  full_tail=1) -> torch.Tensor:
    """Logits (T, vocab) of a plan's generation path when it is fed `tokens` instead of its own choices:
    row t predicts tokens[t]. The prefill is `pop.prefill` (with `full_tail`, `PopConfig.full_tail`) and each step
    `generate.decode_one_token`, exactly as in `generate_tokens`."""
    prompt = adapter.encode(inputs)
    cache = adapter.new_cache()
    rows = [prefill(adapter, prompt, cache, plan, full_tail=full_tail)[0].float()]
    for t, token in enumerate(tokens[:-1]):
        rows.append(decode_one_token(adapter, prompt, cache, int(token), prompt.length + t, plan.decode_layers)[0].float())
    return torch.stack(rows)


def kl_divergence(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """KL(p ‖ q) per row, in nats."""
    log_p = torch.log_softmax(p_logits.float(), -1)
    log_q = torch.log_softmax(q_logits.float(), -1)
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def fidelity(pipe, variants: Sequence[Variant], *, n_prompts: int = 8, prompt_tokens: int = 256,
             continuation: int = 32, seed: int = 0, progress: bool = False) -> dict:
    """Teacher-forced next-token agreement and KL against the full model's greedy continuation (each variant with
    its own `full_tail`)."""
    from tqdm.auto import tqdm

    adapter = pipe.adapter
    prompts = []
    for passage in text_passages(n_prompts, prompt_tokens * 8, seed=seed + 1):
        ids = pipe.tokenizer(passage, return_tensors="pt").input_ids[:, :prompt_tokens]
        prompts.append({"input_ids": ids.to(pipe.device)})
    stats = {v.label: {"agree": [], "agree_first": [], "kl_first": [], "kl": []} for v in variants if v.name != "full"}
    bar = tqdm(total=len(prompts) * len(variants), desc="fidelity", disable=not progress)
    for inputs in prompts:
        result_tokens = list(generate_tokens(adapter, inputs, mode="full", max_new_tokens=continuation, output_scores=False))
        reference = forced_logits(adapter, inputs, make_plan(adapter, "full"), result_tokens)
        target = torch.tensor(result_tokens)
        bar.update()
        for variant in variants:
            if variant.name == "full":
                continue
            logits = forced_logits(adapter, inputs, variant_plan(adapter, variant), result_tokens,
                                   full_tail=variant.full_tail)
            kl = kl_divergence(reference, logits).clamp_min(0.0)
            hit = (logits.argmax(-1).cpu() == target).float()
            s = stats[variant.label]
            s["agree"].append(float(hit.mean()))
            s["agree_first"].append(float(hit[0]))
            s["kl_first"].append(float(kl[0]))
            s["kl"].append(float(kl.mean()))
            bar.update()
    bar.close()
    out = {"full": {"agreement": 1.0, "first_token_agreement": 1.0, "kl_first": 0.0, "kl_mean": 0.0}}
    for label, s in stats.items():
        out[label] = {"agreement": _mean(s["agree"]), "first_token_agreement": _mean(s["agree_first"]),
                      "kl_first": _mean(s["kl_first"]), "kl_mean": _mean(s["kl"])}
    return out


# ---- passkey retrieval -------------------------------------------------------------------------------------------
PASSKEY_INTRO = "There is a pass key hidden inside a lot of irrelevant text. Find it and remember it.\n\n"
PASSKEY_NEEDLE = "\n\nThe pass key is {key}. Remember it. {key} is the pass key.\n\n"
PASSKEY_QUESTION = "\n\nWhat is the pass key? The pass key is"


def passkey_prompt(tokenizer, n_tokens: int, rng: random.Random, corpus: str | None = None) -> tuple[str, str, float]:
    """A prompt of about `n_tokens` tokens with a 5-digit key at a random depth; (text, key, depth)."""
    corpus = corpus or pydoc_corpus()
    key = f"{rng.randrange(10000, 100000)}"
    overhead = len(tokenizer(PASSKEY_INTRO + PASSKEY_NEEDLE.format(key=key) + PASSKEY_QUESTION).input_ids)
    budget = max(16, n_tokens - overhead)
    start = rng.randrange(0, len(corpus) - budget * 8)
    filler_ids = tokenizer(corpus[start:start + budget * 8], add_special_tokens=False).input_ids[:budget]
    depth = rng.random()
    cut = int(depth * len(filler_ids))
    before = tokenizer.decode(filler_ids[:cut])
    after = tokenizer.decode(filler_ids[cut:])
    return PASSKEY_INTRO + before + PASSKEY_NEEDLE.format(key=key) + after + PASSKEY_QUESTION, key, depth


def passkey(pipe, variants: Sequence[Variant], *, lengths: Sequence[int] = (256, 1024, 4096), trials: int = 4,
            seed: int = 0, max_new_tokens: int = 8, progress: bool = False) -> dict:
    """Passkey accuracy per variant and context length (the same prompts for every variant)."""
    from tqdm.auto import tqdm

    rng = random.Random(seed)
    corpus = pydoc_corpus()
    cases = [(n, *passkey_prompt(pipe.tokenizer, n, rng, corpus)) for n in lengths for _ in range(trials)]
    hits = {v.label: {n: [] for n in lengths} for v in variants}
    actual = {n: [] for n in lengths}
    bar = tqdm(total=len(cases) * len(variants), desc="passkey", disable=not progress)
    for n, text, key, _depth in cases:
        inputs = pipe.build_inputs(None, text)
        actual[n].append(int(inputs["input_ids"].shape[1]))
        for variant in variants:
            answer = pipe.generate(inputs, mode=variant.mode, pop=variant.pop, max_new_tokens=max_new_tokens)
            hits[variant.label][n].append(key in answer.text)
            bar.update()
    bar.close()
    return {"lengths": list(lengths), "trials": trials, "mean_prompt_tokens": {str(n): _mean(actual[n]) for n in lengths},
            "accuracy": {label: {str(n): _mean(v) for n, v in per.items()} for label, per in hits.items()}}


# ---- image QA ------------------------------------------------------------------------------------------------------
def _triple(sample) -> tuple:
    """(image, question, answer) from a triple, a dict with those keys, or a shapes-task record (its scene is
    drawn by `pop_vlm.shapes`, as in `assets/qa/shapes_test.jsonl`)."""
    if is_shapes_record(sample):
        from . import shapes

        return shapes.sample_from_record(sample)
    if isinstance(sample, dict):
        return sample["image"], sample["question"], sample["answer"]
    image, question, answer = sample
    return image, question, answer


def is_shapes_record(sample) -> bool:
    return isinstance(sample, dict) and "objects" in sample and "image" not in sample


def image_qa(pipe, samples: Iterable, variants: Sequence[Variant], *, max_new_tokens: int = 16,
             match: str = "contains", group_by: Callable[[object], Sequence[str]] | None = None,
             progress: bool = False) -> dict:
    """Accuracy and median TTFT per variant over (image, question, answer) triples, dicts with those keys or
    shapes-task records. Each sample's inputs are built once and every variant answers them in turn (alternating
    order, so the variants share inputs and machine state); TTFT is read with `pipe.timer`.

    With `group_by` (a sample -> the names of the groups it counts in, e.g. `shapes_groups`), also
    `accuracy_by_group` ({label: {group: accuracy}}, groups sorted) and the prompts' `vision_tokens`
    ({mean, min, max})."""
    from tqdm.auto import tqdm

    if not pipe.is_multimodal:
        raise ValueError(f"{pipe.name} is not a vision-language model")
    check_match(match)  # before any work
    samples = list(samples)
    hits = {v.label: [] for v in variants}
    ttft = {v.label: [] for v in variants}
    group_hits = {v.label: defaultdict(list) for v in variants}
    vision_tokens = []
    bar = tqdm(total=len(samples) * len(variants), desc="image QA", disable=not progress)
    for index, sample in enumerate(samples):
        image, question, expected = _triple(sample)
        groups = list(group_by(sample)) if group_by else []
        inputs = pipe.build_inputs(image, question)
        for variant in variants if index % 2 == 0 else variants[::-1]:
            result = pipe.generate(inputs, mode=variant.mode, pop=variant.pop, max_new_tokens=max_new_tokens)
            ok = answer_matches(result.text, expected, match)
            hits[variant.label].append(ok)
            for group in groups:
                group_hits[variant.label][group].append(ok)
            ttft[variant.label].append(result.timings.ttft_s)
            bar.update()
        if variants:
            vision_tokens.append(result.n_image_tokens)  # the same inputs, so the same count for every variant
    bar.close()
    out = {"n": len(samples), "match": match,
           "accuracy": {label: _mean(v) for label, v in hits.items()},
           "ttft_median_s": {label: statistics.median(v) if v else math.nan for label, v in ttft.items()}}
    if group_by is not None:
        out["accuracy_by_group"] = {label: {group: _mean(v) for group, v in sorted(by_group.items())}
                                    for label, by_group in group_hits.items()}
        out["vision_tokens"] = ({"mean": _mean(vision_tokens), "min": min(vision_tokens), "max": max(vision_tokens)}
                                if vision_tokens else {"mean": math.nan, "min": None, "max": None})
    return out


def image_qa_accuracy(pipe, samples: Iterable, variants: Sequence[Variant], *, max_new_tokens: int = 16,
                      match: str = "contains", progress: bool = False) -> dict:
    """Accuracy per variant (see `image_qa`)."""
    return image_qa(pipe, samples, variants, max_new_tokens=max_new_tokens, match=match, progress=progress)["accuracy"]


# ---- a whole evaluation --------------------------------------------------------------------------------------------
def default_ks(num_layers: int) -> list[int]:
    """k from L/6 to L/2 in steps of L/6."""
    step = max(1, round(num_layers / 6))
    return sorted({k for k in range(step, num_layers // 2 + 1, step)})


def run_eval(pipe, *, ks: Sequence[int] | None = None, names: Sequence[str] = VARIANTS, n_prompts: int = 8,
             prompt_tokens: int = 256, continuation: int = 32, passkey_lengths: Sequence[int] = (256, 1024, 4096),
             passkey_trials: int = 4, passkey_names: Sequence[str] = ("full", "pop", "static"),
             passkey_ks: Sequence[int] | None = None, ablation_ks: Sequence[int] | None = None,
             full_tails: Sequence[int | str] = (), qa_samples: Iterable | None = None, qa_match: str | None = None,
             qa_max_new_tokens: int = 16, seed: int = 0, progress: bool = False) -> dict:
    """Fidelity on text (skipped with `n_prompts=0`), passkey (skipped with `passkey_trials=0`) and, for VLMs with
    samples, image QA; a JSON-ready dict. `qa_match` defaults to `exact` for shapes-task records, else `contains`."""
    ks = list(ks) if ks else default_ks(pipe.num_layers)
    names = list(names)
    if "pop-auto" in names and pipe.auto_k is None:
        names.remove("pop-auto")
    variants = variants_for(ks, names, pipe.auto_k, ablation_ks, full_tails)
    out = {"model": str(pipe.name), "num_layers": pipe.num_layers, "ks": ks, "auto_k": pipe.auto_k, "seed": seed,
           "settings": {"n_prompts": n_prompts, "prompt_tokens": prompt_tokens, "continuation": continuation,
                        "passkey_lengths": list(passkey_lengths), "passkey_trials": passkey_trials,
                        "passkey_ks": list(ks if passkey_ks is None else passkey_ks),
                        "ablation_ks": list(ks if ablation_ks is None else ablation_ks),
                        "full_tails": list(full_tails)}}
    out["fidelity"] = fidelity(pipe, variants, n_prompts=n_prompts, prompt_tokens=prompt_tokens,
                               continuation=continuation, seed=seed, progress=progress) if n_prompts > 0 else {}
    if passkey_lengths and passkey_trials:
        pk_ks = set(ks if passkey_ks is None else passkey_ks)
        pk_variants = [v for v in variants if v.name in passkey_names and v.full_tail == 1
                       and (v.name == "full" or v.k in pk_ks)]
        out["passkey"] = passkey(pipe, pk_variants, lengths=passkey_lengths, trials=passkey_trials, seed=seed,
                                 progress=progress)
    if qa_samples is not None and pipe.is_multimodal:
        qa_samples = list(qa_samples)
        match = qa_match or ("exact" if qa_samples and all(map(is_shapes_record, qa_samples)) else "contains")
        qa = image_qa(pipe, qa_samples, variants, max_new_tokens=qa_max_new_tokens, match=match, progress=progress)
        out["image_qa"] = qa["accuracy"]
        out["image_qa_ttft_median_s"] = qa["ttft_median_s"]
        out["settings"].update(qa_n=qa["n"], qa_match=match, qa_max_new_tokens=qa_max_new_tokens)
    return out


def markdown_table(results: dict) -> str:
    """One row per variant: agreement and KL on text, passkey accuracy per length, image QA accuracy and TTFT (the
    columns of the parts that ran)."""
    fid = results.get("fidelity") or {}
    pk = results.get("passkey", {})
    lengths = [str(n) for n in pk.get("lengths", [])]
    qa = results.get("image_qa", {})
    qa_ttft = results.get("image_qa_ttft_median_s", {})
    labels = list(fid) + [label for label in qa if label not in fid]
    head = ["variant"]
    head += ["agreement", "1st-token agr.", "KL 1st", "KL mean"] if fid else []
    head += [f"passkey@{n}" for n in lengths]
    head += ["image QA"] if qa else []
    head += ["TTFT ms", "TTFT full/variant"] if qa_ttft else []
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label in labels:
        row = [label]
        if fid:
            f = fid.get(label)
            row += ([f"{f['agreement']:.3f}", f"{f['first_token_agreement']:.3f}", f"{f['kl_first']:.3f}",
                     f"{f['kl_mean']:.3f}"] if f else ["–"] * 4)
        acc = pk.get("accuracy", {}).get(label)
        row += [f"{acc[n]:.2f}" if acc else "–" for n in lengths]
        if qa:
            row += [f"{qa[label]:.3f}" if label in qa else "–"]
        if qa_ttft:
            t, full = qa_ttft.get(label), qa_ttft.get("full")
            row += [f"{t * 1e3:.1f}" if t else "–", f"{full / t:.2f}×" if t and full else "–"]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def _mean(values) -> float:
    values = [float(v) for v in values]
    return sum(values) / len(values) if values else math.nan


def save(results: dict, out_dir) -> dict:
    """Write eval.json, eval.md and eval.png into `out_dir`; returns their paths."""
    from pathlib import Path

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "eval.json", "markdown": out / "eval.md", "png": out / "eval.png"}
    paths["json"].write_text(json.dumps(results, indent=2) + "\n")
    paths["markdown"].write_text(markdown_table(results) + "\n")
    plots.quality_against_k(results, paths["png"])
    return paths


# ---- the synthetic shapes task ------------------------------------------------------------------------------------
def shapes_groups(record: dict) -> list[str]:
    """The groups a shapes-task record is scored in: all records, its question type, its canvas size."""
    return ["all", f"type:{record['qtype']}", f"size:{record['width']}x{record['height']}"]


def shapes_qa_report(pipe, records: Sequence[dict], modes: Sequence[str] = ("full", "pop", "static"),
                     prune_layers=None, max_new_tokens: int = 4, progress: bool = False,
                     check: int | None = None) -> dict:
    """Exact-match accuracy of each mode on shapes-task records (`pop_vlm.shapes`), overall, by question type and
    by canvas size (`shapes_groups`), with the vision-token counts and each mode's median TTFT (`image_qa`: the
    modes take turns on each record's inputs, in alternating order; the clock is `pipe.timer`). `prune_layers`
    defaults to L/3. `check`: also the accuracy on the first `check` records (``report["check"]``), the set a
    model too slow for all of them is tested on."""
    pop = PopConfig() if prune_layers is None else PopConfig(prune_layers=prune_layers)
    k = pop.num_pruned(pipe.num_layers)
    variants = [Variant(check_mode(mode), k) for mode in modes]  # a Variant takes any other name as a POP variant
    first = {id(record) for record in records[:check]} if check else set()

    def groups(record: dict) -> list[str]:
        return shapes_groups(record) + (["check"] if id(record) in first else [])

    qa = image_qa(pipe, records, variants, max_new_tokens=max_new_tokens, match="exact", group_by=groups,
                  progress=progress)
    by_mode = {v.name: dict(qa["accuracy_by_group"][v.label]) for v in variants}
    checked = {name: groups_.pop("check") for name, groups_ in by_mode.items() if "check" in groups_}
    # the report is keyed by mode ("pop"), image_qa's results by variant label ("pop@2")
    return {
        "model": str(pipe.name), "n": len(records), "k": k, "num_layers": pipe.num_layers,
        "vision_tokens": qa["vision_tokens"],
        "accuracy": by_mode,
        "ttft_median_s": {v.name: qa["ttft_median_s"][v.label] for v in variants},
    } | ({"check": {"n": len(first), "accuracy": checked}} if checked else {})
