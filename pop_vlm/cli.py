"""The `pop-vlm` command."""
from __future__ import annotations

import argparse
import json
import sys

from .config import MODES, PopConfig


def parse_prune_layers(text: str):
    """'auto', an int k, or a fraction of the layer count such as 0.33."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prune-layers takes an int, a fraction or 'auto', not {text!r}") from None


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
    from .pipeline import default_model_name, load

    name = args.model or default_model_name()
    if name is None:
        print("error: no model given and no default model is installed; use --model", file=sys.stderr)
        return 2
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
    ask.add_argument("--json", action="store_true", help="print the answers as JSON")
    ask.set_defaults(func=cmd_answer)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
