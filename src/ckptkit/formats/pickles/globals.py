"""The globals torch's pickles name, and which of them the inert stand-ins model.

Example:
    >>> allowed_global("torch._utils", "_rebuild_tensor_v2"), allowed_global("os", "system")
    (True, False)
    >>> python3_name("__builtin__", "set", 2)
    ('builtins', 'set')
"""

from __future__ import annotations

import _compat_pickle
from collections import OrderedDict

from ..dtypes import BY_NAME, BY_STORAGE

TENSOR_BUILDERS = frozenset({"_rebuild_tensor_v2", "_rebuild_tensor_v3"})
PARAM_BUILDERS = frozenset({"_rebuild_parameter", "_rebuild_parameter_with_state"})
# Globals DeepSpeed's ZeRO pickles name beyond torch's (fp32 partitions with a ``ds_id`` attribute go
# through ``_rebuild_from_type_v2``). Only ``formats.deepspeed.files``' unpickler admits them, as the
# same inert records as every other stand-in: nothing is imported or run, and no other reader sees them.
DEEPSPEED_GLOBALS = frozenset(
    {
        ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
        ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),
        ("deepspeed.runtime.zero.config", "ZeroStageEnum"),
        ("deepspeed.utils.tensor_fragment", "fragment_address"),
        ("torch._tensor", "_rebuild_from_type_v2"),
        ("torch", "Tensor"),
    }
)
REAL_GLOBALS = {
    ("collections", "OrderedDict"): OrderedDict,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
}


def allowed_global(module: str, name: str) -> bool:
    """A torch name the stand-ins model: tensor and parameter builders, storages, dtypes, Size, device."""
    if module == "torch._utils":
        return name in TENSOR_BUILDERS or name in PARAM_BUILDERS
    if module == "torch":
        return name in BY_STORAGE or name in BY_NAME or name in ("Size", "device")
    if module == "torch.storage":
        return name == "UntypedStorage"
    return module == "_codecs" and name == "encode"  # protocol 2 spells bytes as _codecs.encode(str, "latin1")


def python3_name(module: str, name: str, protocol: int) -> tuple[str, str]:
    """A global as Python 3 resolves it: protocol 2 spells ``builtins.set`` as ``__builtin__.set``."""
    if protocol < 3:
        return _compat_pickle.NAME_MAPPING.get(
            (module, name), (_compat_pickle.IMPORT_MAPPING.get(module, module), name)
        )
    return module, name
