"""The model a step's huggingface/config.json describes, built on the meta device (no memory): the
parameters in the order an optimizer over `module.parameters()` numbers them, the persistent
buffers (plain tensors in verl's files), and FSDP1's flat parameters as verl wraps them (one per
decoder layer, from the model's `_no_split_modules`, and the root's for the rest, first).
"""

# lazy imports: torch and transformers only when a model's layout is built on the meta device
from __future__ import annotations

from dataclasses import dataclass

from slimckpt.log import get_logger

log = get_logger("slimckpt.convert")


@dataclass
class ModelLayout:
    params: list[tuple[str, tuple[int, ...]]]  # named_parameters order, a tied parameter once
    shapes: dict[str, tuple[int, ...]]  # every state-dict entry (tied names included)
    buffers: set[str]
    units: list[list[str]]  # FSDP1 flat parameters, in the optimizer's order

    def numel(self, fqn: str) -> int:
        n = 1
        for d in self.shapes[fqn]:
            n *= d
        return n


def meta_layout(hf_dir: str, names: set[str] | None = None) -> ModelLayout | None:
    """The layout of the model class whose state dict has exactly `names` (a causal LM, or a
    critic's token-classification head with one label, as verl builds them); None where no such
    model can be built from the config (custom code): then only the files' own shapes are checked."""
    try:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

        config = AutoConfig.from_pretrained(hf_dir)
    except Exception as exc:  # noqa: BLE001 - checked against the files' own shapes only
        log.info("convert: no model config in %s (%s)", hf_dir, exc)
        return None
    first = None
    for auto, kwargs in ((AutoModelForCausalLM, {}), (AutoModelForTokenClassification, {"num_labels": 1})):
        try:
            if kwargs:
                config.num_labels = kwargs["num_labels"]
            with torch.device("meta"):
                model = auto.from_config(config)
        except Exception as exc:  # noqa: BLE001 - this class does not fit the config
            log.info("convert: %s cannot build %s (%s)", auto.__name__, hf_dir, exc)
            continue
        layout = _layout(model)
        if names is None or set(layout.shapes) == set(names):
            return layout
        first = first or layout
    return None if names is not None else first


def _layout(model) -> ModelLayout:
    params = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    shapes = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    buffers = set(shapes) - {n for n, _ in model.named_parameters(remove_duplicate=False)}
    return ModelLayout(params, shapes, buffers, _fsdp1_units(model))


def _fsdp1_units(model) -> list[list[str]]:
    """transformer_auto_wrap_policy over the `_no_split_modules` classes, as verl's default
    wrap policy: each such module (outermost) is a flat parameter of its own parameters; the root's
    holds the rest and comes first in `parameters()`. Inside one, parameters in module order, a
    shared one once (FlatParamHandle's order)."""
    classes = set(getattr(model, "_no_split_modules", None) or [])
    wrapped: list[tuple[str, object]] = []
    for name, module in model.named_modules():
        if type(module).__name__ in classes and not any(name.startswith(w + ".") for w, _ in wrapped):
            wrapped.append((name, module))
    seen: set[int] = set()
    units: list[list[str]] = []
    for prefix, module in wrapped:
        unit = []
        for n, p in module.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                unit.append(f"{prefix}.{n}")
        units.append(unit)
    root = []
    for n, p in model.named_parameters():
        if id(p) not in seen:
            seen.add(id(p))
            root.append(n)
    return [root, *units] if root else units
