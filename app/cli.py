"""`pop-vlm serve`: the app's own command, added to the library's command line through the `pop_vlm.commands`
entry point (pyproject.toml), so that the library never imports the app."""
from __future__ import annotations

import sys


def add_serve_parser(sub) -> None:
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
    limits.add_argument("--max-batch-size", type=int,
                        help="requests decoded together, one batched step per token; 1 runs one request at a time "
                             "[POP_VLM_MAX_BATCH_SIZE]")
    limits.add_argument("--max-tokens-in-flight", type=int,
                        help="prompt + answer tokens the running batch may hold (0: no limit) [POP_VLM_MAX_TOKENS_IN_FLIGHT]")
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


def cmd_serve(args) -> int:
    """The web app and the OpenAI-style API in one process (or, with --ray, in Ray Serve replicas)."""
    if args.ray:
        from .ray_serve import serve_from_cli

        return serve_from_cli(args)
    import uvicorn

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)

    from .auth import api_keys_from, exposure_warning, ui_auth_from
    from .limits import Limits
    from .models import ModelManager, served_models
    from .openai_api import ImageFetchPolicy
    from .server import create_app

    limits = Limits.from_env(max_upload_bytes=args.max_upload_bytes, max_image_pixels=args.max_image_pixels,
                             max_question_chars=args.max_question_chars, max_new_tokens=args.max_new_tokens_cap,
                             queue_size=args.queue_size, request_timeout_s=args.request_timeout,
                             max_batch_size=args.max_batch_size, max_tokens_in_flight=args.max_tokens_in_flight)
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
