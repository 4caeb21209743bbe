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


def cmd_serve(args) -> int:
    """The web app and the OpenAI-style API in one process (or, with --ray, in Ray Serve replicas)."""
    if args.ray:
        from app.ray_serve import serve_from_cli

        return serve_from_cli(args)
    import uvicorn

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)

    from app.auth import api_keys_from, exposure_warning, ui_auth_from
    from app.limits import Limits
    from app.models import ModelManager, served_models
    from app.openai_api import ImageFetchPolicy
    from app.server import create_app

    limits = Limits.from_env(max_upload_bytes=args.max_upload_bytes, max_image_pixels=args.max_image_pixels,
                             max_question_chars=args.max_question_chars, max_new_tokens=args.max_new_tokens_cap,
                             queue_size=args.queue_size, request_timeout_s=args.request_timeout)
    keys, ui_auth = api_keys_from(args.api_key), ui_auth_from(args.ui_auth)
    served = served_models(args.model)
    manager = ModelManager(device=args.device, dtype=args.dtype, allowed_root=args.allowed_model_root, limits=limits,
                           trust_remote_code=args.trust_remote_code, served=served, allow_any=args.allow_any_model)
    if manager.default is None:
        print("error: no model given and no default model is installed; use --model", file=sys.stderr)
        return 2
    warning = exposure_warning(args.host, keys)
    if warning:
        print(f"warning: {warning}", file=sys.stderr)
    policy = ImageFetchPolicy(allow_remote=args.allow_remote_images)
    app = create_app(manager, policy=policy, queue_size=limits.queue_size, api_keys=keys, ui_auth=ui_auth)
    print(f"pop-vlm serving {', '.join(manager.served)} on http://{args.host}:{args.port}  "
          f"(API: /v1/chat/completions, /healthz{'; API key required' if keys else ''})")
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def _load_for_study(args):
    import torch

    from .pipeline import default_model_name, load

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
    from pathlib import Path

    from . import evaluate
    from .importance import LayerImportance

    pipe = _load_for_study(args)
    if args.importance:
        pipe.auto_k = LayerImportance.from_json(args.importance).auto_k(args.budget)
    qa = None
    if args.qa:
        with open(args.qa) as f:
            qa = [json.loads(line) for line in f if line.strip()]
    results = evaluate.run_eval(
        pipe, ks=args.ks, n_prompts=args.prompts, prompt_tokens=args.prompt_tokens, continuation=args.continuation,
        passkey_lengths=args.passkey_lengths, passkey_trials=args.passkey_trials, passkey_ks=args.passkey_ks, qa_samples=qa, seed=args.seed,
        progress=True,
    )
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

    serve = sub.add_parser("serve", help="start the web app and the OpenAI-style HTTP API")
    serve.add_argument("--model", action="append",
                       help="a model to serve (hub id, local folder or bundled name); repeat for several, the first "
                            "is the default [POP_VLM_MODELS, comma-separated]; default: the bundled demo models")
    serve.add_argument("--allow-any-model", action="store_true",
                       help="let requests name any hub id or local folder (under --allowed-model-root), which the "
                            "server then downloads or reads; off by default")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    serve.add_argument("--port", type=int, default=7860)
    serve.add_argument("--device", default="auto")
    serve.add_argument("--dtype", default="auto")
    limits = serve.add_argument_group("limits (each also set by the environment variable named in brackets)")
    limits.add_argument("--max-upload-bytes", type=int, help="largest image, after base64 decoding [POP_VLM_MAX_UPLOAD_BYTES]")
    limits.add_argument("--max-image-pixels", type=int, help="larger images are refused before decoding [POP_VLM_MAX_IMAGE_PIXELS]")
    limits.add_argument("--max-question-chars", type=int, help="longest question [POP_VLM_MAX_QUESTION_CHARS]")
    limits.add_argument("--max-new-tokens-cap", type=int, help="largest max_tokens a request may ask [POP_VLM_MAX_NEW_TOKENS]")
    limits.add_argument("--queue-size", type=int, help="requests waiting beyond this are refused [POP_VLM_QUEUE_SIZE]")
    limits.add_argument("--request-timeout", type=float, help="seconds for waiting plus generating [POP_VLM_REQUEST_TIMEOUT_S]")
    serve.add_argument("--trust-remote-code", action="store_true", help="run model code from the hub (off by default)")
    serve.add_argument("--allow-remote-images", action="store_true", help="let the API fetch http(s) image URLs")
    serve.add_argument("--allowed-model-root", help="with --allow-any-model: local model folders must lie under this folder")
    serve.add_argument("--api-key", action="append",
                       help="every /v1/* request needs 'Authorization: Bearer <key>' and the page a login; repeat "
                            "for several keys [POP_VLM_API_KEY, comma-separated; better, since arguments show in "
                            "the process list]")
    serve.add_argument("--ui-auth", action="append", metavar="USER:PASSWORD",
                       help="the page's login (default with an API key: any user name, a key as the password) "
                            "[POP_VLM_UI_AUTH]")
    serve.add_argument("--log-level", default="info")
    serve.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    serve.add_argument("--ray", action="store_true",
                       help="serve from Ray Serve replicas (one model each) behind the same API (needs the ray extra)")
    serve.add_argument("--replicas", default="1", help="with --ray: replica count, or 'auto' to autoscale 1..--max-replicas")
    serve.add_argument("--max-replicas", type=int, default=4, help="with --ray --replicas auto: the most replicas")
    serve.add_argument("--num-gpus", type=float, default=0, help="with --ray: GPUs per replica (e.g. 1, or 0.5 to pack two)")
    serve.add_argument("--num-cpus", type=float, default=1, help="with --ray: CPUs per replica")
    serve.add_argument("--ray-address", help="with --ray: join this Ray cluster (e.g. auto) instead of starting one")
    serve.set_defaults(func=cmd_serve)

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
            study.add_argument("--qa", help="jsonl of {image, question, answer} for image QA (VLMs)")
        study.set_defaults(func=func)
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
