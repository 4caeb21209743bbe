"""Scale-out on Ray Serve: one model per replica, the same FastAPI app (API + Gradio page) as the ingress.

    pop-vlm serve --ray --replicas 4 --num-gpus 1            # one machine: starts Ray and Serve locally
    serve run deploy/ray-serve.yaml                          # a cluster: import path app.ray_serve:build_app

Each replica builds its own `ModelManager` and `create_app(...)` when it starts (so nothing heavy is pickled), loads
the model before it reports ready, and names itself in the `x-pop-vlm-replica` response header as
`<app>#<deployment>#<replica id>`. The web page is stateful per browser, so requests are routed by
`ray_router.BrowserSessionRouter`: a browser stays on the replica that served its page, the API spreads freely.
Ray is imported lazily: the rest of the project never needs it.
"""
from __future__ import annotations

import os
import time
from typing import Any

APP_NAME = "pop-vlm"
DEPLOYMENT_NAME = "PopVLM"
DEFAULT_MAX_ONGOING_REQUESTS = 64


class PopVLMReplica:
    """The deployment's user class: it owns the model; Serve's ingress wrapper serves `create_app`'s ASGI app."""

    def __init__(self, model: str | None = None, device: str = "auto", dtype: str = "auto", queue_size: int = 16,
                 allow_remote_images: bool = False, allowed_model_root: str | None = None,
                 models: list[str] | None = None, allow_any_model: bool = False, api_keys: list[str] | None = None,
                 ui_auth: list[str] | None = None):
        from .auth import api_keys_from, ui_auth_from
        from .models import ModelManager, served_models

        # keys and served models not given here come from the replica's environment (a Serve config's runtime_env)
        served = served_models(models or ([model] if model else None))
        self.manager = ModelManager(model, device=device, dtype=dtype, allowed_root=allowed_model_root,
                                    served=served, allow_any=allow_any_model)
        self.api_keys, self.ui_auth = api_keys_from(api_keys), ui_auth_from(ui_auth)
        self.queue_size = queue_size
        self.allow_remote_images = allow_remote_images
        self.server = None  # the FastAPI app, once built (the ingress wrapper owns the name `app`)

    def __serve_build_asgi_app__(self):
        from ray import serve

        from .openai_api import ImageFetchPolicy
        from .ray_router import SESSION_COOKIE
        from .server import create_app

        # the model loads here, before Serve marks the replica RUNNING and routes requests to it
        self.server = create_app(self.manager, policy=ImageFetchPolicy(allow_remote=self.allow_remote_images),
                                 queue_size=self.queue_size, load_in_background=False, replica=replica_name(),
                                 session_cookie=(SESSION_COOKIE, serve.get_replica_context().replica_id.unique_id),
                                 api_keys=self.api_keys, ui_auth=self.ui_auth)
        return self.server

    def record_autoscaling_stats(self) -> dict[str, float]:
        """What `ray_scaling.scale_on_model_requests` scales on (Serve polls it)."""
        from .ray_scaling import MODEL_REQUESTS

        work = self.server.state.model_requests() if self.server is not None else self.manager.requests_in_line
        return {MODEL_REQUESTS: float(work)}

    def check_health(self):
        """Serve calls this periodically; raising makes it replace the replica."""
        if self.manager.load_error:
            raise RuntimeError(f"model failed to load: {self.manager.load_error}")


def replica_name() -> str:
    """`<app>#<deployment>#<unique id>` inside a Serve replica (the actor is `SERVE_REPLICA::` + this name, in
    namespace "serve"); host:pid elsewhere."""
    try:
        from ray import serve

        replica_id = serve.get_replica_context().replica_id
        return f"{replica_id.deployment_id.app_name}#{replica_id.deployment_id.name}#{replica_id.unique_id}"
    except Exception:  # noqa: BLE001 - not inside a replica
        from .server import process_name

        return process_name()


def _flag(value: Any) -> bool:
    return value if isinstance(value, bool) else str(value).strip().lower() in {"1", "true", "yes", "on"}


def deployment_options(args: dict[str, Any]) -> dict[str, Any]:
    """Serve deployment options from builder args: `replicas` (an int, or "auto" for autoscaling between
    `min_replicas` and `max_replicas` at `target_ongoing_requests` model requests per replica, see `ray_scaling`),
    `num_gpus`, `num_cpus`, `max_ongoing_requests`."""
    resources = {"num_cpus": float(args.get("num_cpus", 1)), "num_gpus": float(args.get("num_gpus", 0))}
    options: dict[str, Any] = {
        "name": DEPLOYMENT_NAME,
        "ray_actor_options": resources,
        # a replica runs one model request at a time and queues `queue_size` more itself (429 beyond, as in one
        # process); Serve's own limit must also leave room for the page's long-lived connections (each open page
        # holds a heartbeat stream, and an event stream while it waits for an answer), which cost no model time
        "max_ongoing_requests": int(args.get("max_ongoing_requests", DEFAULT_MAX_ONGOING_REQUESTS)),
        "health_check_period_s": float(args.get("health_check_period_s", 10)),
        "graceful_shutdown_timeout_s": float(args.get("graceful_shutdown_timeout_s", 20)),
        # a browser's page, uploads and event stream must reach one replica; API requests spread
        "request_router_config": {"request_router_class": "app.ray_router:BrowserSessionRouter"},
    }
    replicas = args.get("replicas", 1)
    if str(replicas).strip().lower() == "auto":
        options["autoscaling_config"] = {
            "min_replicas": int(args.get("min_replicas", 1)),
            "max_replicas": int(args.get("max_replicas", 4)),
            "target_ongoing_requests": float(args.get("target_ongoing_requests", 1)),
            "upscale_delay_s": float(args.get("upscale_delay_s", 10)),
            "downscale_delay_s": float(args.get("downscale_delay_s", 300)),
            "look_back_period_s": float(args.get("look_back_period_s", 30)),
            # on model work, not open connections: an idle open page must not start a GPU replica
            "policy": {"policy_function": "app.ray_scaling:scale_on_model_requests"},
        }
    else:
        options["num_replicas"] = int(replicas)
    return options


def build_app(args: dict[str, Any] | None = None):
    """Serve application builder (`import_path: app.ray_serve:build_app` in a Serve config).

    args: `model` or `models` (a list, or names separated by commas: the served models, the first the default),
    `allow_any_model`, `device`, `dtype`, `queue_size`, `allow_remote_images`, `allowed_model_root`, and the
    deployment options of `deployment_options`. Per-deployment settings in the config file's `deployments:`
    section override these. API keys are best given to the replicas as POP_VLM_API_KEY in the config's
    runtime_env, not here."""
    from ray import serve

    args = dict(args or {})
    models = args.get("models")
    replica_args = {
        "model": args.get("model") or os.environ.get("POP_VLM_MODEL"),
        "models": models.split(",") if isinstance(models, str) else models,
        "allow_any_model": _flag(args.get("allow_any_model", False)),
        "api_keys": args.get("api_keys"),
        "ui_auth": args.get("ui_auth"),
        "device": args.get("device", "auto"),
        "dtype": args.get("dtype", "auto"),
        "queue_size": int(args.get("queue_size", 16)),
        "allow_remote_images": _flag(args.get("allow_remote_images", False)),
        "allowed_model_root": args.get("allowed_model_root"),
    }
    deployment = serve.deployment(serve.ingress()(PopVLMReplica), **deployment_options(args))
    return deployment.bind(**replica_args)


def project_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def init_local_ray(num_cpus: int | None = None, num_gpus: int | None = None, object_store_bytes: int | None = None,
                   address: str | None = None, **kwargs):
    """Start (or join, with `address`) Ray so that its workers can import this project even when it is run from a
    checkout rather than installed."""
    import ray

    root = project_root()
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([root, *paths])
    if ray.is_initialized():
        return
    if address:
        ray.init(address=address, runtime_env={"env_vars": {"PYTHONPATH": os.environ["PYTHONPATH"]}}, **kwargs)
        return
    ray.init(num_cpus=num_cpus, num_gpus=num_gpus, object_store_memory=object_store_bytes,
             include_dashboard=False, **kwargs)


def start(args: dict[str, Any], host: str = "127.0.0.1", port: int = 8000, blocking: bool = False):
    """Start Serve's HTTP proxy on host:port and deploy the application at route prefix "/"; returns its handle.
    Ray must already be initialised (see `init_local_ray`)."""
    from ray import serve

    serve.start(http_options={"host": host, "port": port})
    return serve.run(build_app(args), name=APP_NAME, route_prefix="/", blocking=blocking)


def running_replicas(app_name: str = APP_NAME, deployment: str = DEPLOYMENT_NAME,
                     states: tuple[str, ...] = ("RUNNING",)) -> int:
    """How many replicas of the deployment are in `states` now (from `serve.status()`); add "STARTING" to count
    the ones being brought up as well."""
    from ray import serve

    application = serve.status().applications.get(app_name)
    if application is None or deployment not in application.deployments:
        return 0
    counts = application.deployments[deployment].replica_states
    return int(sum(counts.get(state, 0) for state in states))


def wait_for_replicas(count: int, timeout_s: float = 120.0, app_name: str = APP_NAME) -> float:
    """Block until `count` replicas are RUNNING; returns the seconds waited."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if running_replicas(app_name) >= count:
            return time.monotonic() - started
        time.sleep(0.2)
    raise TimeoutError(f"fewer than {count} replicas of {app_name} running after {timeout_s:.0f} s")


def serve_from_cli(args) -> int:
    """`pop-vlm serve --ray`: start Ray on this machine (or join --ray-address), deploy, and block until Ctrl-C."""
    import sys

    try:
        import ray
        from ray import serve
    except ImportError:
        print("error: --ray needs Ray Serve: pip install 'pop-vlm[ray]' (or pip install -e '.[ray]')", file=sys.stderr)
        return 2
    from pop_vlm.loading import default_model_name

    from .auth import api_keys_from, exposure_warning
    from .models import served_models

    models = served_models(args.model)
    model = models[0] if models else default_model_name()
    if model is None:
        print("error: no model given and no default model is installed; use --model", file=sys.stderr)
        return 2
    import signal

    init_local_ray(address=args.ray_address)

    def stop(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)  # docker stop / kill: tear Serve down as Ctrl-C does
    keys = api_keys_from(args.api_key)
    warning = exposure_warning(args.host, keys)
    if warning:
        print(f"warning: {warning}", file=sys.stderr)
    settings = {"model": model, "models": models, "allow_any_model": args.allow_any_model, "api_keys": list(keys),
                "ui_auth": args.ui_auth, "device": args.device, "dtype": args.dtype, "queue_size": args.queue_size or 16,
                "allow_remote_images": args.allow_remote_images, "allowed_model_root": args.allowed_model_root,
                "replicas": args.replicas, "max_replicas": args.max_replicas, "num_gpus": args.num_gpus,
                "num_cpus": args.num_cpus}
    start(settings, host=args.host, port=args.port)
    print(f"pop-vlm serving {model} from {args.replicas} Ray Serve replica(s) on http://{args.host}:{args.port}  "
          "(API: /v1/chat/completions, /healthz; header x-pop-vlm-replica names the replica)", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0
