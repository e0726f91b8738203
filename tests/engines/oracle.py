"""The oracle of the real-engine tests: transformers, float32, teacher-forced on the weights served."""

from __future__ import annotations

import functools
from pathlib import Path


@functools.lru_cache(maxsize=8)
def model(folder: Path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def teacher_forced(folder: Path, prompt: list[int], output: list[int],
                   temperature: float = 0.0) -> tuple[list[float], list[float]]:
    """(log-softmax of each output token, the largest log-softmax at its position) from one forward, of the
    distribution sampled from: logits / T (T = 0, greedy: the logits themselves), as the engines report."""
    import torch

    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(folder)(ids).logits[0, len(prompt) - 1 : -1].float()
    logp = torch.log_softmax(logits / temperature if temperature > 0 else logits, dim=-1)
    chosen = logp.gather(1, torch.tensor(output)[:, None])[:, 0]
    return chosen.tolist(), logp.max(dim=-1).values.tolist()
