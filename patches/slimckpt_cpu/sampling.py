"""Token sampling for the `hf` rollout: KV-cached decoding of one prompt with a private generator.

Every sample draws from its own `torch.Generator`, seeded from (rollout seed, global step, sample
index, rollout number, validate). The tokens a sample gets therefore depend on nothing else: not on
the order in which concurrent requests reach the server, nor on how many ran before. That is what
lets a run resumed from a checkpoint repeat the rollouts of an uninterrupted one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SampleKey:
    """Identifies one trajectory of a training or validation step."""

    step: int
    sample_index: int
    rollout_n: int
    validate: bool

    def as_dict(self) -> dict:
        return {
            "step": self.step,
            "sample_index": self.sample_index,
            "rollout_n": self.rollout_n,
            "validate": self.validate,
        }

    @classmethod
    def from_dict(cls, d: dict) -> SampleKey:
        return cls(int(d["step"]), int(d["sample_index"]), int(d["rollout_n"]), bool(d["validate"]))


def sample_seed(seed: int, key: SampleKey) -> int:
    """A 63-bit seed; a hash keeps neighbouring keys' streams unrelated."""
    text = f"{seed}/{key.step}/{key.sample_index}/{key.rollout_n}/{int(key.validate)}"
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") & ((1 << 63) - 1)


def _filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if top_k is not None and 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        drop = cum - torch.softmax(sorted_logits, dim=-1) >= top_p  # keep the token that crosses top_p
        logits = logits.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    return logits


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    prompt_ids: list[int],
    *,
    max_new_tokens: int,
    eos_token_ids: Iterable[int],
    temperature: float = 1.0,
    top_k: int = -1,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> tuple[list[int], list[float]]:
    """Sample up to max_new_tokens after prompt_ids; stop after an EOS token (which is kept).

    Returns the tokens and their log-probabilities under the distribution the actor scores them
    with: log_softmax(logits / temperature) (raw logits when temperature is 0, i.e. greedy).
    """
    eos = set(int(t) for t in eos_token_ids)
    greedy = temperature is None or temperature <= 0
    input_ids = torch.tensor([prompt_ids], dtype=torch.long)
    past = None
    tokens: list[int] = []
    logprobs: list[float] = []
    for _ in range(max_new_tokens):
        out = model(input_ids=input_ids, past_key_values=past, use_cache=True)
        past = out.past_key_values
        logits = out.logits[0, -1].float()
        scaled = logits if greedy else logits / temperature
        logp = torch.log_softmax(scaled, dim=-1)
        if greedy:
            token = int(torch.argmax(logits))
        else:
            probs = torch.softmax(_filter_logits(scaled, top_k, top_p), dim=-1)
            token = int(torch.multinomial(probs, 1, generator=generator))
        tokens.append(token)
        logprobs.append(float(logp[token]))
        if token in eos:
            break
        input_ids = torch.tensor([[token]], dtype=torch.long)
    return tokens, logprobs
