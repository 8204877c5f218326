"""A short supervised warm-up of slimckpt's tiny model on its addition task, so RL starts from a
policy that is sometimes right instead of one that never is.

A randomly initialised tiny model almost never writes the sum and its stop token, so an RL curve
from it stays near zero for hundreds of steps: nothing for a reader to see preserved. The warm-up
is teacher forcing on "a+b=" -> "answer<|im_end|>" (the chat template verl renders the prompt with)
from an unreliable teacher: for each question a fixed share of its labels, between
`teacher_error` bounds, is the sum plus one instead of the sum. The policy learns the format and
the teacher's mistakes: it samples the right sum about a third of the time, and its greedy answer
is the right one only where the teacher erred less than half the time. RL has a signal on every
question and moves the greedy answers one question at a time: a rising validation curve within a
few dozen steps, where a policy trained on right labels only would be almost done already.

Deterministic: weights, examples and their order come from `seed`, and the warm-up runs on one
thread (a thread count changes how matmuls split their sums, hence the last bits).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

# lazy imports: torch loads only when a warm-up runs (slimckpt_testing.tiny imports this module and must stay torch-free)


@dataclass(frozen=True)
class WarmUp:
    """What the warm-up does; every field is part of the tiny assets' cache key (tiny.json)."""

    steps: int = 0
    lr: float = 3e-3
    batch_size: int = 32
    # each question's share of wrong (sum + 1) labels, spread evenly over questions between these
    teacher_error: tuple[float, float] = (0.4, 0.9)

    def as_dict(self) -> dict:
        return {
            "steps": self.steps,
            "lr": self.lr,
            "batch_size": self.batch_size,
            "teacher_error": list(self.teacher_error),
        }


def teacher_label(question: str, answer: str, error: tuple[float, float], rng: random.Random) -> str:
    """The label the unreliable teacher gives this time: the answer, or (at the question's own
    rate, fixed by the question's text) the answer plus one."""
    low, high = error
    rate = low + (high - low) * random.Random(f"teacher-{question}").random()
    return str(int(answer) + 1) if rng.random() < rate else answer


def _examples(tokenizer, questions: list[tuple[str, str]]) -> list[tuple[list[int], int]]:
    """(token ids of prompt + label + EOS, prompt length) for each (question, label)."""
    out = []
    for question, answer in questions:
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        answer_ids = tokenizer.encode(answer, add_special_tokens=False) + [tokenizer.eos_token_id]
        out.append((list(prompt) + answer_ids, len(prompt)))
    return out


def _batch(examples: list[tuple[list[int], int]], pad_id: int):
    """Right-padded input ids and labels that score only the answer and its EOS."""
    import torch

    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for row, (ids, prompt_len) in enumerate(examples):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        labels[row, prompt_len : len(ids)] = torch.tensor(ids[prompt_len:])
        mask[row, : len(ids)] = 1
    return input_ids, labels, mask


def warm_up(model_dir: Path, questions: list[tuple[str, str]], config: WarmUp, seed: int) -> list[float]:
    """Train the model in model_dir for config.steps steps on (question, teacher's label) pairs for
    the (question, answer) pairs given, drawn in a seeded order, and save it back in place; returns
    the loss of each step."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if config.steps <= 0:
        return []
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rng = random.Random(f"{seed}-warmup")
    labelled = [(q, teacher_label(q, a, config.teacher_error, rng)) for q, a in questions]
    examples = _examples(tokenizer, labelled)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    losses = []
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            net = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            net.train()
            optim = torch.optim.AdamW(net.parameters(), lr=config.lr, weight_decay=0.0)
            for _ in range(config.steps):
                input_ids, labels, mask = _batch(rng.choices(examples, k=config.batch_size), tokenizer.pad_token_id)
                loss = net(input_ids=input_ids, attention_mask=mask, labels=labels).loss
                optim.zero_grad(set_to_none=True)
                loss.backward()
                optim.step()
                losses.append(loss.item())
            net.eval()
            net.save_pretrained(model_dir, safe_serialization=True)
    finally:
        torch.set_num_threads(threads)
    return losses
