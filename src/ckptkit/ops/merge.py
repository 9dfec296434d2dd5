"""``convert --merge-adapter``: a PEFT LoRA adapter merged into its base's weights, one at a time.

What PEFT's ``merge_and_unload()`` computes, without the model: for each adapted ``Linear``,
``W += scaling · B @ A`` (transposed where ``fan_in_fan_out``), ``scaling = lora_alpha / r``, or
``lora_alpha / √r`` with ``use_rslora``, ``r`` and ``lora_alpha`` per module where
``rank_pattern`` / ``alpha_pattern`` name it. The arithmetic is PEFT's own, in its order and its
dtypes (the adapter as ``PeftModel.from_pretrained`` holds it: float32 beside a float16 or
bfloat16 base, the base's dtype otherwise), so a merge on the CPU gives PEFT's values bit for bit.

Only the weight being merged is in memory, with its delta: a base of any size merges in the
memory of its largest adapted weight. The adapter is checked against the base first
(:func:`~ckptkit.ops.adapter.read_adapter`, as ``ckptkit check-adapter``), and an adapter that
would not apply, or that holds what this merge does not compute (DoRA, LoRA biases, embedding or
convolution adapters, ``modules_to_save``), is refused before anything is written.

Example:
    >>> merge = Merge.read("lora/", "base/")  # doctest: +SKIP
    >>> merge.modules  # doctest: +SKIP
    ['model.layers.0.self_attn.q_proj.weight', ...]
"""

from __future__ import annotations

import functools
import io
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from ..errors import ArgumentError, CheckpointFormatError, StateDictMismatchError, UnsupportedCheckpointError, summarize
from ..formats.entry import Bytes, Entry
from ..formats.pickles.safety import AllowGlobals
from ..io.fileio import Progress, crc32, small_json
from ..prefix import rewrite_prefixes
from .adapter import CONFIG, lora_key, per_module, read_adapter

FLOATS = ("float16", "bfloat16", "float32", "float64")
# What PEFT computes otherwise than W + scaling * B @ A (its LoRA variants, LoRA biases), by the
# adapter_config.json key that asks for it: refused, naming it.
_UNSUPPORTED = {
    "use_dora": "DoRA",
    "lora_bias": "LoRA biases",
    "velora_config": "VeLoRA",
    "alora_invocation_tokens": "aLoRA",
    "monteclora_config": "MonteCLoRA",
    "use_bdlora": "BD-LoRA",
    "arrow_config": "Arrow",
    "kasa_config": "KaSA",
}
# transformers' models whose layers are Conv1D (weights stored [in, out]): PEFT merges their
# adapters transposed whatever fan_in_fan_out says, and a Linear's never.
_CONV1D_MODELS = frozenset({"gpt2", "openai-gpt", "imagegpt", "decision_transformer"})


@dataclass
class Lora:
    """One adapted weight's factors, as PEFT holds them once loaded, and its scaling."""

    a: Any  # torch.Tensor [r, in]
    b: Any  # torch.Tensor [out, r]
    scaling: float
    fan_in_fan_out: bool

    def merge_into(self, weight: Any) -> None:
        """``weight += scaling · B @ A``, in place, as PEFT's ``Linear.merge`` computes it."""
        import torch

        ldtype = torch.float32 if weight.dtype in (torch.float16, torch.bfloat16) else weight.dtype
        a, b = self.a.to(ldtype), self.b.to(ldtype)  # PeftModel.from_pretrained's adapter dtype
        delta = b @ a
        delta.mul_(self.scaling)  # PEFT's out-of-place ``* scaling``: the same products
        weight += delta.T if self.fan_in_fan_out else delta


@dataclass
class Merge:
    """A checked adapter, ready to merge: each adapted base weight (by its single-device name) and
    its factors; :attr:`merged` fills as the weights are written."""

    adapter: str
    loras: dict[str, Lora]
    merged: list[str] = field(default_factory=list)

    @property
    def modules(self) -> list[str]:
        return list(self.loras)

    @classmethod
    def read(
        cls,
        adapter: str | os.PathLike[str],
        base: str | os.PathLike[str],
        *,
        trust: bool = False,
        allow_globals: AllowGlobals = (),
    ) -> Merge:
        """The adapter at ``adapter``, checked against ``base`` as ``check-adapter`` checks it.

        Raises:
            StateDictMismatchError: the adapter would not apply to ``base`` as it is (keys naming no
                base module, shapes that do not fit, modules left without an adapter, every
                ``lora_B`` zero): what ``ckptkit check-adapter`` reports.
            UnsupportedCheckpointError: the adapter holds what this merge does not compute.
            ArgumentError: no ``adapter_config.json`` beside it (its ``lora_alpha`` and ``r`` are needed).
        """
        if "://" in os.fspath(adapter):
            raise ArgumentError(
                f"{os.fspath(adapter)}: the adapter to merge is read from a local folder; copy it there first "
                "(e.g. `aws s3 cp --recursive`)"
            )
        found = read_adapter(adapter, base, trust=trust, allow_globals=allow_globals)
        report, config = found.report, found.config
        if not report.ok:
            problems = [
                f"{len(report.unmatched)} key(s) naming no base module ({summarize(report.unmatched, 2)})"
                * bool(report.unmatched),
                f"shapes that do not fit ({summarize(report.shapes, 2)})" * bool(report.shapes),
                f"target modules without an adapter ({summarize(report.untargeted, 2)})" * bool(report.untargeted),
                f"{len(report.zero_b)} all-zero lora_B" * bool(report.zero_b),
            ]
            fix = f"; {report.fix} makes the keys match" if report.fix else ""
            raise StateDictMismatchError(
                f"{adapter} does not apply to {base} as PEFT would load it: {'; '.join(p for p in problems if p)}"
                f"{fix}; `ckptkit check-adapter {adapter} {base}` shows the whole report. Nothing was written",
                unexpected=report.unmatched,
            )
        if not config:
            raise ArgumentError(
                f"{adapter}: no {CONFIG} beside the adapter; a merge needs its r and lora_alpha: put the "
                f"{CONFIG} PEFT saved with it in the adapter's folder"
            )
        init = config.get("init_lora_weights")
        asked = [f"{k} ({what})" for k, what in _UNSUPPORTED.items() if config.get(k)]
        asked += [f"init_lora_weights={init!r} (MiCA)"] if isinstance(init, str) and init.startswith("mica") else []
        if asked:
            raise UnsupportedCheckpointError(
                f"{adapter}: {CONFIG} sets {', '.join(asked)}, which ckptkit does not merge; merge it with PEFT's "
                "merge_and_unload()"
            )
        others = [k for k in found.tensors if lora_key(k) is None]
        if others:
            raise UnsupportedCheckpointError(
                f"{adapter} holds {len(others)} tensor(s) besides LoRA's lora_A/lora_B weights ({summarize(others, 2)}: "
                "modules_to_save, embedding adapters, ...), which ckptkit does not merge; merge it with PEFT's "
                "merge_and_unload()"
            )
        factors: dict[str, dict[str, Any]] = {}
        for key, tensor in found.tensors.items():
            m = lora_key(key)
            weight = found.base_key(key)
            assert m is not None and weight is not None  # report.ok: every key names a base weight
            factors.setdefault(weight, {})[m["ab"]] = tensor
        flat = [
            f"{w} {found.base_shapes[w]}" for w, ab in factors.items()
            if len(found.base_shapes[w]) != 2 or any(t.dim() != 2 for t in ab.values())
        ]  # fmt: skip
        if flat:
            raise UnsupportedCheckpointError(
                f"{adapter} adapts {len(flat)} weight(s) that are not 2-D or with factors that are not "
                f"({summarize(flat, 2)}): only Linear and Conv1D adapters are merged; merge it with PEFT's merge_and_unload()"
            )
        if halves := [f"{w} (lora_{''.join(ab)} only)" for w, ab in factors.items() if set(ab) != {"A", "B"}]:
            raise StateDictMismatchError(
                f"{adapter}: {len(halves)} weight(s) with one LoRA factor and not its other half "
                f"({summarize(halves, 2)}); nothing was written"
            )
        model_type = _model_type(base)
        loras = {}
        for weight, ab in factors.items():
            module = weight.removesuffix(".weight")
            transposed = _conv1d(weight, found.base_shapes[weight], ab["A"], ab["B"], model_type, config)
            loras[weight] = Lora(ab["A"], ab["B"], _scaling(config, module), transposed)
        return cls(str(adapter), loras)

    def targets(self, names: list[str]) -> dict[str, Lora]:
        """Which of ``names`` (the base's weights as its checkpoint spells them) each adapter
        merges into; every adapted weight must be among them.

        Raises:
            StateDictMismatchError: an adapted weight is not among ``names`` (a ``key=`` that
                selected other weights).
        """
        singles = list(rewrite_prefixes(dict.fromkeys(names), to="single"))
        out = {name: self.loras[s] for name, s in zip(names, singles, strict=True) if s in self.loras}
        if missing := sorted(set(self.loras) - {s for s in singles if s in self.loras}):
            raise StateDictMismatchError(
                f"{self.adapter} adapts {len(missing)} weight(s) not among those being written "
                f"({summarize(missing, 2)}); select the base model's weights (key=) it was trained on",
                missing=missing,
            )
        return out

    def notes(self) -> list[str]:
        scalings = sorted({lo.scaling for lo in self.loras.values()})
        say = ", ".join(f"{s:g}" for s in scalings)
        return [f"merged {self.adapter} into {len(self.merged)} weight(s) (W + scaling · B @ A, scaling {say})"]


def _model_type(base: str | os.PathLike[str]) -> str | None:
    """The base's ``model_type``, from the ``config.json`` beside its weights (None: no such file)."""
    folder = Path(base) if Path(base).is_dir() else Path(base).parent
    found = small_json(folder / "config.json", limit=1_000_000)
    kind = found.get("model_type") if isinstance(found, dict) else None
    return kind if isinstance(kind, str) else None


def _conv1d(weight: str, shape: list[int], a: Any, b: Any, model_type: str | None, config: Mapping[str, Any]) -> bool:
    """Whether the base weight is stored [in, out] (a Conv1D, merged transposed), as PEFT decides it:
    by the module's type, which the shapes give unless the weight is square; then by the base
    model's type, else by ``fan_in_fan_out`` as the adapter's config says."""
    linear = a.shape[1] == shape[1] and b.shape[0] == shape[0]
    conv1d = a.shape[1] == shape[0] and b.shape[0] == shape[1]
    if not (linear or conv1d):  # each factor fits the weight one way, not both the same way
        raise StateDictMismatchError(
            f"{weight}: lora_A {list(a.shape)} and lora_B {list(b.shape)} do not make a delta of its shape {shape}"
        )
    if linear != conv1d:
        return conv1d
    if model_type is not None:
        return model_type in _CONV1D_MODELS
    return config.get("fan_in_fan_out") is True


def _scaling(config: Mapping[str, Any], module: str) -> float:
    """PEFT's ``scaling`` of ``module``."""
    r = per_module(config, "rank_pattern", "r", module)
    alpha = per_module(config, "alpha_pattern", "lora_alpha", module)
    if not isinstance(r, int) or isinstance(r, bool) or r <= 0 or not isinstance(alpha, (int, float)):
        raise ArgumentError(
            f"{CONFIG}: r={r!r} and lora_alpha={alpha!r} for {module}; expected a positive int and a number"
        )
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def merged_entry(src: Entry, lora: Lora) -> Bytes:
    """``src`` with a LoRA merged in: same dtype, shape and size, its bytes read whole (checked as
    any copy checks them), merged in place and written. They exist only once written, so no CRC-32
    is known before; its ident is its own (a tie to ``src`` is not one to the merged weight)."""
    return Bytes(
        src.dtype, src.shape, src.nbytes, functools.partial(_write_merged, src, lora), ident=("merged", src.ident)
    )


def _write_merged(src: Entry, lora: Lora, f: BinaryIO, progress: Progress | None) -> int:
    import torch

    buf = _Buffer(src.nbytes)
    src.write(buf, progress)  # type: ignore[arg-type] # a file-like sink
    if buf.at != len(buf.data):
        raise CheckpointFormatError(f"internal error: {buf.at} of {len(buf.data)} bytes read to merge")
    if buf.data:
        weight = torch.frombuffer(buf.data, dtype=getattr(torch, src.dtype)).view(src.shape)
        lora.merge_into(weight)  # in place, into buf
    f.write(buf.data)
    return crc32(buf.data)


class _Buffer:
    """What a source entry writes its bytes into: one tensor's memory, filled in order."""

    def __init__(self, n: int) -> None:
        self.data, self.at = bytearray(n), 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.data[self.at : self.at + len(view)] = view
        self.at += len(view)
        return len(view)

    def flush(self) -> None:
        """Nothing to flush: the bytes are in memory."""

    def fileno(self) -> int:
        raise io.UnsupportedOperation("a merge's buffer has no file descriptor")


def _refuse(name: str, dtype: str, merge: Merge) -> None:
    if dtype not in FLOATS:
        raise UnsupportedCheckpointError(
            f"{name} is {dtype}: ckptkit merges adapters into float16, bfloat16, float32 and float64 weights only, "
            f"not quantized ones; merge {merge.adapter} with PEFT into a dequantized base"
        )


def fast_merge(view: Any, merge: Merge) -> Callable[[Mapping[str, Any]], dict[str, Any]]:
    """The weights with each one the adapter adapts wrapped to be merged as it is written
    (:func:`merged_entry`), the rest as they are."""

    def run(state: Mapping[str, Any]) -> dict[str, Any]:
        targets = merge.targets(list(state))
        out = dict(state)
        for name, lora in targets.items():
            e = view.entry(state[name], name) if view.is_leaf(state[name]) else state[name]
            _refuse(name, e.dtype, merge)
            out[name] = merged_entry(e, lora)
            merge.merged.append(name)
        return out

    return run


def merge_tensors(state: Mapping[str, Any], merge: Merge) -> dict[str, Any]:
    """``state`` (torch tensors) with the adapter merged into each weight it adapts, each a new
    tensor (the loaded ones are left as they are)."""
    targets = merge.targets(list(state))
    out = dict(state)
    for name, lora in targets.items():
        weight = state[name].detach().clone()
        _refuse(name, str(weight.dtype).removeprefix("torch."), merge)
        lora.merge_into(weight)
        out[name] = weight
        merge.merged.append(name)
    return out
