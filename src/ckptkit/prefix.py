"""Rename state-dict keys between wrapped and plain models, without touching a tensor.

Wrappers put a path segment in front of every key: ``module.`` (DataParallel and
DistributedDataParallel), ``_orig_mod.`` (torch.compile), in any nesting and also below the
root when only a submodule was wrapped (``encoder._orig_mod.layer.weight``). The functions here
return a new ``OrderedDict`` holding the same value objects in the same order, and carry
``state_dict._metadata`` (per-module versions that BatchNorm and others read when loading)
over to the renamed module paths. Finding which wrappers the keys carry (:func:`detect_prefixes`,
:class:`PrefixInfo`) lives in :mod:`ckptkit.model.wrappers`; this module is its public home.
Nothing here imports torch, so the CLI can rename keys in a checkpoint it never fully loads.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal

from .errors import ArgumentError, summarize
from .model.wrappers import WRAPPER_PREFIXES, PrefixInfo, canonical_key, check_prefix, detect_prefixes, wrapper_names

# The public key tools: the renaming below, and the detection it builds on (kept in _wrapperkeys).
__all__ = [
    "WRAPPER_PREFIXES",
    "PrefixInfo",
    "adapt_state_dict",
    "add_prefix",
    "parse_rules",
    "rename_keys",
    "canonical_key",
    "check_prefix",
    "detect_prefixes",
    "rewrite_prefixes",
    "strip_prefix",
    "wrapper_names",
]


def _rebuild(
    state_dict: Mapping[str, Any],
    rename_key: Callable[[str], str],
    rename_path: Callable[[str], str | None],
) -> OrderedDict[str, Any]:
    out: OrderedDict[str, Any] = OrderedDict()
    clashes: dict[str, list[str]] = {}
    for key, value in state_dict.items():
        new = rename_key(key)
        if new in out:
            clashes.setdefault(new, []).append(key)
        out[new] = value
    if clashes:
        sample = [f"{new} <- {', '.join(olds)}" for new, olds in clashes.items()]
        raise ArgumentError(
            f"renaming would merge {len(clashes)} keys into one name each ({summarize(sample, 3)}); "
            "the state dict holds both the wrapped and the plain name of the same parameter"
        )
    meta = getattr(state_dict, "_metadata", None)
    if meta is not None:
        new_meta: OrderedDict[str, Any] = OrderedDict()
        for path, value in meta.items():
            renamed = rename_path(path)
            if renamed is not None:
                new_meta[renamed] = value
        out._metadata = new_meta  # type: ignore[attr-defined]
    return out


def strip_prefix(state_dict: Mapping[str, Any], prefix: str = "module.") -> OrderedDict[str, Any]:
    """Remove ``prefix`` (ending in ``.``) from the start of every key that has it, into a new
    ordered dict with the same values and ``_metadata`` renamed to match.

    Unlike ``torch.nn.modules.utils.consume_prefix_in_state_dict_if_present`` it does not
    modify its input, and it keeps key order (pytorch/pytorch#106942).

    Example:
        >>> dict(strip_prefix({"module.fc.weight": 1, "module.fc.bias": 2}))
        {'fc.weight': 1, 'fc.bias': 2}
    """
    check_prefix(prefix)
    root = prefix[:-1]

    def path(p: str) -> str | None:
        if p == root:
            return ""
        if p and root.startswith(p + "."):
            return None  # an intermediate wrapper of a multi-segment prefix ("module" of "module._orig_mod.")
        return p[len(prefix) :] if p.startswith(prefix) else p

    return _rebuild(state_dict, lambda k: k[len(prefix) :] if k.startswith(prefix) else k, path)


def add_prefix(state_dict: Mapping[str, Any], prefix: str = "module.") -> OrderedDict[str, Any]:
    """Put ``prefix`` in front of every key, as wrapping the model in DDP/DataParallel would.

    Example:
        >>> dict(add_prefix({"fc.weight": 1}))
        {'module.fc.weight': 1}
    """
    check_prefix(prefix)
    root = prefix[:-1]
    out = _rebuild(state_dict, lambda k: prefix + k, lambda p: f"{root}.{p}" if p else root)
    meta = getattr(out, "_metadata", None)
    if meta is not None:
        # The new outer module is a wrapper; wrappers are plain nn.Module, version 1.
        meta[""] = {"version": 1}
        meta.move_to_end("", last=False)
    return out


def _target_keys(target: Any) -> tuple[list[str], dict[str, int] | None]:
    """Keys of a target, and for a live model its module paths (in order) with their versions."""
    if hasattr(target, "state_dict") and hasattr(target, "named_modules"):
        keys = list(target.state_dict().keys())
        modules = {name: getattr(m, "_version", 1) for name, m in target.named_modules(remove_duplicate=False)}
        return keys, modules
    if isinstance(target, Mapping):
        return list(target.keys()), None
    if isinstance(target, str):
        raise ArgumentError("target must be a model, a state dict or a collection of keys, not a string")
    return list(target), None


def _innermost(paths: Iterable[str], canon: Callable[[str], str]) -> dict[str, str]:
    inner: dict[str, str] = {}
    for p in sorted(paths, key=len):
        inner[canon(p)] = p
    return inner


def adapt_state_dict(
    state_dict: Mapping[str, Any],
    target: Any,
    *,
    wrappers: Iterable[str] = WRAPPER_PREFIXES,
) -> OrderedDict[str, Any]:
    """Rename keys so they match ``target``, adding or removing wrapper segments as needed.

    Two keys correspond when they are equal once every wrapper segment (``module``,
    ``_orig_mod`` by default) is dropped, so DDP -> plain, plain -> compiled(DDP),
    ``module._orig_mod.`` -> ``_orig_mod.module.`` and wrappers around submodules all work.
    Keys with no counterpart in ``target`` get the same change of leading wrappers as the rest
    (so a strict load reports them under names comparable with the target's).

    Args:
        state_dict: the state dict to rename.
        target: the model to load into (wrapped or not), its state dict, or its keys.
        wrappers: the wrapper prefixes to ignore when matching; add e.g. ``"model."`` for
            Lightning checkpoints.

    Returns:
        A new ordered dict in the source order, same values, ``_metadata`` renamed.

    Example:
        >>> dict(adapt_state_dict({"module._orig_mod.fc.weight": 0}, ["fc.weight"]))
        {'fc.weight': 0}
    """
    names = wrapper_names(wrappers)

    def canon(key: str) -> str:
        return canonical_key(key, names)

    keys, modules = _target_keys(target)
    by_canon: dict[str, str | None] = {}
    for key in keys:
        c = canon(key)
        # Two target keys with one canonical form (a real submodule named "module" beside its
        # sibling): only exact names can match those.
        by_canon[c] = None if c in by_canon and by_canon[c] != key else key
    exact = set(keys)
    wrapper_list = [n + "." for n in names]
    source_lead = detect_prefixes(state_dict, wrappers=wrapper_list).prefix
    target_lead = detect_prefixes(keys, wrappers=wrapper_list).prefix

    def rename_key(key: str) -> str:
        if key in exact:
            return key
        found = by_canon.get(canon(key))
        if found is not None:
            return found
        return target_lead + key[len(source_lead) :] if key.startswith(source_lead) else key

    if modules is None:
        modules = {"": 1}
        for key in keys:
            parts = key.split(".")
            modules.update((".".join(parts[:i]), 1) for i in range(1, len(parts)))
    module_paths = set(modules)
    # Paths with one canonical form are a chain of wrappers around one real module ("",
    # "module", "module._orig_mod"); the real module is the innermost, i.e. the longest path.
    target_inner = _innermost(module_paths, canon)
    source_inner = _innermost(getattr(state_dict, "_metadata", None) or (), canon)

    def rename_path(p: str) -> str | None:
        c = canon(p)
        if source_inner.get(c) == p:
            return target_inner.get(c, p)
        # A wrapper's own entry: keep it only where the target has that same wrapper.
        return p if p in module_paths and target_inner.get(c) != p else None

    out = _rebuild(state_dict, rename_key, rename_path)
    meta = getattr(out, "_metadata", None)
    if meta is not None:
        # Wrappers the source lacked get their entries, and entries follow the target's order.
        order = {p: i for i, p in enumerate(modules)}
        for p in modules:
            if target_inner.get(canon(p)) != p and p not in meta:
                meta[p] = {"version": modules[p]}
        out._metadata = OrderedDict(sorted(meta.items(), key=lambda kv: order.get(kv[0], len(order))))  # type: ignore[attr-defined]
    return out


def rewrite_prefixes(
    state_dict: Mapping[str, Any],
    *,
    to: Literal["single", "ddp", "keep"] = "single",
    strip: Iterable[str] = (),
    add: Iterable[str] = (),
) -> OrderedDict[str, Any]:
    """Rename keys the way ``ckptkit convert`` does, without a target model.

    ``to="single"`` removes the leading chain of wrapper prefixes (``module.``, ``_orig_mod.``,
    in any nesting) and every ``_orig_mod.`` segment deeper in the keys (torch.compile of a
    submodule). A ``module.`` segment deeper in the keys is left alone: a real submodule may be
    called ``module``. ``to="ddp"`` does the same and then adds ``module.``; ``to="keep"``
    leaves wrappers alone. Then every ``strip`` prefix is removed and every ``add`` prefix
    added, in order.

    Example:
        >>> list(rewrite_prefixes({"_orig_mod.module.enc._orig_mod.w": 0}, to="ddp"))
        ['module.enc.w']
    """
    if to not in ("single", "ddp", "keep"):
        raise ArgumentError(f"to must be 'single', 'ddp' or 'keep', not {to!r}")
    out: Mapping[str, Any] = state_dict
    if to != "keep":
        for prefix in detect_prefixes(out).leading:
            out = strip_prefix(out, prefix)
        if any("_orig_mod" in k.split(".") for k in out):
            target = [".".join(p for p in k.split(".") if p != "_orig_mod") for k in out]
            out = adapt_state_dict(out, target, wrappers=("_orig_mod.",))
    for prefix in strip:
        out = strip_prefix(out, prefix)
    if to == "ddp":
        out = add_prefix(out, "module.")
    for prefix in add:
        out = add_prefix(out, prefix)
    return out if isinstance(out, OrderedDict) and out is not state_dict else _rebuild(out, lambda k: k, lambda p: p)


Rule = tuple["re.Pattern[str]", str]


def parse_rules(rules: Iterable[str]) -> list[Rule]:
    r"""``REGEX=REPL`` rename rules, compiled. Each splits at its last ``=`` (a regex may hold one, in
    a lookbehind); ``REPL`` is :func:`re.sub`'s (``\1`` for a group).

    Raises:
        ArgumentError: a rule without ``=``, or whose regex does not compile.

    Example:
        >>> pattern, repl = parse_rules(["^tok_embeddings=model.embed_tokens"])[0]
        >>> pattern.sub(repl, "tok_embeddings.weight")
        'model.embed_tokens.weight'
    """
    out: list[Rule] = []
    for rule in rules:
        pattern, eq, repl = rule.rpartition("=")
        if not eq or not pattern:
            raise ArgumentError(
                f"rename rule '{rule}' is not REGEX=REPL, e.g. '^tok_embeddings\\.=model.embed_tokens.'"
            )
        try:
            out.append((re.compile(pattern), repl))
        except re.error as e:
            raise ArgumentError(f"rename rule '{rule}': '{pattern}' is not a regular expression ({e})") from None
    return out


def rename_keys(state_dict: Mapping[str, Any], rules: Sequence[Rule]) -> tuple[OrderedDict[str, Any], list[str]]:
    """Every key through each rule in order (:func:`re.sub`), values and order kept; and the rules
    (as ``REGEX=REPL``) that matched no key.

    Raises:
        ArgumentError: two keys renamed to one name (naming both), or a replacement that refers to
            a group its regex lacks.

    Example:
        >>> out, unused = rename_keys({"layers.0.wq": 1, "norm": 2}, parse_rules(["^layers=model.layers"]))
        >>> list(out), unused
        (['model.layers.0.wq', 'norm'], [])
    """
    out: OrderedDict[str, Any] = OrderedDict()
    used: set[int] = set()
    came: dict[str, str] = {}
    for key, value in state_dict.items():
        name = key
        for i, (pattern, repl) in enumerate(rules):
            try:
                name, n = pattern.subn(repl, name)
            except (re.error, IndexError) as e:
                raise ArgumentError(f"rename rule '{pattern.pattern}={repl}': {e}") from None
            used.update([i] if n else [])
        if name in came:
            raise ArgumentError(
                f"rename rules give {came[name]!r} and {key!r} the same name {name!r}; make the rules tell them apart"
            )
        came[name] = key
        out[name] = value
    return out, [f"{p.pattern}={r}" for i, (p, r) in enumerate(rules) if i not in used]
