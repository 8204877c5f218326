"""FlowRL pieces without Ray: the loss against its formula, the registered loss through verl's
aggregation, the prompt pooling of the log Z head, the head on a real (tiny) Hugging Face model,
the parameter-name rule, and the config that switches FlowRL on."""

import math
import textwrap
from types import SimpleNamespace

import pytest
import torch

from slimckpt_flowrl import is_flowrl_param
from slimckpt_flowrl.head import LogZHead, attach_log_z_head, pool_hidden, prompt_pooling
from slimckpt_flowrl.loss import compute_policy_loss_flowrl, flowrl_inputs, flowrl_objective

from ..conftest import run_python


def _batch(seed=0, bsz=4, length=5):
    g = torch.Generator().manual_seed(seed)
    log_prob = -torch.rand(bsz, length, generator=g) * 3
    old_log_prob = log_prob + 0.3 * torch.randn(bsz, length, generator=g)
    ref_log_prob = -torch.rand(bsz, length, generator=g) * 3
    log_z = torch.randn(bsz, generator=g)
    # one scalar per sequence, broadcast over the response like GRPO's advantage
    adv = torch.randn(bsz, 1, generator=g).expand(bsz, length).clone()
    mask = torch.ones(bsz, length)
    mask[1, 3:] = 0  # a shorter response
    mask[2, 1:] = 0  # a one-token response
    old_log_prob[3] = log_prob[3] - 2.0  # ratio e^(2*5) = e^10 > 10: clamped
    return log_prob, old_log_prob, ref_log_prob, log_z, adv, mask


def _reference(log_prob, old_log_prob, ref_log_prob, log_z, adv, mask, beta, max_w):
    """The formula, one sample at a time, in float64."""
    out = []
    for i in range(log_prob.shape[0]):
        idx = [t for t in range(log_prob.shape[1]) if mask[i, t] > 0]
        n = len(idx)
        mean_lp = sum(float(log_prob[i, t]) for t in idx) / n
        mean_ref = sum(float(ref_log_prob[i, t]) for t in idx) / n
        r_hat = float(adv[i, idx[0]])
        ratio = math.exp(sum(float(log_prob[i, t] - old_log_prob[i, t]) for t in idx))
        w = min(ratio, max_w)
        out.append(w * (float(log_z[i]) + mean_lp - beta * r_hat - mean_ref) ** 2)
    return out


@pytest.mark.parametrize("beta,max_w", [(15.0, 10.0), (1.0, 2.0)])
def test_objective_matches_formula(beta, max_w):
    batch = _batch()
    loss, parts = flowrl_objective(*batch, beta=beta, max_weight=max_w)
    expected = _reference(*batch, beta=beta, max_w=max_w)
    assert loss.shape == (4,)
    assert loss.tolist() == pytest.approx(expected, rel=1e-5)
    assert parts["weight"][3].item() == pytest.approx(max_w)  # the clamp was hit
    assert parts["weight_clipped"].tolist() == [0.0, 0.0, 0.0, 1.0]


def test_objective_gradients_and_detached_weight():
    log_prob, old_log_prob, ref_log_prob, log_z, adv, mask = _batch()
    log_prob.requires_grad_(True)
    log_z.requires_grad_(True)
    old_log_prob.requires_grad_(True)
    loss, parts = flowrl_objective(log_prob, old_log_prob, ref_log_prob, log_z, adv, mask)
    loss.sum().backward()
    # d/d logZ of w * r^2 = 2 w r, with w held constant
    assert log_z.grad.tolist() == pytest.approx((2 * parts["weight"] * parts["residual"]).tolist(), rel=1e-5)
    assert old_log_prob.grad is None or torch.all(old_log_prob.grad == 0)  # w is detached
    # d/d logp_t = 2 w r / |y| on response tokens, 0 on padding
    n = mask.sum(-1, keepdim=True)
    expected = 2 * (parts["weight"] * parts["residual"]).unsqueeze(-1) / n * mask
    assert torch.allclose(log_prob.grad, expected, rtol=1e-5, atol=1e-7)


def test_sample_without_response_tokens_contributes_nothing():
    log_prob, old_log_prob, ref_log_prob, log_z, adv, mask = _batch()
    mask[0] = 0
    loss, _ = flowrl_objective(log_prob, old_log_prob, ref_log_prob, log_z, adv, mask)
    assert loss[0].item() == 0.0 and torch.isfinite(loss).all()


def test_registered_loss_is_the_mean_over_sequences_through_verls_aggregation():
    log_prob, old_log_prob, ref_log_prob, log_z, adv, mask = _batch()
    config = SimpleNamespace(policy_loss=SimpleNamespace(beta=15.0, max_importance_weight=10.0), global_batch_info={})
    with flowrl_inputs(log_z=log_z, ref_log_prob=ref_log_prob):
        loss, metrics = compute_policy_loss_flowrl(old_log_prob, log_prob, adv, mask, "seq-mean-token-mean", config)
    expected = sum(_reference(log_prob, old_log_prob, ref_log_prob, log_z, adv, mask, 15.0, 10.0)) / 4
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert metrics["actor/flowrl_weight_clipped"] == pytest.approx(0.25)
    # verl's global normalisation: 2 ranks x a global mini-batch of 16 sequences
    config.global_batch_info = {
        "dp_size": 2,
        "global_batch_size": 16,
        "batch_num_tokens": None,
        "loss_scale_factor": None,
    }
    with flowrl_inputs(log_z=log_z, ref_log_prob=ref_log_prob):
        scaled, _ = compute_policy_loss_flowrl(old_log_prob, log_prob, adv, mask, "seq-mean-token-mean", config)
    assert scaled.item() == pytest.approx(expected * 4 / 16 * 2, rel=1e-5)


def test_registered_loss_without_its_inputs_says_how_to_select_flowrl():
    log_prob, old_log_prob, _, _, adv, mask = _batch()
    with pytest.raises(RuntimeError, match=r"\+algo=flowrl"):
        compute_policy_loss_flowrl(old_log_prob, log_prob, adv, mask, "seq-mean-token-mean", SimpleNamespace())


def test_flowrl_param_names():
    for name in (
        "flowrl_log_z.net.0.weight",
        "_fsdp_wrapped_module.flowrl_log_z.net.2.bias",
        "base_model.model.flowrl_log_z.net.0.weight",
    ):
        assert is_flowrl_param(name)
    for name in (
        "model.layers.0.mlp.up_proj.weight",
        "lm_head.weight",
        "flowrl_log_z_extra.weight",
        "model.flowrl_log_zz.weight",
    ):
        assert not is_flowrl_param(name)


def test_prompt_pooling_packed_and_padded():
    seq_lens = torch.tensor([5, 3, 4])
    prompt_lens = torch.tensor([2, 3, 1])
    hidden_rows = torch.arange(12, dtype=torch.float32).unsqueeze(-1) * torch.tensor([1.0, 10.0])  # (12, 2)
    packed = pool_hidden(hidden_rows.unsqueeze(0), prompt_pooling(seq_lens, prompt_lens, packed=True), True)
    # prompts: rows 0-1, rows 5-7, row 8
    assert packed[:, 0].tolist() == pytest.approx([0.5, 6.0, 8.0])
    assert packed[:, 1].tolist() == pytest.approx([5.0, 60.0, 80.0])
    # padded layout: sample i's tokens from column 0; the engine may pad extra columns at the end
    padded = torch.zeros(3, 6, 2)
    starts = [0, 5, 8]
    for i in range(3):
        padded[i, : seq_lens[i]] = hidden_rows[starts[i] : starts[i] + seq_lens[i]]
    pooled = pool_hidden(padded, prompt_pooling(seq_lens, prompt_lens, packed=False), False)
    assert torch.allclose(pooled, packed)


def test_head_on_a_tiny_llama_gives_log_z_with_gradients():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    head = attach_log_z_head(model, inner_size=8, seed=3)
    assert isinstance(model.flowrl_log_z, LogZHead)
    assert {n for n in model.state_dict() if is_flowrl_param(n)} == {
        "flowrl_log_z.net.0.weight",
        "flowrl_log_z.net.0.bias",
        "flowrl_log_z.net.2.weight",
        "flowrl_log_z.net.2.bias",
    }
    # same seed, same head, whatever the global RNG
    torch.manual_seed(123)
    again = LogZHead(16, 8, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(head.state_dict().values(), again.state_dict().values()))

    ids = torch.randint(0, 32, (2, 6))
    model(input_ids=ids)  # no pooling requested: no log Z
    assert head.log_z is None
    head.pending_pool = prompt_pooling(torch.tensor([6, 6]), torch.tensor([2, 4]), packed=False)
    head.pending_packed = False
    out = model(input_ids=ids, output_hidden_states=True)
    log_z = head.log_z
    assert log_z.shape == (2,) and head.pending_pool is None
    last = out.hidden_states[-1]
    expected = head(torch.stack([last[0, :2].mean(0), last[1, :4].mean(0)]))
    assert torch.allclose(log_z, expected, atol=1e-6)
    (log_z.sum() + out.logits.sum()).backward()
    assert head.net[0].weight.grad is not None and head.net[0].weight.grad.abs().sum() > 0


def test_flowrl_config_registers_the_loss_and_applies_the_patches():
    code = textwrap.dedent(
        """
        from verl.trainer.ppo import core_algos
        from verl.workers.utils import losses
        from slimckpt.verl.registry import REGISTRY
        assert "flowrl" not in core_algos.POLICY_LOSS_REGISTRY
        from slimckpt_flowrl.config import FlowRLLossConfig, active_head_settings
        cfg = FlowRLLossConfig(beta=15.0, log_z_hidden_size=32)
        assert "flowrl" in core_algos.POLICY_LOSS_REGISTRY
        import verl.workers.engine_workers as ew
        assert ew.ppo_loss is not losses.ppo_loss, "ppo_loss not wrapped"
        assert active_head_settings().inner_size == 32
        import verl.utils.checkpoint.fsdp_checkpoint_manager, verl.workers.engine.fsdp.transformer_impl  # lazy patches
        assert all(REGISTRY.is_applied(p.name) for p in REGISTRY.patches("flowrl")), REGISTRY.applied()
        try:
            FlowRLLossConfig(loss_mode="vanilla")
        except ValueError as e:
            assert "loss_mode='vanilla'" in str(e)
        else:
            raise AssertionError("loss_mode=vanilla accepted")
        print("OK")
        """
    )
    proc = run_python(code, env={"SLIMCKPT_LOG_LEVEL": "WARNING"})
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr
