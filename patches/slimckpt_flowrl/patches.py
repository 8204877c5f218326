"""What the "flowrl" patches (listed in slimckpt.verl.patch_list) do to verl 0.9.1.

Each function takes verl's original and returns the replacement; each replacement behaves exactly
like the original unless the actor carries FlowRL's log Z head (only +algo=flowrl adds it).

- engine `_build_module`: the trainable actor (a language model that is not forward-only, i.e.
  neither the reference model nor the critic) gets Z_phi as submodule `flowrl_log_z`.
- engine `prepare_model_inputs`: when gradients are on (the actor update), leave the prompt
  pooling matrix of this micro-batch on the head; the decoder hook evaluates log Z.
- engine `prepare_model_outputs`: hand log Z to the loss as model_output["flowrl_log_z"].
- `ppo_loss` (the actor's loss function): for loss_mode=flowrl, put log Z and the reference
  log-probs where the registered loss "flowrl" reads them (slimckpt_flowrl.loss).
- engine `get_per_tensor_param` / `get_per_tensor_param_shard` (weights pushed to the rollout
  engine), the checkpoint manager's `get_fsdp_full_state_dict` (verl's hf_model save) and verl's
  model merger's `save_hf_model_and_tokenizer`: drop FlowRL's parameters (`is_flowrl_param`).
"""

# lazy imports: the wrappers import torch, verl's helpers and the head when they first run (patched at `import verl`)
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from slimckpt.layout.flowrl_names import is_flowrl_param
from slimckpt.log import get_logger


def wrap_build_module(original: Callable) -> Callable:
    @functools.wraps(original)
    def _build_module(self):
        module = original(self)
        from slimckpt_flowrl.config import active_head_settings
        from slimckpt_flowrl.head import attach_log_z_head

        settings = active_head_settings()
        trains_language_model = (
            getattr(self.model_config, "model_type", None) == "language_model" and not self.engine_config.forward_only
        )
        if settings is not None and trains_language_model:
            attach_log_z_head(module, settings.inner_size, settings.seed)
        return module

    return _build_module


def wrap_prepare_model_inputs(original: Callable) -> Callable:
    @functools.wraps(original)
    def prepare_model_inputs(self, micro_batch):
        import torch
        from verl.utils import tensordict_utils as tu

        from slimckpt_flowrl.head import get_head, prompt_lengths, prompt_pooling

        model_inputs, output_args = original(self, micro_batch=micro_batch)
        head = get_head(self.module)
        if head is None or not torch.is_grad_enabled():
            return model_inputs, output_args
        if getattr(self, "use_ulysses_sp", False):
            raise NotImplementedError(
                "FlowRL's log Z head needs whole prompts on each rank: set "
                "actor_rollout_ref.actor.ulysses_sequence_parallel_size=1 with +algo=flowrl"
            )
        packed = bool(tu.get_non_tensor_data(data=micro_batch, key="use_remove_padding", default=True))
        seq_lens = micro_batch["input_ids"].offsets().diff()
        head.pending_pool = prompt_pooling(seq_lens, prompt_lengths(micro_batch).to(seq_lens.device), packed)
        head.pending_packed = packed
        return model_inputs, output_args

    return prepare_model_inputs


def wrap_prepare_model_outputs(original: Callable) -> Callable:
    @functools.wraps(original)
    def prepare_model_outputs(self, output, output_args, micro_batch, logits_processor_func):
        from slimckpt_flowrl.head import get_head

        model_output = original(self, output, output_args, micro_batch, logits_processor_func)
        head = get_head(self.module)
        if head is not None and head.log_z is not None:
            model_output["flowrl_log_z"] = head.log_z
            head.log_z = None
        return model_output

    return prepare_model_outputs


def wrap_ppo_loss(original: Callable) -> Callable:
    @functools.wraps(original)
    def ppo_loss(config, model_output, data, dp_group=None):
        from slimckpt_flowrl.loss import LOSS_MODE, flowrl_inputs

        if config.policy_loss.get("loss_mode", "vanilla") != LOSS_MODE:
            return original(config, model_output, data, dp_group=dp_group)
        log_z = model_output.get("flowrl_log_z")
        if log_z is None:
            raise RuntimeError(
                "loss_mode=flowrl: the actor produced no log Z; the actor module has no flowrl_log_z head "
                "(was FlowRLLossConfig built in this worker before the model? use +algo=flowrl)"
            )
        if "ref_log_prob" not in data:
            raise RuntimeError(
                "loss_mode=flowrl needs the reference model's log-probs: keep actor_rollout_ref.actor.use_kl_loss=true "
                "(+algo=flowrl sets it, with kl_loss_coef=0) so that verl runs the reference model"
            )
        # the same padding verl's ppo_loss applies to old_log_probs
        ref_log_prob = data.select("ref_log_prob", "response_mask").to_padded_tensor()["ref_log_prob"]
        with flowrl_inputs(log_z=log_z, ref_log_prob=ref_log_prob):
            return original(config, model_output, data, dp_group=dp_group)

    return ppo_loss


def _drop_flowrl_pairs(pairs):
    for item in pairs:
        if not is_flowrl_param(item[0]):
            yield item


def wrap_per_tensor_param(original: Callable) -> Callable:
    """(iterable of (name, tensor, ...), extra) -> the same without FlowRL's names. The tensors
    are still produced in order (FSDP gathers them collectively on every rank), only not yielded."""

    @functools.wraps(original)
    def get_per_tensor_param(self, *args, **kwargs):
        params, extra = original(self, *args, **kwargs)
        from slimckpt_flowrl.head import get_head

        if get_head(self.module) is None:
            return params, extra
        if isinstance(params, dict):
            return {k: v for k, v in params.items() if not is_flowrl_param(k)}, extra
        return _drop_flowrl_pairs(params), extra

    return get_per_tensor_param


def wrap_full_state_dict(original: Callable) -> Callable:
    @functools.wraps(original)
    def get_fsdp_full_state_dict(*args: Any, **kwargs: Any):
        state_dict = original(*args, **kwargs)
        if isinstance(state_dict, dict):
            state_dict = {k: v for k, v in state_dict.items() if not is_flowrl_param(k)}
        return state_dict

    return get_fsdp_full_state_dict


def wrap_save_hf_model(original: Callable) -> Callable:
    @functools.wraps(original)
    def save_hf_model_and_tokenizer(self, state_dict):
        dropped = [k for k in state_dict if is_flowrl_param(k)]
        if dropped:
            get_logger("slimckpt.flowrl").info("HF export leaves out FlowRL's log Z head (%d tensors)", len(dropped))
            state_dict = {k: v for k, v in state_dict.items() if not is_flowrl_param(k)}
        return original(self, state_dict)

    return save_hf_model_and_tokenizer
