"""What every family's builder shares about packed training inputs: the logits at the answer positions, the
processor's own inputs for one question (as `Pipeline` builds them), and the check that packing changes nothing."""
from __future__ import annotations

import torch

from .. import shapes as S


def answer_logits(model, hidden, targets, with_eos: bool):
    """Logits at the answer position of every question (and at the end-of-turn token after it)."""
    offsets = (0, 1) if with_eos else (0,)
    rows = torch.tensor([t[0] for t in targets for _ in offsets])
    cols = torch.tensor([t[1] + k for t in targets for k in offsets])
    return model.lm_head(hidden[rows, cols]).float()


def chat_inputs(processor, image, question):
    """The processor's inputs for one question, as `Pipeline` builds them (the template renders its own special
    tokens)."""
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    return processor(text=[text], images=[image], return_tensors="pt", add_special_tokens=False)


@torch.no_grad()
def check_packing(model, processor, enc):
    """Packed logits must equal the model's own forward on processor outputs, one question at a time."""
    was_training = model.training
    model.eval()
    scenes = [S.sample_scene(s) for s in (11, 12)]
    images = [S.render(sc) for sc in scenes]
    seqs = [(i, q, a, t) for i, sc in enumerate(scenes) for q, a, t in S.questions(sc, 5)[:3]]
    pixel_values, grid = enc.images(images)
    device = next(model.parameters()).device
    input_ids, mask, position_ids, targets = enc.pack(model, grid, seqs, with_answer=True)
    hidden, _ = enc.forward_hidden(model, pixel_values.to(device), grid.to(device), input_ids.to(device), mask.to(device),
                                   position_ids.to(device))
    packed = answer_logits(model, hidden, targets, with_eos=False)
    for k, (img, question, _, _) in enumerate(seqs):
        inputs = chat_inputs(processor, images[img], question).to(device)
        ref = model(**inputs, logits_to_keep=1).logits[0, -1].float()
        torch.testing.assert_close(packed[k], ref, rtol=1e-3, atol=1e-3)
    model.train(was_training)
