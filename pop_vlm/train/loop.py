"""The training loop of the demo VLMs: seeded, resumable from its last checkpoint, on CPU or CUDA.

Loss: cross-entropy on the answer token and the end-of-turn token after it, plus the probes of `heads` (vision
features, question words); AdamW with the learning rate of `schedule`, gradient clipping. Every few minutes it
scores the held-out set, keeps the best weights, exports them and writes a checkpoint; SIGTERM or Ctrl-C ends the
run after the current step with a checkpoint (`stopping`: a run stopped from outside loses nothing). With `--lora-rank`, the
frozen language model's low-rank adapters (`lora`) train too, in their own optimiser group, so that a checkpoint
from before they were added resumes with them. A gemma3 run resumed at a larger `--image-size` (same `--patch-size`)
carries its vision tower over, the position embedding resampled to the new patch grid (`gemma3.fit_checkpoint`).
Without a checkpoint, `--init-from` starts a run from the weights of an export instead, at the step it was exported.
"""
from __future__ import annotations

import copy
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from .. import assembly, zoo
from . import lora
from .data import EvalSet, make_batch, word_supervision
from .export import export, load_trained, trained_state
from .families import family as family_builder
from .heads import AuxHeads, WordHeads
from .schedule import lr_at, rewarm_factor
from .stopping import StopRequest


def default_out_dir(model_name: str) -> Path:
    return zoo.cache_dir() / "train" / model_name


def log(msg: str, path: Path | None = None):
    line = f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] {msg}"
    print(line, flush=True)
    if path is not None:
        with open(path, "a", encoding="utf-8") as handle:
            handle.write(line + "\n")


def save_checkpoint(path: Path, state: dict):
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def new_state() -> dict:
    return dict(step=0, images=0, train_seconds=0.0, curve=[], best=None, best_acc=-1.0, best_info=None, exported_step=-1,
                runs=[])


#: options that decide what the model is shown: a run resumed with other values chooses its best model afresh
INPUT_OPTIONS = ("image_size", "patch_size", "image_tokens", "max_pixels", "min_pixels")


def input_settings(args) -> dict:
    return {name: getattr(args, name) for name in INPUT_OPTIONS}


class Trainer:
    """One training run: the model, its probes and optimisers, the held-out sets and the run's state."""

    def __init__(self, args, command: str | None = None):
        self.args = args
        self.family = family_builder(args.family)
        self.command = command or "python scripts/train_demo_vlm.py " + " ".join(sys.argv[1:])
        if args.export_dir is None:
            args.export_dir = str(zoo.bundled_path(self.family.MODEL_NAME))
        torch.set_num_threads(args.threads)
        self.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.out_dir = Path(args.out_dir) if args.out_dir else default_out_dir(self.family.MODEL_NAME)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = None if args.profile else self.out_dir / "train.log"
        self.ckpt_path = self.out_dir / "last.pt"
        # The order of the random initialisations below fixes the weights a seed gives: keep it.
        torch.manual_seed(args.seed)
        self.processor = self.family.build_processor(args)
        self.enc = self.family.Encoder(self.processor)
        self.config = self.family.build_config(args, self.processor.tokenizer)
        self.adapters = lora.settings(args)
        self.model = self._new_model().to(self.device)
        width = self.family.text_width(self.config)
        self.aux = AuxHeads(width).to(self.device)
        # the model's own parameters, as shipped: adapters are merged into the weights they adapt
        self.n_params = sum(p.numel() for n, p in self.model.named_parameters() if not lora.is_adapter(n))
        self.opt = self._model_optimiser()
        self.word_heads = WordHeads(width).to(self.device)
        self.word_opt = torch.optim.AdamW(self.word_heads.parameters(), lr=args.lr, betas=(0.9, 0.98),
                                          weight_decay=args.weight_decay)
        self.probe_hidden = {}
        self.family.text_layers(self.model)[args.word_layer].register_forward_hook(
            lambda module, inputs, output: self.probe_hidden.__setitem__("h", output[0] if isinstance(output, tuple) else output)
        )
        self.family.prepare_for_training(self.model, self.processor, self.enc)
        self.state = new_state()
        self.val = self.test = None

    def _new_model(self):
        return lora.attach(self.family.new_model(self.config), self.family, self.adapters)

    def _model_optimiser(self):
        """AdamW over the model and the vision probes; no weight decay on embeddings, norms and biases. Adapters, if
        any, come last in a group of their own: the groups before are those of a run without them."""
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]  # a frozen LM stays out
        adapters = [p for n, p in named if lora.is_adapter(n)]
        named = [(n, p) for n, p in named if not lora.is_adapter(n)]
        decay = [p for n, p in named if p.ndim >= 2 and "embed" not in n]
        no_decay = [p for n, p in named if not (p.ndim >= 2 and "embed" not in n)]
        groups = [
            {"params": decay + list(self.aux.parameters()), "weight_decay": self.args.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        if adapters:
            groups.append({"params": adapters, "weight_decay": self.args.weight_decay})
        return torch.optim.AdamW(groups, lr=self.args.lr, betas=(0.9, 0.98))

    # ---- checkpoints ------------------------------------------------------------------------------------------
    def resume_or_start(self):
        if self.ckpt_path.exists() and not self.args.fresh and not self.args.profile:
            ckpt = torch.load(self.ckpt_path, map_location="cpu", weights_only=False)
            adding = self._check_adapters(ckpt.get("lora"))
            resampled = self._fit_checkpoint(ckpt)
            load_trained(self.model, ckpt["model"])
            self.aux.load_state_dict(ckpt["aux"])
            if "word_heads" in ckpt:
                self.word_heads.load_state_dict(ckpt["word_heads"])
                self.word_opt.load_state_dict(ckpt["word_opt"])
            opt = ckpt["opt"]
            if adding:  # the adapters' group joins the saved ones, its optimiser state fresh
                opt = dict(opt, param_groups=[*opt["param_groups"], self.opt.state_dict()["param_groups"][-1]])
            self.opt.load_state_dict(opt)
            self.state = ckpt["state"]
            log(f"resumed from {self.ckpt_path} at step {self.state['step']} ({self.state['images']} images)"
                + (f"; low-rank adapters {self.adapters.description()} added, starting at zero" if adding else ""),
                self.log_path)
            if resampled:
                log(resampled, self.log_path)
        elif self.args.init_from and not self.args.profile:
            self.start_from_export(Path(self.args.init_from))
        else:
            adapters = f" (+ {lora.count(self.model):,} in low-rank adapters)" if self.adapters else ""
            log(f"new run: {self.n_params:,} parameters{adapters}; {self.command}", self.log_path)
        self._record_run()

    def start_from_export(self, folder: Path):
        """Start from the weights of an export of this family's model (its trained weights and adapters, as shipped
        or whole), at the step, images and curve its `training_curve.json` records: for a run whose checkpoint is
        lost. The optimisers and the probes start afresh, so the learning rate climbs back over `REWARM_STEPS`."""
        record_file = folder / "training_curve.json"
        if not record_file.is_file():
            raise ValueError(f"--init-from {folder}: no training_curve.json there, so the step to go on from is unknown")
        record = json.loads(record_file.read_text(encoding="utf-8"))
        info = record["info"]
        saved = assembly.read_base(folder).get("adapters") if (folder / assembly.BASE_MODEL_FILE).is_file() else None
        current = self.adapters and self.adapters.description()
        if saved != current:
            raise ValueError(f"--init-from {folder}: its adapters are {saved or 'none'}, this run asks for "
                             f"{current or 'none'}: give the --lora-* options it was trained with")
        ckpt = {"model": assembly.read_weights(folder)}
        resampled = self._fit_checkpoint(ckpt)
        load_trained(self.model, ckpt["model"])
        self.state = dict(new_state(), step=info["step"], images=info["images"],
                          train_seconds=info["train_minutes"] * 60, runs=list(info.get("runs", [])),
                          curve=[point for point in record["curve"] if point["step"] <= info["step"]],
                          rewarm_from=info["step"])
        log(f"started from the weights of {folder} (step {info['step']}, {info['images']} images; fresh optimiser "
            f"and probes)", self.log_path)
        if resampled:
            log(resampled, self.log_path)

    def _fit_checkpoint(self, ckpt: dict) -> str | None:
        """Let the family fit a checkpoint saved at other input sizes to this run's model (gemma3: its tower's
        position embedding resampled to a larger patch grid); what it did, for the log. Qwen3-VL needs nothing: its
        tower interpolates its position embeddings to every image itself."""
        fit = getattr(self.family, "fit_checkpoint", None)
        return fit(self.model, self.opt, ckpt) if fit else None

    def _record_run(self):
        """Add this run (its first step, command and inputs) to the state's list of runs. Shown other inputs than
        the run before (more image tokens, say), the best model so far was chosen on inputs this model no longer
        gets: the held-out selection starts again, so an export never pairs old weights with new inputs."""
        state, inputs = self.state, input_settings(self.args)
        runs = state.setdefault("runs", [])  # checkpoints from before runs were recorded have none
        before = runs[-1]["inputs"] if runs else inputs
        if before != inputs:
            changed = ", ".join(f"{k} {before.get(k)} -> {v}" for k, v in inputs.items() if before.get(k) != v)
            log(f"inputs changed ({changed}): the best model is chosen afresh from step {state['step']}", self.log_path)
            state.update(best=None, best_acc=-1.0, best_info=None)
        runs.append(dict(step=state["step"], command=self.command, inputs=inputs))

    def _check_adapters(self, saved: dict | None) -> bool:
        """Whether this run adds adapters to a checkpoint without them; adapters trained already must be resumed as
        they were (dropping or reshaping them would lose what they learnt)."""
        current = self.adapters and self.adapters.description()
        if saved is None:
            return current is not None
        if saved != current:
            wanted = (f"--lora-rank {saved['rank']} --lora-alpha {saved['alpha']:g} --lora-targets "
                      + ",".join(short for short, module in lora.TARGETS.items() if module in saved["targets"]))
            raise ValueError(f"{self.ckpt_path} was trained with low-rank adapters {saved}, this run asks for "
                             f"{current or 'none'}: resume with {wanted}, or start over with --fresh")
        return False

    def save(self):
        save_checkpoint(self.ckpt_path, dict(
            model=trained_state(self.model), aux=self.aux.state_dict(), opt=self.opt.state_dict(), state=self.state,
            word_heads=self.word_heads.state_dict(), word_opt=self.word_opt.state_dict(),
            lora=self.adapters and self.adapters.description(),
        ))

    # ---- one step ---------------------------------------------------------------------------------------------
    def train_step(self) -> dict:
        """One optimiser step on the batch of the current step; returns its figures."""
        args, enc, device, state = self.args, self.enc, self.device, self.state
        t0 = time.time()
        pixel_values, grid, seqs, aux_t, scenes = make_batch(state["step"], state["images"], enc, args)
        t_data = time.time() - t0
        input_ids, mask, position_ids, targets = enc.pack(self.model, grid, seqs, with_answer=True)
        lr = lr_at(state["step"], args) * rewarm_factor(state)
        for group in self.opt.param_groups:
            group["lr"] = lr
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.autocast == "bf16"):
            hidden, vis_feats = enc.forward_hidden(
                self.model, pixel_values.to(device), grid.to(device), input_ids.to(device), mask.to(device),
                position_ids.to(device)
            )
            logits = enc.answer_logits(self.model, hidden, targets, with_eos=True).float()
            aux_loss = self._aux_loss(torch.cat(vis_feats), aux_t)
            word_loss = self._word_loss(seqs, targets, scenes)
        labels = torch.tensor([a for t in targets for a in t[2]], device=device)
        answer_loss = F.cross_entropy(logits, labels)
        loss = answer_loss + args.aux_weight * aux_loss + args.word_weight * word_loss
        self.opt.zero_grad(set_to_none=True)
        self.word_opt.zero_grad(set_to_none=True)
        loss.backward()
        params = list(self.model.parameters()) + list(self.aux.parameters()) + list(self.word_heads.parameters())
        torch.nn.utils.clip_grad_norm_(params, args.clip)
        for group in self.word_opt.param_groups:
            group["lr"] = lr
        self.word_opt.step()
        self.opt.step()
        step_time = time.time() - t0
        state["step"] += 1
        state["images"] += args.images_per_step
        state["train_seconds"] += step_time
        return dict(
            lr=lr, loss=answer_loss.item(), aux_loss=aux_loss.item(), word_loss=word_loss.item(),
            acc=(logits[0::2].argmax(-1) == labels[0::2]).float().mean().item(), step_time=step_time,
            data_time=t_data, tokens=int((input_ids != enc.pad_id).sum()), shape=tuple(input_ids.shape),
            vision_tokens=[enc.n_tokens(g) for g in grid],
        )

    def _aux_loss(self, feats, aux_t):
        c_logit, s_logit, h_logit = self.aux(feats)
        c_t, s_t, h_t = (torch.cat([a[k] for a in aux_t]).to(self.device) for k in range(3))
        return (
            F.cross_entropy(c_logit.float(), c_t) + F.cross_entropy(s_logit.float(), s_t)
            + 0.5 * F.cross_entropy(h_logit.float(), h_t)
        )

    def _word_loss(self, seqs, targets, scenes):
        w_rows, w_cols, w_t = word_supervision(self.enc, seqs, targets, scenes)
        probe_input = getattr(self.family, "word_probe_input", lambda hidden: hidden)
        w_logits = self.word_heads(probe_input(self.probe_hidden["h"][w_rows, w_cols]))
        w_t = w_t.to(self.device)
        return sum(F.cross_entropy(lg.float(), w_t[:, k]) for k, lg in enumerate(w_logits))

    # ---- evaluation and export --------------------------------------------------------------------------------
    def snapshot_info(self) -> dict:
        return dict(command=self.command, step=self.state["step"], images=self.state["images"],
                    train_minutes=self.state["train_seconds"] / 60, device=str(self.device), threads=self.args.threads,
                    params=self.n_params, runs=list(self.state.get("runs", [])))

    def evaluate(self) -> dict:
        """Score the held-out set, add it to the curve and keep the weights when they are the best so far."""
        state = self.state
        report = self.val.score(self.model)
        state["curve"].append(dict(step=state["step"], images=state["images"], minutes=state["train_seconds"] / 60,
                                   val_accuracy=report["accuracy"], val_by_qtype=report["by_qtype"]))
        if report["accuracy"] > state["best_acc"]:
            state["best_acc"] = report["accuracy"]
            state["best"] = copy.deepcopy({k: v.cpu() for k, v in trained_state(self.model).items()})
            state["best_info"] = dict(self.snapshot_info(), val_accuracy=report["accuracy"], val_by_qtype=report["by_qtype"])
        return report

    def export_best(self):
        """Export the best weights so far (scored on the test set first), unless they are exported already."""
        state = self.state
        if state["best"] is None or state["exported_step"] == state["best_info"]["step"]:
            return
        best_model = self._new_model()
        load_trained(best_model, state["best"])
        report = self.test.score(best_model) if self.test else None
        info = dict(state["best_info"], total_minutes=state["train_seconds"] / 60, total_images=state["images"])
        if report:
            info["test_accuracy"] = report["accuracy"]
            info["test_by_qtype"] = report["by_qtype"]
        size = export(self.family, best_model, self.config, self.processor, self.args, info, state["curve"], report)
        state["exported_step"] = state["best_info"]["step"]
        test_msg = f" test={report['accuracy']:.3f} {_rounded(report['by_qtype'])}" if report else ""
        log(f"exported step {state['exported_step']} ({size:.1f} MB) to {self.args.export_dir};{test_msg}", self.log_path)

    # ---- the run ----------------------------------------------------------------------------------------------
    def _finished(self, start: float) -> bool:
        args, step = self.args, self.state["step"]
        if args.profile:
            return step >= args.profile
        if args.steps is not None and step >= args.steps:
            return True
        return time.time() - start > args.minutes * 60

    def run(self) -> dict:
        args = self.args
        self.resume_or_start()
        self.val = EvalSet.validation(args.val_size, self.enc)
        self.test = EvalSet.test(args.test_size, self.enc) if not args.profile else None
        self.model.train()
        start = time.time()
        window = defaultdict(list)
        with StopRequest() as stop:
            self._loop(start, window, stop)
        if stop.signal_name and not args.profile:
            self.save()
            log(f"stopped by {stop.signal_name} at step {self.state['step']}: checkpoint saved, the next run resumes "
                f"from it (best val {self.state['best_acc']:.3f}, last export at step "
                f"{self.state.get('exported_step')})", self.log_path)
            return self.state
        if args.profile:
            times = window["step_time"][1:] or window["step_time"]
            log(f"mean step {np.mean(times):.3f}s, data {np.mean(window['data_time']):.3f}s, params {self.n_params:,}")
            return self.state
        self.evaluate()
        self.save()
        self.export_best()
        log(f"done: step {self.state['step']}, best val {self.state['best_acc']:.3f}", self.log_path)
        return self.state

    def _loop(self, start: float, window: dict, stop: StopRequest):
        args = self.args
        last_eval = last_export = last_ckpt = time.time()
        while not self._finished(start) and not stop.signal_name:
            m = self.train_step()
            for key in ("loss", "aux_loss", "word_loss", "acc", "step_time", "data_time", "tokens"):
                window[key].append(m[key])
            if args.profile:
                log(f"step {self.state['step']}: {m['step_time']:.3f}s (data {m['data_time']:.3f}s) "
                    f"seq {torch.Size(m['shape'])} vision tokens {m['vision_tokens']} loss {m['loss']:.3f} "
                    f"aux {m['aux_loss']:.3f}")
                continue
            if self.state["step"] % 25 == 0:
                self._log_window(window, m["lr"])
            if time.time() - last_eval > args.eval_every * 60:
                self._evaluate_and_log()
                last_eval = time.time()
            if time.time() - last_export > args.export_every * 60:
                self.export_best()
                last_export = time.time()
            if time.time() - last_ckpt > args.checkpoint_every * 60:
                self.save()
                last_ckpt = time.time()

    def _log_window(self, window, lr: float):
        state = self.state
        m = {k: float(np.mean(v)) for k, v in window.items()}
        state["curve"].append(dict(step=state["step"], images=state["images"], minutes=state["train_seconds"] / 60, lr=lr,
                                   loss=m["loss"], aux_loss=m["aux_loss"], word_loss=m["word_loss"], train_acc=m["acc"]))
        log(f"step {state['step']} img {state['images']} lr {lr:.2e} loss {m['loss']:.3f} aux {m['aux_loss']:.3f} "
            f"word {m['word_loss']:.3f} train_acc {m['acc']:.3f} step {m['step_time']:.2f}s "
            f"(data {m['data_time']:.2f}s, {m['tokens']:.0f} tok)", self.log_path)
        window.clear()

    def _evaluate_and_log(self):
        t_eval = time.time()
        report = self.evaluate()
        log(f"eval step {self.state['step']}: val {report['accuracy']:.3f} {_rounded(report['by_qtype'])} "
            f"(best {self.state['best_acc']:.3f}, {time.time() - t_eval:.0f}s)", self.log_path)


def _rounded(by_qtype: dict) -> str:
    return json.dumps({k: round(v, 3) for k, v in by_qtype.items()})
