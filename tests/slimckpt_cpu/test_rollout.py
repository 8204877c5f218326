"""slimckpt_cpu without Ray: seeded sampling, the hf rollout server, the CPU platform registration,
the guard against running on CPU where a GPU is visible, and the small fixes."""

import asyncio
import json
from types import SimpleNamespace

import pytest
import torch

from slimckpt_cpu.sampling import SampleKey, generate, sample_seed
from slimckpt_testing import tiny

from ..conftest import run_python


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny.build_model(tmp_path_factory.mktemp("m") / "model", seed=0)


@pytest.fixture(scope="module")
def model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa").eval()


PROMPT = [1, 5, 20, 10, 17, 11, 19, 2, 20, 1, 6, 20]


def _sample(model, key: SampleKey, seed: int = 42, **kw):
    gen = torch.Generator().manual_seed(sample_seed(seed, key))
    return generate(model, PROMPT, max_new_tokens=8, eos_token_ids=[2], generator=gen, **kw)


def test_sampling_depends_only_on_the_key(model):
    a, b = SampleKey(3, 7, 0, False), SampleKey(3, 7, 1, False)
    first = [_sample(model, a), _sample(model, b)]
    torch.manual_seed(1234)  # the global RNG plays no part
    second = [_sample(model, b), _sample(model, a)][::-1]  # other order
    assert first == second
    assert first[0][0] != first[1][0]  # a different rollout number draws differently


def test_seed_separates_every_field():
    base = SampleKey(1, 2, 3, False)
    seeds = {
        sample_seed(0, base),
        sample_seed(1, base),
        sample_seed(0, SampleKey(2, 2, 3, False)),
        sample_seed(0, SampleKey(1, 3, 3, False)),
        sample_seed(0, SampleKey(1, 2, 4, False)),
        sample_seed(0, SampleKey(1, 2, 3, True)),
    }
    assert len(seeds) == 6 and all(0 <= s < 2**63 for s in seeds)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_logprobs_match_a_full_forward(model, temperature):
    tokens, logprobs = _sample(model, SampleKey(0, 0, 0, False), temperature=temperature)
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + tokens])).logits[0, len(PROMPT) - 1 : -1].float()
    scaled = logits / temperature if temperature > 0 else logits
    expected = torch.log_softmax(scaled, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(logprobs), expected, atol=1e-5)
    if temperature == 0.0:
        assert tokens == [int(t) for t in logits.argmax(-1)]


def test_top_k_one_is_greedy(model):
    greedy, _ = _sample(model, SampleKey(0, 0, 0, False), temperature=0.0)
    top1, _ = _sample(model, SampleKey(5, 5, 5, False), temperature=1.0, top_k=1)
    assert top1 == greedy


def test_hf_server_generates_and_takes_weights(model_dir):
    from transformers import AutoModelForCausalLM

    from slimckpt_cpu.hf_server import HFRolloutServer

    config = SimpleNamespace(max_model_len=None, prompt_length=16, response_length=8, seed=42, ignore_eos=False)
    server = HFRolloutServer(config, str(model_dir), replica_rank=0)
    key = SampleKey(2, 9, 1, False).as_dict()
    params = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "logprobs": True}
    out = asyncio.run(server.generate(PROMPT, dict(params), "r1", sample_key=key))
    again = asyncio.run(server.generate(PROMPT, dict(params), "r2", sample_key=key))
    assert out.token_ids == again.token_ids and len(out.log_probs) == len(out.token_ids) <= 8

    other = AutoModelForCausalLM.from_pretrained(tiny.build_model(model_dir.parent / "other", seed=7))
    before = server.get_state_digest()
    assert asyncio.run(server.update_weights(other.state_dict(), global_steps=3)) > 0
    assert server.get_state_digest() != before and server.global_steps == 3
    for name, tensor in other.state_dict().items():
        assert torch.equal(server.model.state_dict()[name], tensor), name
    with pytest.raises(KeyError):
        asyncio.run(server.update_weights({"nonsense.weight": torch.zeros(1)}))


def test_plain_gloo():
    from slimckpt_cpu.fixes import _plain_gloo

    assert _plain_gloo(None) == "gloo"
    assert _plain_gloo("cpu:gloo,cpu:gloo") == "gloo"
    assert _plain_gloo("cpu:gloo") == "gloo"
    assert _plain_gloo("cpu:gloo,cuda:nccl") == "cpu:gloo,cuda:nccl"


def test_sample_key_from_both_agent_loops():
    from slimckpt_cpu.sample_keys import key_from_trajectory

    legacy = {"step": 4, "sample_index": 11, "rollout_n": 2, "validate": False}
    assert key_from_trajectory(legacy, {}) == SampleKey(4, 11, 2, False)
    v1 = {"step": torch.tensor(4), "sample_index": torch.tensor(11), "rollout_n": 0, "validate": True}
    assert key_from_trajectory(v1, {"session_id": 3}) == SampleKey(4, 11, 3, True)


def test_guard_refuses_cpu_mode_next_to_a_gpu(monkeypatch):
    import slimckpt_cpu as cpu

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv(cpu.FORCE_ENV, raising=False)
    with pytest.raises(SystemExit, match="SLIMCKPT_CPU_FORCE=1"):
        cpu.check_host()
    monkeypatch.setenv(cpu.FORCE_ENV, "1")
    cpu.check_host()


PROBE = """
import json, verl
from verl.utils.device import get_device_name, get_nccl_backend, get_torch_device
from verl.plugin.platform import PlatformRegistry
out = {"device": get_device_name(), "registered": "cpu" in PlatformRegistry.registered_names()}
if out["device"] == "cpu":
    from verl.workers.rollout.replica import RolloutReplicaRegistry
    from verl.workers.rollout.base import get_rollout_class
    from verl.workers.engine import EngineRegistry
    out.update(backend=get_nccl_backend(), current=get_torch_device().current_device(),
               replica=RolloutReplicaRegistry.get("hf").__name__, adapter=get_rollout_class("hf").__name__,
               engine=EngineRegistry.get_engine_cls("value_model", "fsdp2").__name__)
print("PROBE" + json.dumps(out))
"""


def _probe(env):
    # the probe imports verl's rollout and engine modules (~13 s on a loaded host); 180 s is a hang
    result = run_python(PROBE, env=env, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    line = [ln for ln in result.stdout.splitlines() if ln.startswith("PROBE")][-1]
    return json.loads(line[len("PROBE") :])


def test_cpu_platform_only_with_slimckpt_cpu():
    on = _probe({"SLIMCKPT_CPU": "1", "VERL_PLATFORM": ""})
    assert on == {
        "device": "cpu",
        "registered": True,
        "backend": "gloo",
        "current": "cpu",
        "replica": "HFReplica",
        "adapter": "HFServerAdapter",
        "engine": "FSDPEngineWithValueHead",
    }
    off = _probe({"SLIMCKPT_CPU": "0", "VERL_PLATFORM": ""})
    assert off["device"] != "cpu" and off["registered"] is False
