"""A torchtitan Llama's weights as transformers' ``LlamaForCausalLM`` names and lays them out.

Renaming is not enough. torchtitan (as Meta's original Llama) applies rotary embeddings to
interleaved pairs of each head's dims; transformers rotates its two halves. HF's conversion
script, and torchtitan's own ``Llama3StateDictAdapter.to_hf``, therefore permute the rows of
``wq`` and ``wk`` within each head: ``w.view(heads, rows // heads // 2, 2, cols).transpose(1,
2).reshape(rows, cols)``. A checkpoint renamed without it loads into transformers and generates
nonsense. :func:`rope_rows` is that permutation as a row order; :class:`PermutedRows` writes
a tensor's rows in that order one head at a time (torch-free, as the source's bytes arrive, each
checked by the source), and :func:`permute_tensor` applies it to a torch tensor.

The heads come from the model's Hugging Face ``config.json`` (``num_attention_heads``,
``num_key_value_heads``, ``tie_word_embeddings``), which the weights' shapes cannot tell.

Example:
    >>> rope_rows(8, 2)  # two heads of four rows: pairs (0, 1), (2, 3) become halves
    [0, 2, 1, 3, 4, 6, 5, 7]
    >>> hf_name("layers.3.attention.qkv_linear.wq.weight")
    ('model.layers.3.self_attn.q_proj.weight', 'q')
"""

from __future__ import annotations

import io
import json
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from ..errors import ArgumentError, CheckpointFormatError, CheckpointNotFoundError, spell, summarize
from ..formats.dtypes import BY_NAME
from ..formats.entry import Entry
from ..io.fileio import Progress, crc32, open_regular

CONFIG = "config.json"  # a Hugging Face model's config, copied into a folder output
_CONFIG_LIMIT = 1 << 20

# torchtitan's names (0.3's, and before it wq/output without qkv_linear) -> transformers'; the
# second value marks the weights whose rows are permuted (q: by heads, k: by kv heads).
_NAMES: list[tuple[re.Pattern[str], str, str]] = [
    (re.compile(p), r, kind)
    for p, r, kind in [
        (r"^tok_embeddings\.weight$", "model.embed_tokens.weight", ""),
        (r"^layers\.(\d+)\.attention\.(?:qkv_linear\.)?wq\.weight$", r"model.layers.\1.self_attn.q_proj.weight", "q"),
        (r"^layers\.(\d+)\.attention\.(?:qkv_linear\.)?wk\.weight$", r"model.layers.\1.self_attn.k_proj.weight", "k"),
        (r"^layers\.(\d+)\.attention\.(?:qkv_linear\.)?wv\.weight$", r"model.layers.\1.self_attn.v_proj.weight", ""),
        (r"^layers\.(\d+)\.attention\.wo\.weight$", r"model.layers.\1.self_attn.o_proj.weight", ""),
        (r"^layers\.(\d+)\.feed_forward\.w1\.weight$", r"model.layers.\1.mlp.gate_proj.weight", ""),
        (r"^layers\.(\d+)\.feed_forward\.w2\.weight$", r"model.layers.\1.mlp.down_proj.weight", ""),
        (r"^layers\.(\d+)\.feed_forward\.w3\.weight$", r"model.layers.\1.mlp.up_proj.weight", ""),
        (r"^layers\.(\d+)\.attention_norm\.weight$", r"model.layers.\1.input_layernorm.weight", ""),
        (r"^layers\.(\d+)\.ffn_norm\.weight$", r"model.layers.\1.post_attention_layernorm.weight", ""),
        (r"^norm\.weight$", "model.norm.weight", ""),
        (r"^(?:output|lm_head)\.weight$", "lm_head.weight", ""),
    ]
]


def hf_name(name: str) -> tuple[str, str] | None:
    """``name``'s transformers name, and ``"q"``/``"k"`` where its rows are permuted; None: not a Llama weight."""
    for pattern, repl, kind in _NAMES:
        if pattern.match(name):
            return pattern.sub(repl, name), kind
    return None


def rope_rows(rows: int, heads: int) -> list[int]:
    """For each output row, the source row HF's permutation puts there: within each head of
    ``rows // heads`` rows, source rows (2j, 2j+1) go to j and j + half.

    Raises:
        ArgumentError: ``rows`` is not ``heads`` heads of an even number of rows.
    """
    if not _splits(rows, heads):
        raise ArgumentError(f"{rows} rows do not split into {heads} heads of an even number of rows each")
    per = rows // heads
    half = per // 2
    return [h * per + 2 * j + i for h in range(heads) for i in range(2) for j in range(half)]


def _splits(rows: int, heads: int) -> bool:
    return heads > 0 and rows % heads == 0 and (rows // heads) % 2 == 0


@dataclass(frozen=True)
class LlamaConfig:
    """What the transform needs of a Hugging Face Llama ``config.json``: the heads, the tie, its bytes."""

    path: str
    heads: int
    kv_heads: int
    tied: bool
    text: bytes = field(repr=False)

    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> LlamaConfig:
        """Read ``config.json`` (LlamaConfig's fields), or the one in the folder ``path``.

        Raises:
            CheckpointNotFoundError: there is no such file.
            ArgumentError: not a JSON config naming its attention heads.
        """
        option = spell("hf_llama", "--hf-llama")
        where = Path(path) / CONFIG if Path(path).is_dir() else Path(path)
        try:
            with open_regular(where) as f:
                text = f.read(_CONFIG_LIMIT + 1)
        except CheckpointNotFoundError:
            raise CheckpointNotFoundError(
                f"{option}: {where} does not exist; give the config.json of the Hugging Face model the checkpoint "
                "trains (from its HF assets)",
                filename=str(where),
            ) from None
        try:
            config = json.loads(text) if len(text) <= _CONFIG_LIMIT else None
        except ValueError:
            config = None
        heads: Any = config.get("num_attention_heads") if isinstance(config, dict) else None
        if not isinstance(config, dict) or not _count(heads):
            raise ArgumentError(
                f"{option}: {where} is not a Hugging Face Llama config.json naming num_attention_heads; give the "
                "config.json of the model the checkpoint trains (from its HF assets)"
            )
        kv: Any = config.get("num_key_value_heads")
        kv = heads if kv is None else kv
        if not _count(kv):
            raise ArgumentError(f"{option}: {where} gives num_key_value_heads {kv!r}, not a number of heads")
        return cls(str(where), heads, kv, bool(config.get("tie_word_embeddings", False)), text)


def _count(n: Any) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n > 0


def to_hf_llama(
    state: Mapping[str, Any], config: LlamaConfig, *, permute: Callable[[Any, int], Any], source: str
) -> tuple[dict[str, Any], list[str]]:
    """``state`` (a torchtitan Llama's weights) under transformers' names, ``wq``/``wk`` permuted
    by ``permute(value, heads)``; and the names left out: the output head, where the config ties
    it to the embedding (as torchtitan's ``to_hf`` leaves it out).

    Raises:
        ArgumentError: a weight that is not a Llama weight (nothing is guessed).
    """
    out: dict[str, Any] = {}
    unknown, left_out = [], []
    source_of: dict[str, str] = {}
    for name, value in state.items():
        found = hf_name(name)
        if found is None:
            unknown.append(name)
            continue
        new, kind = found
        if new in source_of:
            raise ArgumentError(
                f"{source}: {source_of[new]} and {name} would both be written as {new}; convert the weights of one "
                "model (torchtitan names each weight once)"
            )
        source_of[new] = name
        if new == "lm_head.weight" and config.tied:
            left_out.append(name)
            continue
        if kind:
            heads, field_name = (
                (config.heads, "num_attention_heads") if kind == "q" else (config.kv_heads, "num_key_value_heads")
            )
            shape = tuple(getattr(value, "shape", ()))
            if len(shape) != 2 or not _splits(shape[0], heads):
                raise ArgumentError(
                    f"{source}: {name} is {list(shape)}, which {heads} heads ({config.path}'s {field_name}) do not "
                    "split into rows of an even number each; give the config.json of the model this checkpoint trains"
                )
            value = permute(value, heads)
        out[new] = value
    if unknown:
        raise ArgumentError(
            f"{source}: {spell('hf_llama', '--hf-llama')} knows torchtitan's Llama weights, not "
            f"{summarize(unknown, 4)}; convert another model without it ({spell('rename', '--rename')} renames by rule)"
        )
    return out, left_out


@dataclass(eq=False)
class PermutedRows(Entry):
    """``src`` (a 2-D tensor) with its rows in :func:`rope_rows` order, written one head at a time."""

    src: Entry = field(repr=False)
    heads: int
    crc = None  # of bytes that do not exist until written
    zip = None

    def __post_init__(self) -> None:
        if len(self.src.shape) != 2:
            raise ArgumentError(f"a Llama attention weight is 2-D, not {list(self.src.shape)}")
        self.order = rope_rows(self.src.shape[0], self.heads)

    @property
    def dtype(self) -> str:  # type: ignore[override]
        return self.src.dtype

    @property
    def shape(self) -> tuple[int, ...]:  # type: ignore[override]
        return self.src.shape

    @property
    def nbytes(self) -> int:  # type: ignore[override]
        return self.src.nbytes

    @property
    def ident(self) -> Any:  # type: ignore[override]
        return ("rope rows", self.heads, self.src.ident)

    @property
    def storage(self) -> Any:  # type: ignore[override]
        return ("rope rows", self.heads, self.src.storage)

    @property
    def storage_size(self) -> int:  # type: ignore[override]
        return self.src.nbytes

    @property
    def complete(self) -> bool:  # type: ignore[override]
        return True

    def write(self, f: BinaryIO, progress: Progress | None = None) -> int:
        """Append the permuted rows to ``f``; returns their CRC-32. The source's own write reads
        (and checks) its bytes into a sink that holds one head's rows at a time."""
        row = self.src.shape[1] * BY_NAME[self.src.dtype].itemsize
        sink = _HeadSink(f, row, self.order[: len(self.order) // self.heads])
        self.src.write(sink, progress)  # type: ignore[arg-type] # a file-like sink, see _HeadSink
        if sink.held:
            raise CheckpointFormatError(f"internal error: {len(sink.held)} bytes left over permuting rows")
        return sink.crc


class _HeadSink:
    """Takes a tensor's bytes in any pieces; writes each head's rows, reordered, once it has them.

    It has no file descriptor (``fileno`` raises), so a source copies into it through reads."""

    def __init__(self, out: BinaryIO, row: int, order: list[int]) -> None:
        self.out, self.row, self.order = out, row, order  # order: one head's, from its first row
        self.block = row * len(order)
        self.held = bytearray()
        self.crc = 0

    def write(self, data: Any) -> int:
        n = len(memoryview(data).cast("B"))
        self.held += data
        done = 0
        with memoryview(self.held) as held:
            while len(held) - done >= self.block:
                out = b"".join(held[done + r * self.row : done + (r + 1) * self.row] for r in self.order)
                self.crc = crc32(out, self.crc)
                self.out.write(out)
                done += self.block
        del self.held[:done]  # once per piece: a large piece holds many heads
        return n

    def flush(self) -> None:
        """Only a head's partial rows are held, and they are written when the head is complete."""

    def fileno(self) -> int:
        raise io.UnsupportedOperation("a row permutation's sink has no file descriptor")


def permute_tensor(t: Any, heads: int) -> Any:
    """A torch tensor's rows in :func:`rope_rows` order (the torch path's transform)."""
    import torch  # deferred: only the torch path holds tensors

    return t[torch.tensor(rope_rows(t.shape[0], heads))].contiguous()
