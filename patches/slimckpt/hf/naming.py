"""The Hugging Face side of a merge or export: what `save_pretrained` (as verl's merger and its
`hf_model` save call it) would name, drop and write, asked of a meta-device model of the
checkpoint's config, so no weights are materialised. Used by `slimckpt merge`, the in-training
exports and `slimckpt plan`.
"""

from __future__ import annotations

import inspect
import os
import warnings

from slimckpt import SlimckptError, internals
from slimckpt.engine.checkpoint_dir import CheckpointError
from slimckpt.layout.flowrl_names import is_flowrl_param
from slimckpt.layout.names import HF_SUBDIR, torch_dtypes_of_choices
from slimckpt.layout.safetensors_layout import Take
from slimckpt.log import get_logger
from slimckpt.verl_files.leaves import leaf

# lazy imports: torch and transformers load only once a model is named (a wrong --local_dir fails before them);
# transformers through `transformers()`, its one import here

log = get_logger("slimckpt.merge")


class NeedsVerlMerger(SlimckptError):
    """This checkpoint is outside what the streaming merge reproduces exactly."""


class ConfigMismatch(SlimckptError, ValueError):
    """A checkpoint tensor that transformers splits on save does not have the shape config.json
    gives it (another number of experts, or other sizes): the config is not this checkpoint's."""

    def __init__(self, name: str, shape: tuple[int, ...], expected: tuple[int, ...], config_path: str) -> None:
        self.name, self.shape, self.expected, self.config_path = name, shape, expected, config_path
        super().__init__(
            f"{name!r} is {list(shape)}, but {config_path} makes it {list(expected)} (another number "
            f"of experts or other sizes): that config.json does not belong to this checkpoint; copy "
            f"the training run's huggingface/ dir along"
        )


def transformers():
    """The transformers module, imported the first time a model is named."""
    import transformers as lib

    return lib


def default_max_shard_size() -> int | str:
    """What `save_pretrained` uses when verl calls it without max_shard_size ("50GB" in transformers 5)."""

    return inspect.signature(transformers().PreTrainedModel.save_pretrained).parameters["max_shard_size"].default


def auto_model_class(config):
    """The transformers auto class verl 0.9.1's merger builds the model with
    (`BaseModelMerger.get_transformers_auto_model_class`): the auto_map entry naming the
    architecture when the model has remote code, else by the architecture's suffix."""
    lib = transformers()
    arch = config.architectures[0]
    vision = leaf("transformers_compat").get_auto_model_for_vision2seq
    if hasattr(config, "auto_map") and any(arch in v for v in config.auto_map.values()):
        auto_class = next(k for k, v in config.auto_map.items() if arch in v)
        if auto_class in ("AutoModelForCausalLM", "AutoModelForTokenClassification"):
            return getattr(lib, auto_class)
        if auto_class in ("AutoModelForVision2Seq", "AutoModelForImageTextToText"):
            return vision()
        raise NotImplementedError(f"Unknown auto class {auto_class}")
    if "ForTokenClassification" in arch:
        return lib.AutoModelForTokenClassification
    if "ForCausalLM" in arch:
        return lib.AutoModelForCausalLM
    if "ForConditionalGeneration" in arch:
        return vision()
    raise NotImplementedError(f"Unknown architecture {config.architectures}")


def load_generation_config(hf_dir: str):
    """The generation config saved beside the checkpoint's config, or None (with verl's warning):
    verl 0.9.1's merger gives it to the model instead of the one derived from the config."""
    if not os.path.isfile(os.path.join(hf_dir, "generation_config.json")):
        log.warning(
            "Generation config file not found in %s, using a generation config created from the "
            "model config (as verl's merger does)",
            hf_dir,
        )
        return None
    return transformers().GenerationConfig.from_pretrained(hf_dir)


# ------------------------------------------------------------------------------------------------
# The Hugging Face side: what save_pretrained + verl's save_hf_model_and_tokenizer would do
# ------------------------------------------------------------------------------------------------
class HfSide:
    """A meta-device model of the checkpoint's config: names, config files, tokenizer, like verl."""

    def __init__(self, local_dir: str, dtype: str, trust_remote_code: bool) -> None:
        import torch

        AutoConfig = transformers().AutoConfig
        self.hf_dir = os.path.join(local_dir, HF_SUBDIR)
        config_path = os.path.join(self.hf_dir, "config.json")
        if not os.path.isfile(config_path):
            raise CheckpointError(
                f"{config_path} is missing; verl writes it on rank 0 "
                f"with every checkpoint: copy the checkpoint's huggingface/ dir along"
            )
        self.trust_remote_code = trust_remote_code
        # verl's merger loads this config, picks the auto class and patches the generation config as
        # below (BaseModelMerger, verl 0.9.1); tests/verl_files/test_leaves.py holds both to the same answers
        self.model_config = AutoConfig.from_pretrained(self.hf_dir, trust_remote_code=trust_remote_code)
        if not getattr(self.model_config, "architectures", None):
            raise CheckpointError(
                f'{config_path} names no "architectures"; add the '
                f'model class, e.g. "architectures": ["LlamaForCausalLM"]'
            )
        self.torch_dtype = torch_dtypes_of_choices(torch)[dtype]
        auto_cls = auto_model_class(self.model_config)
        try:
            # all on meta, buffers too: transformers then skips initialising the weights (measured: BENCHMARKS.md)
            with torch.device("meta"):
                model = auto_cls.from_config(
                    self.model_config, dtype=self.torch_dtype, trust_remote_code=trust_remote_code
                )
        except Exception:  # noqa: BLE001 - a model whose __init__ computes with its buffers: verl's way
            from accelerate import init_empty_weights

            with init_empty_weights():
                model = auto_cls.from_config(
                    self.model_config, dtype=self.torch_dtype, trust_remote_code=trust_remote_code
                )
        if model.can_generate():
            generation_config = load_generation_config(self.hf_dir)
            if generation_config is not None:
                model.generation_config = generation_config
        self.model = model
        self._model_shapes: dict[str, tuple[int, ...]] | None = None

    def output_sources(self, names: list[str], shapes: dict[str, tuple[int, ...]]) -> dict[str, Take]:
        """{output name: where its elements come from}, in the order save_pretrained would see the
        state dict. Learnt by running transformers' own `revert_weight_conversion` on meta tensors
        of the checkpoint's shapes: a renamed tensor comes back as the same tensor (a whole `Take`),
        a part split off a fused one (transformers 5's MoE experts) as a view of it, whose storage
        offset and shape give the run of elements it is. Raises NeedsVerlMerger for an output that
        is neither (made of several tensors, or a strided part: transposed or interleaved), and
        ConfigMismatch when a tensor transformers splits does not have the shape config.json gives it."""
        import torch

        revert_weight_conversion = internals.lookup("transformers.core_model_loading:revert_weight_conversion")
        if revert_weight_conversion is None:
            raise NeedsVerlMerger(
                "this transformers' save-time conversion is not one slimckpt was checked on "
                f"(slimckpt.internals: {', '.join(internals.CHECKED_TRANSFORMERS)})"
            )
        meta = {n: torch.empty(shapes[n], dtype=self.torch_dtype, device="meta") for n in self._kept(names)}
        model_name = type(self.model).__name__
        try:
            reverted = revert_weight_conversion(self.model, dict(meta))
        except Exception as exc:  # noqa: BLE001 - a conversion that does not fit these shapes
            for n in meta:  # most likely a config that is not this checkpoint's: say which tensor differs
                self._check_config_shape(n, tuple(shapes[n]))
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise NeedsVerlMerger(
                f"transformers' save-time conversion of {model_name} fails on this checkpoint's "
                f"shapes ({type(exc).__name__}: {first[:160]})"
            ) from None
        by_id = {id(t): n for n, t in meta.items()}
        takes: dict[str, Take] = {}
        for new, t in reverted.items():
            old = by_id.get(id(t))
            if old is not None:  # the checkpoint's tensor itself, maybe renamed
                takes[new] = Take(old, tuple(shapes[old]))
                continue
            old = by_id.get(id(t._base)) if isinstance(t, torch.Tensor) and t._base is not None else None
            if old is None:
                raise NeedsVerlMerger(
                    f"transformers converts tensors of {model_name} on save "
                    f"(e.g. {new!r} is not a part of one checkpoint tensor)"
                )
            if not t.is_contiguous():
                raise NeedsVerlMerger(
                    f"transformers converts tensors of {model_name} on save (e.g. {new!r} is a "
                    f"strided part of {old!r}: transposed or interleaved)"
                )
            self._check_config_shape(old, tuple(shapes[old]))
            start = t.storage_offset() - t._base.storage_offset()
            takes[new] = Take(old, tuple(t.shape), (start, start + t.numel()))
        return takes

    def output_names(self, names: list[str], shapes: dict[str, tuple[int, ...]]) -> dict[str, str]:
        """{output name: checkpoint name}, for callers that write whole tensors only: NeedsVerlMerger
        when an output is a part of a checkpoint tensor (both exports use `output_sources`)."""
        mapping = {}
        for new, take in self.output_sources(names, shapes).items():
            if not take.whole:
                raise NeedsVerlMerger(
                    f"transformers converts tensors of {type(self.model).__name__} on save (e.g. {new!r})"
                )
            mapping[new] = take.source
        return mapping

    def _kept(self, names: list[str]) -> list[str]:
        """The names save_pretrained writes of `names`: FlowRL's head, tied targets (verl's
        drop_tied_target_keys) and `_keys_to_ignore_on_save` left out."""

        # FlowRL's log Z head is trained with the actor but is no part of the language model
        keep: dict[str, object] = {n: None for n in names if not is_flowrl_param(n)}
        if len(keep) < len(names):
            log.info("HF export leaves out FlowRL's log Z head (%d tensors)", len(names) - len(keep))
        leaf("transformers_compat").drop_tied_target_keys(keep, self.model, self.model_config)
        for key in self.model._keys_to_ignore_on_save or ():
            keep.pop(key, None)
        return list(keep)

    def _check_config_shape(self, name: str, shape: tuple[int, ...]) -> None:
        """A tensor transformers splits on save must have the shape config.json gives it: its split
        follows the tensor (one output per expert it holds), from_pretrained follows the config."""
        if self._model_shapes is None:
            self._model_shapes = {n: tuple(t.shape) for n, t in self.model.state_dict().items()}
        expected = self._model_shapes.get(name)
        if expected is not None and expected != shape:
            raise ConfigMismatch(name, shape, expected, os.path.join(self.hf_dir, "config.json"))

    def total_parameters(self) -> int:
        return self.model.num_parameters()

    def save_configs(self, out_dir: str) -> None:
        """config.json and generation_config.json exactly as save_pretrained writes them."""
        model = self.model
        model.config.dtype = str(model.dtype).split(".")[1]
        model.config.architectures = [model.__class__.__name__.removeprefix("FSDP")]
        if model._auto_class is not None:
            transformers().dynamic_module_utils.custom_object_save(model, out_dir, config=model.config)
        model.config.save_pretrained(out_dir)
        if model.can_generate():
            model.generation_config.save_pretrained(out_dir)

    def save_tokenizer(self, out_dir: str) -> bool:
        """Processor and tokenizer through verl's loaders; False (with a warning) when there is none."""

        verl_tokenizer = leaf("tokenizer")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            processor = verl_tokenizer.hf_processor(self.hf_dir, trust_remote_code=self.trust_remote_code)
        try:
            tokenizer = verl_tokenizer.hf_tokenizer(self.hf_dir, trust_remote_code=self.trust_remote_code)
        except Exception as exc:  # noqa: BLE001 - transformers raises OSError/ValueError/TypeError here
            tokenizer = None
            log.warning(
                "no tokenizer in %s (%s): the merged model has none; copy one in before serving it "
                "(verl's merger exits 1 here, after writing the weights)",
                self.hf_dir,
                str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__,
            )
        if processor is not None:
            processor.save_pretrained(out_dir)
        if tokenizer is not None:
            tokenizer.save_pretrained(out_dir)
        return tokenizer is not None
