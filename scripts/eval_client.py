"""Score the HTTP API with an outside harness: lm-evaluation-harness (`pip install "lm-eval[api]"`) runs a small
few-shot task — "Q: What is the capital of X?\\nA:" with three examples before it — through `local-completions`
(/v1/completions) and `local-chat-completions` (/v1/chat/completions) of a server started here on loopback, once
with the full model and once with POP, and prints a table.

Beside each lm-eval score, the script computes the reference the harness should reproduce: the same greedy
requests sent without `stop` (through the openai client), cut at the first newline by the script and scored the
same way (exact match, case and punctuation ignored). Equal numbers, and equal answers document by document, mean
that the server honours `stop` as the harness relies on.

    python scripts/eval_client.py --model gemma-3-270m            # about 5 minutes on 2 CPU cores

Not part of the test suite: it needs lm-eval and the model's weights.
"""
from __future__ import annotations

import argparse
import json
import os
import string
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
# everything is local: the task's data, the model, the tokenizer
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

#: (country, capital): the first FEW_SHOT are the examples every question is preceded by, the rest are scored
CAPITALS = [
    ("France", "Paris"), ("Japan", "Tokyo"), ("Italy", "Rome"),
    ("Germany", "Berlin"), ("Spain", "Madrid"), ("Russia", "Moscow"), ("China", "Beijing"), ("Egypt", "Cairo"),
    ("Greece", "Athens"), ("Portugal", "Lisbon"), ("Austria", "Vienna"), ("Poland", "Warsaw"),
    ("Norway", "Oslo"), ("Sweden", "Stockholm"), ("Finland", "Helsinki"), ("Denmark", "Copenhagen"),
    ("Ireland", "Dublin"), ("Hungary", "Budapest"), ("Belgium", "Brussels"), ("the Netherlands", "Amsterdam"),
    ("Czechia", "Prague"), ("Thailand", "Bangkok"), ("South Korea", "Seoul"), ("Indonesia", "Jakarta"),
    ("Argentina", "Buenos Aires"), ("Peru", "Lima"), ("Chile", "Santiago"), ("Colombia", "Bogotá"),
    ("Mexico", "Mexico City"), ("Cuba", "Havana"), ("Kenya", "Nairobi"), ("Ethiopia", "Addis Ababa"),
    ("Iran", "Tehran"), ("Iraq", "Baghdad"), ("Turkey", "Ankara"), ("Ukraine", "Kyiv"), ("Romania", "Bucharest"),
    ("Bulgaria", "Sofia"), ("Serbia", "Belgrade"), ("Croatia", "Zagreb"), ("Vietnam", "Hanoi"),
    ("the Philippines", "Manila"), ("Afghanistan", "Kabul"),
]
FEW_SHOT = 3
QUESTION = "Q: What is the capital of {country}?\nA:"
MAX_TOKENS = 12


def normalise(text: str) -> str:
    """lm-eval's exact_match with ignore_case and ignore_punctuation, after its leading-whitespace filter."""
    return text.lstrip().lower().translate(str.maketrans("", "", string.punctuation))


def few_shot_prompt(country: str) -> str:
    shots = "".join(QUESTION.format(country=c) + " " + a + "\n" for c, a in CAPITALS[:FEW_SHOT])
    return shots + QUESTION.format(country=country)


def write_task(folder: Path, name: str, mode: str, prune_layers) -> None:
    """A local lm-eval task; the `pop` extension rides in generation_kwargs, which lm-eval puts in each request."""
    files = {"train": CAPITALS[:FEW_SHOT], "test": CAPITALS[FEW_SHOT:]}
    for split, rows in files.items():
        lines = [json.dumps({"country": c, "capital": a}) + "\n" for c, a in rows]
        (folder / f"{split}.jsonl").write_text("".join(lines))
    pop = {"mode": mode} if mode == "full" else {"mode": mode, "prune_layers": prune_layers}
    task = {
        "task": name, "dataset_path": "json",
        "dataset_kwargs": {"data_files": {split: str(folder / f"{split}.jsonl") for split in files}},
        "output_type": "generate_until", "training_split": "train", "test_split": "test",
        "fewshot_split": "train", "num_fewshot": FEW_SHOT, "fewshot_config": {"sampler": "first_n"},
        "doc_to_text": QUESTION.replace("{country}", "{{country}}"), "doc_to_target": "{{capital}}",
        "target_delimiter": " ", "fewshot_delimiter": "\n",
        "generation_kwargs": {"until": ["\n"], "max_gen_toks": MAX_TOKENS, "temperature": 0, "do_sample": False,
                              "pop": pop},
        "filter_list": [{"name": "strip", "filter": [{"function": "remove_whitespace"}, {"function": "take_first"}]}],
        "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True,
                         "ignore_case": True, "ignore_punctuation": True}],
    }
    (folder / f"{name}.yaml").write_text(json.dumps(task, indent=1))  # JSON is YAML


def run_lm_eval(url: str, model: str, tokenizer: str, task_dir: Path, task: str, chat: bool, limit: int) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    if chat:
        name, args = "local-chat-completions", f"base_url={url}/v1/chat/completions,model={model},num_concurrent=1"
    else:
        name = "local-completions"
        args = (f"base_url={url}/v1/completions,model={model},tokenizer_backend=huggingface,tokenizer={tokenizer},"
                "tokenized_requests=False,num_concurrent=1")
    # the chat interface gets the few-shot text as one user message: a base model has no chat template to render
    # the examples as turns (the server joins a template-less conversation's texts with newlines)
    results = lm_eval.simple_evaluate(model=name, model_args=args, tasks=[task], apply_chat_template=chat,
                                      fewshot_as_multiturn=False,
                                      task_manager=TaskManager(include_path=str(task_dir)), log_samples=True,
                                      limit=limit, batch_size=1)
    samples = sorted(results["samples"][task], key=lambda s: s["doc_id"])
    return {"score": results["results"][task]["exact_match,strip"],
            "answers": [s["filtered_resps"][0] for s in samples]}


def reference(client, model: str, mode: str, prune_layers, chat: bool, limit: int) -> dict:
    """The same greedy requests without `stop`, cut at the first newline here."""
    pop = {"mode": mode} if mode == "full" else {"mode": mode, "prune_layers": prune_layers}
    answers, hits, unstopped = [], 0, 0
    for country, capital in CAPITALS[FEW_SHOT:FEW_SHOT + limit]:
        prompt = few_shot_prompt(country)
        if chat:
            text = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                  max_tokens=MAX_TOKENS, temperature=0, seed=1234,
                                                  extra_body={"pop": pop}).choices[0].message.content
        else:
            text = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                             seed=1234, extra_body={"pop": pop}).choices[0].text
        unstopped += normalise(text) == normalise(capital)
        cut = text.split("\n")[0].lstrip()
        answers.append(cut)
        hits += normalise(cut) == normalise(capital)
    return {"score": hits / limit, "answers": answers, "unstopped": unstopped / limit}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--prune-layers", default="auto", help="POP's k (an int, a fraction, or auto)")
    parser.add_argument("--limit", type=int, default=len(CAPITALS) - FEW_SHOT, help="questions scored")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, help="write the table's numbers here as JSON")
    args = parser.parse_args(argv)

    import openai
    import torch

    from app.models import ModelManager
    from app.server import create_app
    from pop_vlm import PopConfig, zoo
    from tests.serving import LoopbackServer

    torch.set_num_threads(args.threads)
    limit = min(args.limit, len(CAPITALS) - FEW_SHOT)
    prune = args.prune_layers if args.prune_layers == "auto" else float(args.prune_layers)
    prune = int(prune) if isinstance(prune, float) and prune.is_integer() else prune
    manager = ModelManager(args.model, device="cpu")
    rows = []
    with tempfile.TemporaryDirectory() as tmp, LoopbackServer(create_app(manager)) as server:
        if prune == "auto" and manager.get(args.model).auto_k is None:
            prune = 1 / 3  # no importance profile for this model: the default L/3
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        task_dir = Path(tmp)
        for mode in ("full", "pop"):
            write_task(task_dir, f"capitals_{mode}", mode, prune)
            for chat in (False, True):
                harness = run_lm_eval(server.url, args.model, zoo.resolve(args.model), task_dir, f"capitals_{mode}",
                                      chat, limit)
                ref = reference(client, args.model, mode, prune, chat, limit)
                agree = sum(a.lstrip() == b for a, b in zip(harness["answers"], ref["answers"]))
                rows.append({"interface": "local-chat-completions" if chat else "local-completions", "mode": mode,
                             "lm_eval_exact_match": harness["score"], "reference_cut_at_newline": ref["score"],
                             "reference_without_stop": ref["unstopped"], "answers_agreeing": agree, "n": limit})
    pipe = manager.get(args.model)
    k = PopConfig(prune_layers=prune).num_pruned(pipe.num_layers, pipe.auto_k)
    print(f"\n{args.model}, {limit} questions, {FEW_SHOT}-shot, greedy; POP skips {k} of {pipe.num_layers} layers "
          "in the prefill\n")
    print("| lm-eval model | mode | lm-eval exact match | reference: cut at \\n | without stop | same answers |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['interface']} | {r['mode']} | {r['lm_eval_exact_match']:.3f} | {r['reference_cut_at_newline']:.3f}"
              f" | {r['reference_without_stop']:.3f} | {r['answers_agreeing']}/{r['n']} |")
    if args.out:
        args.out.write_text(json.dumps({"model": args.model, "pruned_layers": k, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
