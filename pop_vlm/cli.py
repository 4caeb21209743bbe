"""The `pop-vlm` command."""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from importlib.metadata import entry_points

from .config import MODES, PopConfig, check_full_tail
from .config import parse_prune_layers as parse_prune_value

#: entry-point group through which installed packages add commands (the app adds `serve`): the library never
#: imports the app
COMMANDS_GROUP = "pop_vlm.commands"


def parse_prune_layers(text: str):
    """--prune-layers: 'auto', an int k, or a fraction of the layer count such as 0.33."""
    try:
        return parse_prune_value(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def full_tail_value(text: str):
    """--full-tails: a positive number of tokens, or 'text' (everything after the last image token)."""
    try:
        return check_full_tail(text if text == "text" else int(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a full tail is a positive number of tokens or 'text', got {text!r}") from None


def format_timings(rows: list[tuple[str, object]]) -> str:
    """A small table: one row per answer, columns of the TTFT breakdown."""
    header = f"{'mode':<8}{'prompt':>8}{'image':>7}{'preproc':>10}{'vision':>9}{'prefill':>10}{'1st tok':>9}{'TTFT':>9}{'dec tok/s':>11}"
    lines = [header, "-" * len(header)]
    for mode, answer in rows:
        t = answer.timings
        lines.append(
            f"{mode:<8}{answer.n_prompt_tokens:>8}{answer.n_image_tokens:>7}{t.preprocess_s * 1e3:>8.1f}ms"
            f"{t.vision_s * 1e3:>7.1f}ms{t.prefill_s * 1e3:>8.1f}ms{t.first_token_s * 1e3:>7.1f}ms"
            f"{t.ttft_s * 1e3:>7.1f}ms{t.decode_tokens_per_s:>11.1f}"
        )
    return "\n".join(lines)


def cmd_answer(args) -> int:
    from .loading import default_model_name, load

    name = args.model or default_model_name()
    if name is None:
        print("error: no model given and no default model is installed; use --model", file=sys.stderr)
        return 2
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    pipe = load(name, device=args.device, dtype=args.dtype)
    pop = PopConfig(prune_layers=args.prune_layers, kv_projection=not args.no_kv_projection, boundary=not args.no_boundary)
    modes = MODES if args.mode == "all" else [args.mode]
    answers = []
    for mode in modes:
        answer = pipe.answer(args.image, args.question, mode=mode, pop=pop, max_new_tokens=args.max_new_tokens,
                             do_sample=args.temperature > 0, temperature=args.temperature or 1.0, seed=args.seed)
        answers.append((mode, answer))
    if args.json:
        print(json.dumps([a.as_dict() for _, a in answers]))
        return 0
    for mode, answer in answers:
        layers = f" (prefill skips layers {answer.pruned_layers[0]}-{answer.pruned_layers[-1]})" if answer.pruned_layers else ""
        print(f"[{mode}]{layers} {answer.text}")
    print()
    print(format_timings(answers))
    return 0


def _load_for_study(args):
    import torch

    from .loading import default_model_name, load

    if args.threads:
        torch.set_num_threads(args.threads)
    name = args.model or default_model_name()
    if name is None:
        raise ValueError("no model given and no default model is installed; use --model")
    return load(name, device=args.device, dtype=args.dtype)


def cmd_importance(args) -> int:
    """Per-stage virtual-gate importance and Block Influence: importance.json and importance.png in --out."""
    from pathlib import Path

    from . import plots

    pipe = _load_for_study(args)
    profile = pipe.importance(n_prompts=args.prompts, samples_per_prompt=args.samples_per_prompt,
                              prompt_tokens=args.prompt_tokens, answer_tokens=args.answer_tokens, seed=args.seed,
                              budget=args.budget, progress=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    profile.to_json(out / "importance.json")
    plots.importance_profile(profile, out / "importance.png")
    print(f"{'layer':>5}{'prefill':>12}{'decode':>12}{'BI':>8}")
    for row in profile.as_table():
        print(f"{row['layer']:>5}{row['prefill_share']:>12.4f}{row['decode_share']:>12.4f}{row['block_influence']:>8.3f}")
    print(f"auto k (budget {args.budget:.0%} of prefill importance): {pipe.auto_k}")
    print(f"wrote {out / 'importance.json'} and {out / 'importance.png'}")
    return 0


def cmd_eval(args) -> int:
    """Fidelity (agreement, KL), passkey and image QA of full / pop / static / ablations: eval.{json,md,png}."""
    import json

    from . import evaluate
    from .bench import environment, use_thread_clock
    from .importance import LayerImportance

    pipe = _load_for_study(args)
    if args.importance:
        pipe.auto_k = LayerImportance.from_json(args.importance).auto_k(args.budget)
    clock = use_thread_clock(pipe, args.threads)
    qa = None
    if args.qa:
        with open(args.qa) as f:
            qa = [json.loads(line) for line in f if line.strip()]
    results = evaluate.run_eval(
        pipe, ks=args.ks, n_prompts=args.prompts, prompt_tokens=args.prompt_tokens, continuation=args.continuation,
        passkey_lengths=args.passkey_lengths, passkey_trials=args.passkey_trials, passkey_ks=args.passkey_ks,
        ablation_ks=args.ablation_ks, full_tails=args.full_tails, qa_samples=qa, qa_match=args.qa_match,
        qa_max_new_tokens=args.qa_max_new_tokens, seed=args.seed, progress=True,
    )
    results["settings"]["clock"] = clock
    results["command"] = "pop-vlm " + " ".join(shlex.quote(a) for a in args.argv)
    results["environment"] = environment(pipe.device)
    paths = evaluate.save(results, args.out)
    print(evaluate.markdown_table(results))
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pop-vlm", description="Vision-language models with Prefill-Only Pruning")
    sub = parser.add_subparsers(dest="command", required=True)

    ask = sub.add_parser("answer", help="answer a question about an image and print the timings")
    ask.add_argument("--model", help="hub id, local folder or bundled model name (default: the offline default)")
    ask.add_argument("--image", help="image file (omit for text-only questions)")
    ask.add_argument("--question", required=True)
    ask.add_argument("--mode", choices=[*MODES, "all"], default="pop")
    ask.add_argument("--prune-layers", type=parse_prune_layers, default=1 / 3, help="k, a fraction of L, or auto (default L/3)")
    ask.add_argument("--no-kv-projection", action="store_true", help="ablation: skipped layers get no prompt KV")
    ask.add_argument("--no-boundary", action="store_true", help="ablation: first token from the pruned stack")
    ask.add_argument("--max-new-tokens", type=int, default=128)
    ask.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ask.add_argument("--seed", type=int)
    ask.add_argument("--device", default="auto")
    ask.add_argument("--dtype", default="auto")
    ask.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    ask.add_argument("--json", action="store_true", help="print the answers as JSON")
    ask.set_defaults(func=cmd_answer)

    for command in entry_points(group=COMMANDS_GROUP):
        command.load()(sub)  # e.g. `serve`, from the app
    if "serve" not in sub.choices:
        missing = sub.add_parser("serve", help="start the web app and the HTTP API (needs the app installed)")
        missing.set_defaults(func=lambda args: _missing_app())

    from .bench import add_parser as add_bench_parser

    add_bench_parser(sub, parse_prune_layers)

    for name, func, text in (("importance", cmd_importance, "per-stage layer importance (JSON + PNG)"),
                             ("eval", cmd_eval, "fidelity of pop / static / ablations against the full model")):
        study = sub.add_parser(name, help=text)
        study.add_argument("--model", help="hub id, local folder or zoo name (e.g. gemma-3-270m)")
        study.add_argument("--out", required=True, help="output folder")
        study.add_argument("--prompts", type=int, default=8, help="calibration / evaluation prompts")
        study.add_argument("--prompt-tokens", type=int, default=192 if name == "importance" else 256)
        study.add_argument("--seed", type=int, default=0)
        study.add_argument("--budget", type=float, default=0.02, help="'auto' budget: share of prefill importance")
        study.add_argument("--device", default="auto")
        study.add_argument("--dtype", default="auto")
        study.add_argument("--threads", type=int, help="torch CPU threads")
        if name == "importance":
            study.add_argument("--samples-per-prompt", type=int, default=4, help="label draws per prompt (Fisher)")
            study.add_argument("--answer-tokens", type=int, default=32)
        else:
            study.add_argument("--ks", type=int, nargs="+", help="prune depths (default L/6 .. L/2)")
            study.add_argument("--continuation", type=int, default=32, help="teacher-forced tokens per prompt")
            study.add_argument("--passkey-lengths", type=int, nargs="*", default=[256, 1024, 4096])
            study.add_argument("--passkey-trials", type=int, default=4, help="prompts per length")
            study.add_argument("--passkey-ks", type=int, nargs="+", help="prune depths for passkey (default: --ks)")
            study.add_argument("--importance", help="importance.json: adds pop at its auto k")
            study.add_argument("--ablation-ks", type=int, nargs="+",
                               help="prune depths of the ablations and --full-tails (default: --ks)")
            study.add_argument("--full-tails", type=full_tail_value, nargs="+", default=[],
                               help="also POP with these full tails (a number of tokens, or 'text') at --ablation-ks")
            study.add_argument("--qa", help="jsonl of {image, question, answer} for image QA (VLMs), or of shapes-task "
                                            "records such as assets/qa/shapes_test.jsonl")
            study.add_argument("--qa-match", choices=["contains", "exact"],
                               help="how an answer counts (default: exact for shapes-task records, else contains)")
            study.add_argument("--qa-max-new-tokens", type=int, default=16)
        study.set_defaults(func=func)
    return parser


def _missing_app() -> int:
    print("error: the web app and server are not installed: install pop-vlm with its app (pip install -e .)",
          file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # for the record of what was run
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
