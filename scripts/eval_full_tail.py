"""How long a full-model tail POP needs: `PopConfig(full_tail=M | "text")` against the paper's M = 1, same k.

Two parts, both at k = L/3:

- **text** (`gemma-3-270m`, the real pretrained model, k = 6 of 18): teacher-forced next-token agreement and KL
  against the full model's greedy continuation (`pop_vlm.evaluate.forced_logits` with `full_tail`), on seeded
  passages of CPython's pydoc topics, for full_tail = 1, 4, 16, 64 (and static for reference); plus LM time
  (prefill + first token, thread CPU time) of a ~512-token prompt per setting, min and median over repeats.
- **image QA** (the bundled `shapes-qwen3-vl`, k = 2 of 6): exact-match accuracy over `assets/qa/shapes_test.jsonl`
  for full, pop (full_tail=1), pop (full_tail="text") and static, with per-mode TTFT (vision + prefill + first
  token; the inputs are built once per record and shared, so preprocessing is left out) and the tail length.

    PYTHONPATH=. python scripts/eval_full_tail.py --out benchmarks/results
"""
from __future__ import annotations

import argparse
import hashlib
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

import pop_vlm
from pop_vlm import shapes
from pop_vlm.bench import environment, use_thread_clock
from pop_vlm.memory import tune_malloc
from pop_vlm.report import Column, command_line, markdown_table, ms, write_json
from pop_vlm.config import PopConfig
from pop_vlm.evaluate import Variant, fidelity
from pop_vlm.generate import GenerationResult, generate_tokens
from pop_vlm.results import Timings
from pop_vlm.importance import text_passages
from pop_vlm.pop import tail_length

ROOT = Path(__file__).resolve().parents[1]
RECORDS = ROOT / "assets" / "qa" / "shapes_test.jsonl"


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else float("nan")


# ---- text: gemma-3-270m -------------------------------------------------------------------------------------------
def text_part(tails=(1, 4, 16, 64), n_prompts: int = 8, prompt_tokens: int = 512, continuation: int = 32,
              timing_repeats: int = 5, seed: int = 0, log=print) -> dict:
    pipe = pop_vlm.load("gemma-3-270m", device="cpu")
    adapter = pipe.adapter
    k = PopConfig().num_pruned(pipe.num_layers)  # L/3
    pruned = [Variant("pop", k, full_tail=m) for m in tails] + [Variant("static", k)]
    fid = fidelity(pipe, pruned, n_prompts=n_prompts, prompt_tokens=prompt_tokens, continuation=continuation,
                   seed=seed, progress=True)
    stats = {(v.name, v.full_tail): fid[v.label] for v in pruned}
    inputs = {"input_ids": pipe.tokenizer(next(iter(text_passages(1, prompt_tokens * 8, seed=seed + 1))),
                                          return_tensors="pt").input_ids[:, :prompt_tokens]}  # fidelity's first prompt

    # LM time at one ~prompt_tokens prompt, settings interleaved in a rotating order
    timing_settings = [("full", 1)] + [("pop", m) for m in tails] + [("static", 1)]
    times = {s: [] for s in timing_settings}

    def run(name, m):
        result = GenerationResult(timings=Timings())
        pop = PopConfig(prune_layers=k, full_tail=m)
        for _ in generate_tokens(adapter, inputs, mode=name, pop=pop, max_new_tokens=1, result=result,
                                 timer=time.thread_time):
            pass
        return result.timings.prefill_s + result.timings.first_token_s

    for s in timing_settings:  # warm-up (fused K/V weights are built here)
        run(*s)
    for r in range(timing_repeats):
        order = timing_settings[r % len(timing_settings):] + timing_settings[: r % len(timing_settings)]
        for s in order:
            times[s].append(run(*s))
    full_median = statistics.median(times["full", 1])
    rows = []
    for name, m in timing_settings:
        row = {"mode": name, "full_tail": m if name == "pop" else None, "k": 0 if name == "full" else k,
               **(fid["full"] if name == "full" else stats[name, m]),
               "lm_s": statistics.median(times[name, m]), "lm_min_s": min(times[name, m])}
        row["lm_speedup"] = full_median / row["lm_s"]
        rows.append(row)
    return {"model": "gemma-3-270m", "num_layers": pipe.num_layers, "k": k, "n_prompts": n_prompts,
            "prompt_tokens": int(inputs["input_ids"].shape[1]), "continuation": continuation,
            "timing_repeats": timing_repeats, "rows": rows}


# ---- image QA: shapes-qwen3-vl ------------------------------------------------------------------------------------
def vlm_part(n_records: int | None = None, seed: int = 0, max_new_tokens: int = 4, log=print) -> dict:
    weights = ROOT / "assets" / "models"
    pipe = pop_vlm.load("shapes-qwen3-vl", device="cpu")
    use_thread_clock(pipe, torch.get_num_threads())
    digest = ""
    for path in sorted(weights.rglob("model.safetensors")):
        digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    records = [json.loads(line) for line in RECORDS.read_text().splitlines() if line.strip()]
    subset = "all"
    if n_records and n_records < len(records):
        records = random.Random(seed).sample(records, n_records)
        subset = f"seeded random subset (random.Random({seed}).sample)"
    k = PopConfig().num_pruned(pipe.num_layers)
    settings = [("full", "full", None), ("pop (full_tail=1)", "pop", 1), ('pop (full_tail="text")', "pop", "text"),
                ("static", "static", None)]
    hits = {label: [] for label, *_ in settings}
    timing = {label: {"vision_s": [], "prefill_s": [], "first_token_s": [], "ttft_s": []} for label, *_ in settings}
    tails, prompt_lengths, vision_tokens = [], [], []
    for i, record in enumerate(records):
        image, question, answer = shapes.sample_from_record(record)
        inputs = pipe.build_inputs(image, question)
        order = settings[i % len(settings):] + settings[: i % len(settings)]
        for label, mode, tail in order:
            pop = PopConfig(prune_layers=k, full_tail=tail if tail is not None else 1)
            result = pipe.generate(inputs, mode=mode, pop=pop, max_new_tokens=max_new_tokens)
            hits[label].append(shapes.score(result.text, answer))
            t = result.timings
            for name in ("vision_s", "prefill_s", "first_token_s"):
                timing[label][name].append(getattr(t, name))
            timing[label]["ttft_s"].append(t.vision_s + t.prefill_s + t.first_token_s)
        prompt = pipe.adapter.encode(inputs)
        tails.append(tail_length(prompt, "text"))
        prompt_lengths.append(prompt.length)
        vision_tokens.append(int(prompt.image_mask.sum()) if prompt.image_mask is not None else 0)
        if (i + 1) % 50 == 0:
            log(f"  shapes QA {i + 1}/{len(records)}: " + "  ".join(f"{l} {_mean(h):.3f}" for l, h in hits.items()))
    full_ttft = statistics.median(timing["full"]["ttft_s"])
    rows = []
    for label, mode, tail in settings:
        row = {"setting": label, "mode": mode, "full_tail": tail, "k": 0 if mode == "full" else k,
               "accuracy": _mean(hits[label]), "correct": int(sum(hits[label]))}
        for name, values in timing[label].items():
            row[name] = statistics.median(values)
        row["ttft_min_s"] = min(timing[label]["ttft_s"])
        row["ttft_speedup"] = full_ttft / row["ttft_s"]
        rows.append(row)
    return {"model": "shapes-qwen3-vl", "weights_sha256_16": digest, "num_layers": pipe.num_layers, "k": k,
            "n": len(records), "subset": subset, "max_new_tokens": max_new_tokens,
            "prompt_tokens": {"mean": _mean(prompt_lengths), "min": min(prompt_lengths), "max": max(prompt_lengths)},
            "vision_tokens": {"mean": _mean(vision_tokens), "min": min(vision_tokens), "max": max(vision_tokens)},
            "text_tail_tokens": {"mean": _mean(tails), "min": min(tails), "max": max(tails)}, "rows": rows}


# ---- output -------------------------------------------------------------------------------------------------------
TEXT_COLUMNS = (
    Column("setting", lambda r: r["mode"] if r["mode"] != "pop" else f"pop, full_tail={r['full_tail']}"),
    Column("agreement", lambda r: f"{r['agreement']:.3f}"),
    Column("first-token agreement", lambda r: f"{r['first_token_agreement']:.3f}"),
    Column("KL first (nats)", lambda r: f"{r['kl_first']:.4f}"), Column("KL mean (nats)", lambda r: f"{r['kl_mean']:.4f}"),
    Column("LM ms (median)", lambda r: f"{r['lm_s'] * 1e3:.0f}"), Column("LM ms (min)", lambda r: f"{r['lm_min_s'] * 1e3:.0f}"),
    Column("LM speedup", lambda r: f"{r['lm_speedup']:.2f}x"),
)


def vlm_columns(n: int) -> tuple[Column, ...]:
    return (Column("setting", lambda r: r["setting"]),
            Column("exact match", lambda r: f"{r['accuracy']:.3f} ({r['correct']}/{n})"),
            Column("vision ms", ms("vision_s")), Column("prefill ms", ms("prefill_s")),
            Column("first token ms", ms("first_token_s")), Column("TTFT ms (median)", ms("ttft_s")),
            Column("TTFT ms (min)", ms("ttft_min_s")), Column("TTFT speedup", lambda r: f"{r['ttft_speedup']:.2f}x"))


def text_table(part: dict) -> str:
    lines = [f"{part['model']}: k = {part['k']} of {part['num_layers']}, {part['n_prompts']} prompts of "
             f"{part['prompt_tokens']} tokens, {part['continuation']}-token greedy continuation of the full model; "
             f"LM time at one {part['prompt_tokens']}-token prompt, {part['timing_repeats']} repeats",
             ""]
    return "\n".join(lines + markdown_table(TEXT_COLUMNS, part["rows"]))


def vlm_table(part: dict) -> str:
    lines = [f"{part['model']}: k = {part['k']} of {part['num_layers']}, {part['n']} records ({part['subset']}) of "
             f"assets/qa/shapes_test.jsonl; prompts {part['prompt_tokens']['min']}–{part['prompt_tokens']['max']} "
             f"tokens ({part['vision_tokens']['min']}–{part['vision_tokens']['max']} vision tokens); the text tail "
             f"(after the last image token) is {part['text_tail_tokens']['min']}–{part['text_tail_tokens']['max']} "
             f"tokens; TTFT = vision + prefill + first token, median over records",
             ""]
    return "\n".join(lines + markdown_table(vlm_columns(part["n"]), part["rows"]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default="text,vlm")
    parser.add_argument("--tails", default="1,4,16,64")
    parser.add_argument("--n-prompts", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--continuation", type=int, default=32)
    parser.add_argument("--timing-repeats", type=int, default=5)
    parser.add_argument("--records", type=int, default=0, help="a seeded subset of the QA records (0: all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="folder for full_tail.json (the markdown is written by hand from it)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    tune_malloc()
    torch.set_flush_denormal(True)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    parts = [p for p in args.parts.split(",") if p]
    report = {"meta": {
        "command": command_line("scripts/eval_full_tail.py", argv), "threads": 1, "clock": "thread CPU time",
        **environment(torch.device("cpu")), "dtype": "float32"}}
    if "text" in parts:
        report["text"] = text_part(tails=[int(x) for x in args.tails.split(",")], n_prompts=args.n_prompts,
                                   prompt_tokens=args.prompt_tokens, continuation=args.continuation,
                                   timing_repeats=args.timing_repeats, seed=args.seed, log=log)
        print(text_table(report["text"]) + "\n", flush=True)
    if "vlm" in parts:
        report["vlm"] = vlm_part(n_records=args.records or None, seed=args.seed, log=log)
        print(vlm_table(report["vlm"]) + "\n", flush=True)
    if args.out:
        name = "full_tail.json" if parts == ["text", "vlm"] else f"full_tail-{'-'.join(parts)}.json"
        path = write_json(report, Path(args.out) / name)
        print(f"wrote {path}", file=sys.stderr)
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
