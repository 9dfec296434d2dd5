"""Which framework wrote a checkpoint, from the names of its entries alone, and where it keeps the
weights and any EMA (or otherwise averaged) copy of them.

Each framework saves a dict of its own shape: timm's ``CheckpointSaver`` ``{epoch, arch,
state_dict, state_dict_ema, optimizer, version, args}``, mmengine's ``Runner`` ``{meta, state_dict,
message_hub, optimizer, ema_state_dict}``, Lightning's ``{pytorch-lightning_version, state_dict,
callbacks, optimizer_states, lr_schedulers, loops}``, pytorch-ignite's ``Checkpoint`` the names the
user gave plus an Engine's ``{epoch_length, max_epochs, iteration}``, torch's ``AveragedModel``
its weights under ``module.`` beside ``n_averaged``, a DeepSpeed model-states file ``{module,
param_shapes, ds_version}``. The rules read names and scalars only (torch-free; the caller says
what a tensor is), so they serve the inert reader's stand-ins as well as loaded tensors.

Example:
    >>> p = recognise({"state_dict": {"w": 1}, "state_dict_ema": {"w": 2}, "arch": "resnet50", "epoch": 3},
    ...               is_tensor=lambda v: isinstance(v, int))
    >>> p.name, p.weights, p.ema
    ('timm', 'state_dict', 'state_dict_ema')
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

IsTensor = Callable[[Any], bool]
AVERAGED_COUNT = "n_averaged"  # torch.optim.swa_utils.AveragedModel's buffer beside its module.* weights
# The counts averaging wrappers keep beside their module.* weights, which no plain model has.
AVERAGED_COUNTS = {AVERAGED_COUNT: "AveragedModel's count of averaged models", "steps": "mmengine's EMA step count"}
_EMA_NAME = re.compile(r"(^|[_.\-])(ema|swa|averaged?)([_.\-]|$)|_ema\d*$|^ema", re.IGNORECASE)
_ENGINE_KEYS = frozenset({"epoch_length", "max_epochs"})  # ignite.engine.Engine.state_dict()


@dataclass
class Producer:
    """What wrote a checkpoint (``name``: ``"timm"``, ``"mmengine"``, ``"lightning"``, ``"ignite"``,
    ``"averaged-model"``, ``"deepspeed"``, ``"hf-trainer"``, ``"accelerate"``, ``"hf-pretrained"``),
    in words (``what``), where the weights (``weights``) and an EMA copy (``ema``) are as
    ``--key`` spells them, ``notes`` worth knowing, and for a folder its ``files``
    (``{"name", "holds"}``)."""

    name: str
    what: str
    weights: str | None = None
    ema: str | None = None
    notes: list[str] = field(default_factory=list)
    files: list[dict[str, str]] = field(default_factory=list)


def is_state_dict(value: Any, is_tensor: IsTensor) -> bool:
    """A non-empty mapping of names to tensors (``*_extra_state`` entries may be anything)."""
    return (
        isinstance(value, Mapping)
        and bool(value)
        and any(is_tensor(v) for v in value.values())
        and all(isinstance(k, str) and (is_tensor(v) or k.endswith("_extra_state")) for k, v in value.items())
    )


def is_averaged(state: Any, is_tensor: IsTensor) -> bool:
    """An ``AveragedModel``'s state dict: ``n_averaged`` beside weights all under ``module.``.

    Example:
        >>> is_averaged({"module.w": 1, "n_averaged": 2}, lambda v: isinstance(v, int))
        True
    """
    if not is_state_dict(state, is_tensor) or AVERAGED_COUNT not in state or len(state) < 2:
        return False
    return all(k.startswith("module.") for k in state if k != AVERAGED_COUNT)


def averaged_count(state: Mapping[str, Any]) -> str | None:
    """The count key of an averaging wrapper's state dict (``n_averaged``, or mmengine's ``steps``)
    beside weights all under ``module.``; None for any other state dict.

    Example:
        >>> averaged_count({"module.w": 1, "steps": 2}), averaged_count({"w": 1, "steps": 2})
        ('steps', None)
    """
    if len(state) < 2:
        return None
    for key in AVERAGED_COUNTS:
        if key in state and all(isinstance(k, str) and k.startswith("module.") for k in state if k != key):
            return key
    return None


def is_ema_name(name: str) -> bool:
    """An entry name that says EMA / SWA / averaged weights: ``state_dict_ema``, ``model_ema``, ``swa_model``.

    Example:
        >>> is_ema_name("state_dict_ema"), is_ema_name("schema")
        (True, False)
    """
    return bool(_EMA_NAME.search(name))


def ema_entries(obj: Mapping[str, Any], is_tensor: IsTensor, *, skip: str | None = None) -> list[str]:
    """Top-level entries holding an EMA / SWA / averaged copy of the weights, by name or by
    ``AveragedModel``'s shape (``skip``: the weights' own entry).

    Example:
        >>> ema_entries({"model": {"w": 1}, "model_ema": {"w": 2}}, lambda v: isinstance(v, int))
        ['model_ema']
    """
    return [
        str(k)
        for k, v in obj.items()
        if str(k) != skip and is_state_dict(v, is_tensor) and (is_ema_name(str(k)) or is_averaged(v, is_tensor))
    ]


def _scalar(obj: Mapping[str, Any], *keys: str) -> str:
    """``key=value`` for the keys ``obj`` holds as plain scalars (an epoch, a step, a version)."""
    return ", ".join(
        f"{k}={obj[k]}" for k in keys if isinstance(obj.get(k), (int, float, str)) and not isinstance(obj.get(k), bool)
    )


def _with(text: str, details: str) -> str:
    return f"{text}, {details}" if details else text


def recognise(obj: Any, *, is_tensor: IsTensor) -> Producer | None:
    """The :class:`Producer` of a checkpoint object by its entries' names, or None where no rule fits.

    The weights a rule names are those the framework's own loader takes: mmengine's EMAHook and
    Lightning's WeightAveraging put the averaged weights in ``state_dict`` for deployment, and
    their notes say where the trained ones are.
    """
    if not isinstance(obj, Mapping):
        return None
    if (adapter := _peft(obj, is_tensor)) is not None:
        return adapter
    if is_averaged(obj, is_tensor):
        return Producer(
            "averaged-model",
            "torch.optim.swa_utils.AveragedModel state dict (SWA/EMA)",
            weights="",
            notes=[
                f"{AVERAGED_COUNT} is the count of models averaged, not a weight; convert leaves it out "
                "and removes module."
            ],
        )
    if "pytorch-lightning_version" in obj:
        return _lightning(obj, is_tensor)
    if "meta" in obj and "state_dict" in obj and ("message_hub" in obj or isinstance(obj.get("meta"), Mapping)):
        return _mmengine(obj, is_tensor)
    if "state_dict" in obj and "arch" in obj:
        ema = next((k for k in ("state_dict_ema", "state_dict_ema2") if is_state_dict(obj.get(k), is_tensor)), None)
        what = _with("timm CheckpointSaver checkpoint", _scalar(obj, "arch", "epoch", "metric"))
        notes = (
            ["args is timm train.py's argparse.Namespace: give --allow-global argparse.Namespace to read it"]
            if "args" in obj
            else []
        )
        return Producer("timm", what, weights="state_dict", ema=ema, notes=notes)
    if "ds_version" in obj or ("param_shapes" in obj and "module" in obj):
        return Producer(
            "deepspeed",
            _with("DeepSpeed model-states file", _scalar(obj, "ds_version", "global_steps")),
            weights="module",
            notes=[
                "under ZeRO the fp32 master weights are in the *_optim_states.pt files: give the checkpoint folder "
                "for those"
            ],
        )
    if _TORCHTITAN <= set(obj) and any(is_tensor(v) for v in obj.values()):
        return Producer(
            "torchtitan",
            "torchtitan CheckpointManager checkpoint",
            weights=".",
            notes=[
                "torchtitan flattens the model's weights into the top level, beside "
                f"{', '.join(sorted(_TORCHTITAN))}: --key . selects them (the default here); the optimizer's state "
                "is at 'optimizer', keyed by parameter name"
            ],
        )
    engines = [
        str(k)
        for k, v in obj.items()
        if isinstance(v, Mapping) and _ENGINE_KEYS <= set(v) and ("iteration" in v or "epoch" in v)
    ]
    if engines:
        state = obj[engines[0]]
        what = _with(
            f"pytorch-ignite Checkpoint (Engine state at {engines[0]!r})", _scalar(state, "epoch", "iteration")
        )
        return Producer("ignite", what, ema=_first(ema_entries(obj, is_tensor)))
    return None


# What torchtitan's CheckpointManager saves beside the model's flattened weights (and "dataloader").
_TORCHTITAN = frozenset({"optimizer", "lr_scheduler", "train_state"})


# A LoRA weight as PEFT names it: <module>.lora_A.weight in a saved adapter, <module>.lora_A.<adapter>.weight
# in a PeftModel's own state dict (beside <module>.base_layer.weight).
LORA = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>A|B)(?:\.(?P<adapter>[^.]+))?\.weight$")


def _peft(obj: Mapping[Any, Any], is_tensor: IsTensor) -> Producer | None:
    """A PEFT LoRA adapter (or a PeftModel's whole state dict), named by its LoRA tensors."""
    ranks: set[int] = set()
    modules: set[str] = set()
    for k, v in obj.items():
        if isinstance(k, str) and is_tensor(v) and (m := LORA.match(k)):
            modules.add(m["module"])
            shape: tuple[int, ...] = tuple(getattr(v, "shape", ()))
            if m["ab"] == "A" and len(shape) == 2:
                ranks.add(int(shape[0]))
    if not modules:
        return None
    targets = ", ".join(sorted({m.rsplit(".", 1)[-1] for m in modules}))
    rank = f"rank {', '.join(map(str, sorted(ranks)))}" if ranks else "rank unknown"
    if any(isinstance(k, str) and ".base_layer." in k for k in obj):
        return Producer(
            "peft-model",
            f"PEFT model state dict (LoRA {rank} on {targets}, {len(modules)} modules, beside the base weights)",
            weights="",
            notes=[
                "a PeftModel's own state dict: the base weights are under base_layer and the adapter's are named "
                "lora_A.<adapter>, names no plain model has; PeftModel loads it, and merge_and_unload() gives plain "
                "weights"
            ],
        )
    return Producer(
        "peft",
        f"PEFT LoRA adapter ({rank} on {targets}, {len(modules)} modules)",
        weights="",
        notes=[
            "an adapter, not a model's weights: PEFT applies it to its base model (PeftModel.from_pretrained), whose "
            "base_model.model. prefix its names keep; merged into the base (merge_and_unload), it gives plain weights"
        ],
    )


def _first(names: list[str]) -> str | None:
    return names[0] if names else None


def _lightning(obj: Mapping[str, Any], is_tensor: IsTensor) -> Producer:
    what = _with("Lightning checkpoint", _scalar(obj, "pytorch-lightning_version", "epoch", "global_step"))
    notes: list[str] = []
    ema = None
    if is_state_dict(obj.get("current_model_state"), is_tensor):  # lightning.pytorch.callbacks.WeightAveraging
        ema = "state_dict"
        notes.append(
            "the WeightAveraging callback put the averaged weights in state_dict (what Lightning loads) and the "
            "current ones in current_model_state: --key current_model_state takes those"
        )
    callbacks = obj.get("callbacks")
    if isinstance(callbacks, Mapping) and any("StochasticWeightAveraging" in str(k) for k in callbacks):
        notes.append("the StochasticWeightAveraging callback's state is in callbacks")
    return Producer("lightning", what, weights="state_dict", ema=ema, notes=notes)


def _mmengine(obj: Mapping[str, Any], is_tensor: IsTensor) -> Producer:
    meta = obj.get("meta")
    what = _with(
        "mmengine Runner checkpoint",
        _scalar(meta, "epoch", "iter", "mmengine_version") if isinstance(meta, Mapping) else "",
    )
    notes: list[str] = []
    ema = None
    if is_state_dict(obj.get("ema_state_dict"), is_tensor):  # mmengine.hooks.EMAHook.before_save_checkpoint swaps them
        ema = "state_dict"
        notes.append(
            "EMAHook swapped the EMA weights into state_dict (what mmengine loads) and the trained ones into "
            "ema_state_dict, under module. beside its step count: --key ema_state_dict takes those"
        )
    return Producer("mmengine", what, weights="state_dict", ema=ema, notes=notes)


def generic_ema(obj: Any, weights_at: str | None, is_tensor: IsTensor) -> str | None:
    """An EMA copy beside the weights of a checkpoint no rule recognises (``{model, model_ema}``)."""
    if not isinstance(obj, Mapping) or not weights_at:
        return None
    return _first(ema_entries(obj, is_tensor, skip=weights_at.split("/")[0]))
