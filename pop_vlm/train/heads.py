"""Training-only probes: small linear heads whose losses teach the demo VLM to look at the image.

They read the vision features and a text layer's hidden states during training and are never exported.
"""
from __future__ import annotations

import torch

from .. import shapes as S


class AuxHeads(torch.nn.Module):
    """Per-merged-token probes on the vision features: colour (or background), shape (or background),
    and which half of the canvas the token is in. Used only as a training signal."""

    def __init__(self, dim: int):
        super().__init__()
        self.color = torch.nn.Linear(dim, len(S.COLORS) + 1)
        self.shape = torch.nn.Linear(dim, len(S.SHAPES) + 1)
        self.lr_half = torch.nn.Linear(dim, 2)

    def forward(self, feats):
        return self.color(feats), self.shape(feats), self.lr_half(feats)


class WordHeads(torch.nn.Module):
    """Probes on the language model's hidden states at the colour and shape words of a question.

    At such a word the phrase so far ("red", or "red circle", or "circle") denotes a set of objects; the
    heads predict how many objects that is (0-4), where they are (none / all left / all right / other),
    and the colour and shape of the object when there is exactly one. This teaches the question words to
    look up their referents in the image one hop at a time. Used only as a training signal."""

    def __init__(self, dim: int):
        super().__init__()
        self.count = torch.nn.Linear(dim, 5)
        self.side = torch.nn.Linear(dim, 4)
        self.color = torch.nn.Linear(dim, len(S.COLORS) + 1)
        self.shape = torch.nn.Linear(dim, len(S.SHAPES) + 1)

    def forward(self, h):
        return self.count(h), self.side(h), self.color(h), self.shape(h)
