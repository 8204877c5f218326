"""The `hf` rollout server: a Ray actor holding a Hugging Face model on the host.

It answers the calls verl's agent loop, load balancer and checkpoint engine make on a vLLM or
SGLang server (generate, wake_up, sleep, set_global_steps, abort ...), token in, token out, with
the log-probabilities of the sampled tokens. Weights arrive from the actor through
`update_weights` (see slimckpt_cpu.rollout.HFServerAdapter). Meant for tiny models on CPU: requests
run one after another, each with KV-cached decoding.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from transformers import AutoModelForCausalLM, GenerationConfig
from verl.workers.rollout.replica import TokenOutput

from slimckpt import env_vars
from slimckpt.log import get_logger
from slimckpt_cpu.sampling import SampleKey, generate, sample_seed

log = get_logger("slimckpt_cpu.hf_server")


class HFRolloutServer:
    def __init__(self, config: Any, model_path: str, replica_rank: int, attn_implementation: str = "sdpa") -> None:
        # Requests run serially; more threads than this only contend with the trainer ranks.
        torch.set_num_threads(env_vars.integer("SLIMCKPT_ROLLOUT_THREADS"))
        self.config = config
        self.replica_rank = replica_rank
        self.global_steps: int | None = None
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=torch.float32, attn_implementation=attn_implementation
        ).eval()
        eos = self.model.config.eos_token_id
        try:
            gen_eos = GenerationConfig.from_pretrained(model_path).eos_token_id
        except OSError:
            gen_eos = None
        self.eos_token_ids = {
            int(t)
            for src in (eos, gen_eos)
            if src is not None
            for t in (src if isinstance(src, (list, tuple)) else [src])
        }
        self.max_model_len = int(config.max_model_len or (config.prompt_length + config.response_length))
        self._unkeyed = 0

    # --- generation -------------------------------------------------------------------------

    def _generator(self, sample_key: dict | None) -> torch.Generator:
        gen = torch.Generator()
        if sample_key is None:
            # Only when slimckpt's sample-key patch is off: reproducible within a run, not across resumes.
            if self._unkeyed == 0:
                log.warning("hf rollout: a request came without a sample key; sampling is not resume-deterministic")
            self._unkeyed += 1
            gen.manual_seed(sample_seed(int(self.config.seed), SampleKey(-1, self._unkeyed, self.replica_rank, False)))
        else:
            gen.manual_seed(sample_seed(int(self.config.seed), SampleKey.from_dict(sample_key)))
        return gen

    async def generate(
        self,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        request_id: str,
        image_data: list[Any] | None = None,
        video_data: list[Any] | None = None,
        audio_data: list[Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
        priority: int = 0,
        sample_key: dict | None = None,
        **_: Any,
    ):
        if image_data or video_data or audio_data:
            raise NotImplementedError("the hf rollout is text-only")
        prompt_ids = [int(t) for t in prompt_ids]
        room = self.max_model_len - len(prompt_ids)
        if room < 1:
            raise ValueError(
                f"prompt of {len(prompt_ids)} tokens leaves no room within max_model_len={self.max_model_len}"
            )
        params = dict(sampling_params)
        max_tokens = params.get("max_tokens", params.get("max_new_tokens"))
        if max_tokens is None:
            max_tokens = min(
                self.config.response_length, self.config.prompt_length + self.config.response_length - len(prompt_ids)
            )
        max_tokens = max(1, min(int(max_tokens), room))
        eos = set() if params.get("ignore_eos", self.config.ignore_eos) else self.eos_token_ids
        tokens, logprobs = generate(
            self.model,
            prompt_ids,
            max_new_tokens=max_tokens,
            eos_token_ids=eos,
            temperature=float(params.get("temperature", 1.0)),
            top_k=int(params.get("top_k", -1)),
            top_p=float(params.get("top_p", 1.0)),
            generator=self._generator(sample_key),
        )
        return TokenOutput(
            token_ids=tokens,
            log_probs=logprobs if params.get("logprobs") else None,
            stop_reason="completed",
            extra_fields={"global_steps": self.global_steps},
        )

    # --- weights ----------------------------------------------------------------------------

    async def update_weights(self, state: dict[str, torch.Tensor], global_steps: int | None = None) -> int:
        own = self.model.state_dict()
        unknown = sorted(set(state) - set(own))
        if unknown:
            raise KeyError(f"hf rollout: weights not in the rollout model: {unknown[:5]}")
        with torch.no_grad():
            for name, tensor in state.items():
                own[name].copy_(tensor.to(own[name].dtype))
        if "lm_head.weight" not in state and getattr(self.model.config, "tie_word_embeddings", False):
            self.model.tie_weights()
        if global_steps is not None:
            self.global_steps = global_steps
        return len(state)

    async def set_global_steps(self, global_steps: int) -> None:
        self.global_steps = global_steps

    # --- the rest of a rollout server's interface: nothing to free or pause on the host ------

    async def wake_up(self, tags: list[str] | None = None) -> None:
        return None

    async def sleep(self) -> None:
        return None

    async def clear_kv_cache(self) -> None:
        return None

    async def release_kv_cache(self) -> None:
        return None

    async def resume_kv_cache(self) -> None:
        return None

    async def wait_for_requests_to_drain(self) -> None:
        return None

    async def abort_all_requests(self, reset_prefix_cache: bool = True, reject_request: bool = False) -> dict:
        return {"aborted_count": 0, "request_ids": []}

    async def abort_request(self, request_id: str, reset_prefix_cache: bool = True) -> dict:
        return {"aborted": False, "request_id": request_id}

    async def resume_generation(self) -> None:
        return None

    async def start_profile(self, **kwargs: Any) -> None:
        return None

    async def stop_profile(self) -> None:
        return None

    def get_state_digest(self) -> str:
        """sha256 over the weights, for tests comparing rollout and actor weights."""
        h = hashlib.sha256()
        for name, tensor in sorted(self.model.state_dict().items()):
            h.update(name.encode())
            h.update(tensor.detach().float().contiguous().numpy().tobytes())
        return h.hexdigest()
