"""Z_phi, FlowRL's learned log-partition function: a small MLP on the mean of the prompt's last
hidden states, attached to the actor's Hugging Face module as `flowrl_log_z`.

Being a submodule of the actor makes everything else follow: FSDP shards it with the root
module, verl's optimizer (built from `module.parameters()`) trains it, verl's checkpoint manager
saves and loads it with the model shards. `slimckpt.layout.flowrl_names.is_flowrl_param` keeps it out of
every Hugging Face export and of the rollout weight sync.

How log Z is computed inside verl's forward without changing verl's model call: verl's engine
prepares the micro-batch's inputs (packed or padded), then calls the model. `set_prompt_pooling`
(called right after input preparation) leaves a pooling matrix on the head; a forward hook on the
decoder (which runs inside the root module's forward, when FSDP has the root's parameters
gathered) pools the final hidden states and evaluates the head; the engine's output step then
takes the result with `take_log_z`.
"""

from __future__ import annotations

import torch
from torch import nn

from slimckpt.layout.flowrl_names import LOG_Z_ATTR


class LogZHead(nn.Module):
    """hidden (bsz, hidden_size) -> log Z (bsz,): Linear, GELU, Linear."""

    def __init__(self, hidden_size: int, inner_size: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(hidden_size, inner_size), nn.GELU(), nn.Linear(inner_size, 1))
        # the same initial head on every rank and every run, whatever the global RNG did before
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for layer in (self.net[0], self.net[2]):
                bound = 1.0 / layer.in_features**0.5
                layer.weight.uniform_(-bound, bound, generator=generator)
                layer.bias.uniform_(-bound, bound, generator=generator)
        self.to(dtype)
        # per-forward scratch (plain attributes: not parameters, not buffers, not in the state dict)
        self.pending_pool: torch.Tensor | None = None
        self.pending_packed: bool = False
        self.log_z: torch.Tensor | None = None

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.net(pooled).squeeze(-1)


def get_head(module: nn.Module) -> LogZHead | None:
    """The head of an actor module, through FSDP1's wrapper if there is one."""
    inner = getattr(module, "_fsdp_wrapped_module", module)
    head = getattr(inner, LOG_Z_ATTR, None)
    return head if isinstance(head, LogZHead) else None


def _decoder(module: nn.Module) -> nn.Module:
    get_decoder = getattr(module, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    if decoder is None or decoder is module:
        decoder = getattr(module, "model", None)
    if not isinstance(decoder, nn.Module):
        raise ValueError(f"FlowRL: cannot find the decoder of {type(module).__name__} to read its last hidden states")
    return decoder


def attach_log_z_head(module: nn.Module, inner_size: int, seed: int = 0) -> LogZHead:
    """Add Z_phi to a Hugging Face causal LM (before FSDP wraps it) and hook it to the decoder."""
    config = module.config
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    first = next(module.parameters())
    head = LogZHead(int(text_config.hidden_size), int(inner_size), seed=seed, dtype=first.dtype)
    # ranks other than 0 may hold the model on the meta device until verl broadcasts rank 0's weights
    head.to(first.device)
    module.add_module(LOG_Z_ATTR, head)

    def on_decoder_output(_decoder_module, _args, output):
        pool = head.pending_pool
        if pool is None:
            return None
        head.pending_pool = None
        hidden = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]
        head.log_z = head(pool_hidden(hidden, pool, head.pending_packed).to(head.net[0].weight.dtype))
        return None

    _decoder(module).register_forward_hook(on_decoder_output)
    return head


def pool_hidden(hidden: torch.Tensor, pool: torch.Tensor, packed: bool) -> torch.Tensor:
    """Weighted sums of hidden states: packed (1, N', H) with pool (bsz, N), or padded (bsz, L', H)
    with pool (bsz, L); N' >= N (L' >= L) when the engine padded the sequence at the end."""
    if packed:
        states = hidden[0]
        extra = states.shape[0] - pool.shape[1]
        if extra > 0:
            pool = torch.nn.functional.pad(pool, (0, extra))
        return pool.to(states.dtype) @ states
    extra = hidden.shape[1] - pool.shape[1]
    if extra > 0:
        pool = torch.nn.functional.pad(pool, (0, extra))
    return torch.einsum("bl,blh->bh", pool.to(hidden.dtype), hidden)


def prompt_pooling(seq_lens: torch.Tensor, prompt_lens: torch.Tensor, packed: bool) -> torch.Tensor:
    """Pooling matrix whose row i averages sample i's prompt tokens.

    Packed layout: samples back to back, (bsz, sum(seq_lens)). Padded layout: one row per sample,
    tokens from column 0, (bsz, max(seq_lens)).
    """
    bsz = seq_lens.shape[0]
    width = int(seq_lens.sum()) if packed else int(seq_lens.max())
    starts = torch.cumsum(seq_lens, 0) - seq_lens if packed else torch.zeros_like(seq_lens)
    cols = torch.arange(width, device=seq_lens.device).unsqueeze(0).expand(bsz, width)
    inside = (cols >= starts.unsqueeze(1)) & (cols < (starts + prompt_lens).unsqueeze(1))
    return inside.to(torch.float32) / prompt_lens.clamp(min=1).unsqueeze(1).to(torch.float32)


def prompt_lengths(micro_batch) -> torch.Tensor:
    """Prompt tokens per sample of a verl micro-batch (no-padding format), as verl's
    no_padding_2_padding derives them: nested prompts, or the attention mask's prompt columns."""
    prompts = micro_batch["prompts"]
    if getattr(prompts, "is_nested", False):
        return prompts.offsets().diff()
    attention_mask = micro_batch["attention_mask"]
    return attention_mask[:, : prompts.shape[1]].sum(dim=1)
