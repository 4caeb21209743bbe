"""Training data for the demo VLMs: shapes scenes and questions, batches, the curriculum and the held-out sets.

Every batch is a pure function of (seed, step, images seen), so a resumed run sees the batches an uninterrupted
one would. Batches are built through a family's encoder (`images`, `word_ids`, `pack`, ...), never its processor.
"""
from __future__ import annotations

import json
from collections import defaultdict

import numpy as np
import torch

from .. import shapes as S
from .. import zoo

TRAIN_SEED_LIMIT = 900_000_000  # training scenes use seeds below this
VAL_SEED_START = 900_000_000  # held-out validation scenes (model selection); test scenes use seeds >= 1e9


def shapes_test_path():
    return zoo.assets_dir() / "qa" / "shapes_test.jsonl"


def curriculum(images_seen: int, args) -> tuple[dict, dict]:
    """Scene sampler kwargs and question-type weights for the current point of training: first few, mostly large
    objects and mostly colour/count questions, then the full task."""
    if images_seen < args.stage1_images:
        return (
            dict(min_objects=1, max_objects=2, large_prob=0.8),
            dict(color_of_shape=2.0, count=2.0, shape_of_color=1.0, exists=1.0, left_right=1.0),
        )
    if images_seen < args.stage2_images:
        return (
            dict(min_objects=1, max_objects=3, large_prob=0.6),
            dict(color_of_shape=1.0, count=1.0, shape_of_color=1.0, exists=1.0, left_right=1.0),
        )
    return (
        dict(min_objects=1, max_objects=4, large_prob=0.5),
        dict(color_of_shape=1.0, count=1.0, shape_of_color=1.2, exists=1.2, left_right=1.2),
    )


def aux_targets(scene, grid_thw, merge: int):
    """Per merged vision token: colour id and shape id of the object under it (0: background), canvas half."""
    rows, cols = int(grid_thw[1]) // merge, int(grid_thw[2]) // merge
    labels = S.label_grid(scene, rows, cols)
    color_ids = {c: i + 1 for i, c in enumerate(S.COLORS)}
    shape_ids = {s: i + 1 for i, s in enumerate(S.SHAPES)}
    color_lut = np.array([0] + [color_ids[o.color] for o in scene.objects])
    shape_lut = np.array([0] + [shape_ids[o.shape] for o in scene.objects])
    half = np.broadcast_to((np.arange(cols) + 0.5 >= cols / 2).astype(np.int64), (rows, cols))
    return (
        torch.from_numpy(color_lut[labels].reshape(-1)),
        torch.from_numpy(shape_lut[labels].reshape(-1)),
        torch.from_numpy(half.reshape(-1).copy()),
    )


def make_batch(step: int, images_seen: int, enc, args):
    """Training batch for ``step``: a pure function of (seed, step, images_seen).

    Several questions per image: the vision tower runs once per image and its features are shared by all of
    that image's question sequences. Returns pixel values, grids, [(image, question, answer, qtype)], the
    auxiliary targets of every image and the scenes."""
    rng = np.random.default_rng([args.seed, step])
    scene_kwargs, weights = curriculum(images_seen, args)
    scenes, qas = [], []
    for _ in range(args.images_per_step):
        seed = int(rng.integers(0, TRAIN_SEED_LIMIT))
        scene_rng = np.random.default_rng(seed)
        scene = S.sample_scene(scene_rng, **scene_kwargs)
        scenes.append(scene)
        qas.append(S.questions(scene, scene_rng, n=args.questions_per_image, qtype_weights=weights))
    pixel_values, grid = enc.images([S.render(s) for s in scenes])
    aux = [aux_targets(s, g, enc.merge) for s, g in zip(scenes, grid)]
    seqs = [(i, q, a, t) for i, qa in enumerate(qas) for (q, a, t) in qa]
    return pixel_values, grid, seqs, aux, scenes


def word_targets(scene, tokens: list[str]) -> list[tuple[int, tuple[int, int, int, int]]]:
    """(token index, (count, side, colour, shape)) for every colour or shape word of a question."""
    out, colour = [], None
    colors, shapes = list(S.COLORS), list(S.SHAPES)
    for i, tok in enumerate(tokens):
        if tok in colors:
            colour, refs = tok, [o for o in scene.objects if o.color == tok]
        elif tok in shapes:
            refs = [o for o in scene.objects if o.shape == tok and (colour is None or o.color == colour)]
        else:
            colour = None
            continue
        halves = {S._horizontal_half(o, scene.width) for o in refs}
        side = 0 if not refs else {frozenset(["left"]): 1, frozenset(["right"]): 2}.get(frozenset(halves), 3)
        one = refs[0] if len(refs) == 1 else None
        out.append((i, (len(refs), side, colors.index(one.color) + 1 if one else 0, shapes.index(one.shape) + 1 if one else 0)))
    return out


def word_supervision(enc, seqs, targets, scenes):
    """Batch positions (rows, cols) of the question's colour/shape words and their targets (n, 4)."""
    rows, cols, tgt = [], [], []
    for (img, question, _, _), (row, answer_at, _) in zip(seqs, targets):
        q_ids = enc.word_ids(question)
        start = answer_at - len(enc.tail) + 1 - len(q_ids)
        words = [enc.tok.decode([i]).strip() for i in q_ids]  # one word per token, whatever marks a leading space
        for off, t in word_targets(scenes[img], words):
            rows.append(row)
            cols.append(start + off)
            tgt.append(t)
    return (torch.tensor(rows, dtype=torch.long), torch.tensor(cols, dtype=torch.long),
            torch.tensor(tgt, dtype=torch.long).view(-1, 4))


def load_jsonl(path):
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


class EvalSet:
    """A fixed list of records with their preprocessed images, scored by greedy next-token prediction."""

    def __init__(self, records, enc):
        self.records = records
        self.enc = enc
        self.items = []
        for rec in records:
            image, question, answer = S.sample_from_record(rec)
            pixel_values, grid = enc.images([image])
            self.items.append((pixel_values, grid, question, answer))

    @classmethod
    def validation(cls, size: int, enc) -> EvalSet:
        """The held-out validation scenes (model selection): seeds from VAL_SEED_START, every question type."""
        return cls(S.make_records(range(VAL_SEED_START, VAL_SEED_START + size), S.QTYPES), enc)

    @classmethod
    def test(cls, size: int, enc) -> EvalSet | None:
        """The first `size` records (0: all) of `assets/qa/shapes_test.jsonl`; None when there are none."""
        path = shapes_test_path()
        records = load_jsonl(path) if path.exists() else []
        if size:
            records = records[:size]
        return cls(records, enc) if records else None

    @torch.no_grad()
    def predict(self, model, batch: int = 32) -> list[str]:
        model.eval()
        preds = []
        for start in range(0, len(self.items), batch):
            chunk = self.items[start : start + batch]
            pixel_values = torch.cat([c[0] for c in chunk])
            grid = torch.cat([c[1] for c in chunk])
            seqs = [(i, c[2], c[3], "") for i, c in enumerate(chunk)]
            device = next(model.parameters()).device
            input_ids, mask, position_ids, targets = self.enc.pack(model, grid, seqs, with_answer=False)
            hidden, _ = self.enc.forward_hidden(
                model, pixel_values.to(device), grid.to(device), input_ids.to(device), mask.to(device), position_ids.to(device)
            )
            logits = self.enc.answer_logits(model, hidden, targets, with_eos=False)
            preds += [self.enc.tok.decode([int(t)]) for t in logits.argmax(-1)]
        model.train()
        return preds

    def report(self, preds) -> dict:
        by_type, by_canvas, by_w, by_h = (defaultdict(list) for _ in range(4))
        for rec, pred in zip(self.records, preds):
            ok = S.score(pred, rec["answer"])
            by_type[rec["qtype"]].append(ok)
            by_canvas[f"{rec['width']}x{rec['height']}"].append(ok)
            by_w[rec["width"]].append(ok)
            by_h[rec["height"]].append(ok)
        mean = lambda v: float(np.mean(v)) if v else float("nan")  # noqa: E731
        allv = [x for v in by_type.values() for x in v]
        return {
            "accuracy": mean(allv),
            "n": len(allv),
            "by_qtype": {q: mean(by_type[q]) for q in S.QTYPES if by_type[q]},
            "n_by_qtype": {q: len(by_type[q]) for q in S.QTYPES if by_type[q]},
            "by_canvas": {k: mean(v) for k, v in sorted(by_canvas.items())},
            "by_width": {k: mean(v) for k, v in sorted(by_w.items())},
            "by_height": {k: mean(v) for k, v in sorted(by_h.items())},
        }

    def score(self, model) -> dict:
        return self.report(self.predict(model))
