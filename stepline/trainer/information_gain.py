"""IGPO's belief in the gold answer: a teacher-forced forward of the gold answer after each step's state.

    ids = reference_ids(model_dir, template)(episode)      # gold answer tokens, from metadata["reference"]
    p = gold_probabilities(model, contexts, golds)         # float32 [R]: π_θ(a* | s) per row

The gold answer comes from the data: a session's `metadata["reference"]` (any text; the harness or the
runner that opens the session supplies it, the same way it supplies the task). The trainer renders it
with `reference_template` and tokenizes it with the policy's tokenizer; the advantage `igpo` then turns the
probabilities into turn rewards (stepline/trainer/algorithms/advantages.py). Each distinct (state, answer) pair is
computed once: all sessions of a group share their first prompt, forks share their prefixes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
from torch import nn

from stepline.datapool.records import REFERENCE_KEY, EpisodeData

__all__ = ["REFERENCE_KEY", "gold_probabilities", "reference_ids"]



def reference_ids(model_dir: Path, template: str = "{reference}") -> Callable[[EpisodeData], np.ndarray | None]:
    """episode -> int32 token ids of its rendered gold answer, or None when its metadata has none."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def ids(episode: EpisodeData) -> np.ndarray | None:
        reference = episode.info.metadata.get(REFERENCE_KEY)
        if reference is None:
            return None
        text = template.format(reference=reference)
        return np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=np.int32)

    return ids


@torch.no_grad()
def gold_probabilities(model: nn.Module, contexts: Sequence[np.ndarray], golds: Sequence[np.ndarray], *,
                       batch_size: int = 4) -> torch.Tensor:
    """π_θ(a* | s) = exp( (1/L) Σ_j log π_θ(a*_j | s, a*_<j) ) for each row (s = contexts[i], a* = golds[i]),
    the length-normalised probability IGPO uses; float32 [R]. Rows are padded on the right in batches of
    `batch_size` distinct pairs (an empty answer is refused: it has no probability)."""
    keys = [(c.tobytes(), g.tobytes()) for c, g in zip(contexts, golds)]
    unique = list(dict.fromkeys(keys))
    first = {k: i for i, k in reversed(list(enumerate(keys)))}
    values: dict[tuple[bytes, bytes], float] = {}
    for start in range(0, len(unique), batch_size):
        chunk = unique[start : start + batch_size]
        rows = [(contexts[first[k]], golds[first[k]]) for k in chunk]
        values.update(zip(chunk, _mean_logprobs(model, rows)))
    return torch.tensor([values[k] for k in keys], dtype=torch.float32).exp()


def _mean_logprobs(model: nn.Module, rows: list[tuple[np.ndarray, np.ndarray]]) -> list[float]:
    """Left-padded so every answer ends at the last position: only the last L_max + 1 positions go through the LM
    head (`logits_to_keep`), [B, L_max + 1, V] instead of [B, T, V] (a long agent context is thousands of tokens)."""
    if any(len(gold) == 0 or len(context) == 0 for context, gold in rows):
        raise ValueError("a gold answer that tokenizes to nothing, or an empty state, has no probability")
    device = next(model.parameters()).device
    width = max(len(c) + len(g) for c, g in rows)
    keep = max(len(g) for _, g in rows) + 1
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    attention = torch.zeros(len(rows), width, dtype=torch.long)
    for i, (context, gold) in enumerate(rows):
        seq = torch.as_tensor(np.concatenate([context, gold]).astype(np.int64))
        ids[i, width - len(seq):], attention[i, width - len(seq):] = seq, 1
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids.to(device), attention_mask=attention.to(device), position_ids=positions.to(device),
                   logits_to_keep=keep).logits.float()
    out = []
    for i, (_, gold) in enumerate(rows):
        # kept logit k predicts the token after padded position width − keep + k; the answer's L tokens are the
        # last L positions, so they are predicted by kept logits keep − L − 1 .. keep − 2
        logp = torch.log_softmax(logits[i, keep - len(gold) - 1 : keep - 1], dim=-1)
        out.append(float(logp.gather(-1, torch.as_tensor(gold, dtype=torch.long, device=device)[:, None]).mean()))
    return out
