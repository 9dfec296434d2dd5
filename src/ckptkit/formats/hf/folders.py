"""The training folders of Hugging Face's libraries, recognised by their files: a ``Trainer``
``checkpoint-N/`` and an Accelerate ``save_state`` folder, and a plain ``save_pretrained`` one.

Their weights are the model file(s) ``save_pretrained`` / Accelerate write (``model.safetensors``,
its shards and index, or ``pytorch_model.bin``), which :mod:`.index` opens as one checkpoint; the
rest of the folder is training state, listed here with what each file holds.

Example:
    >>> p = describe_folder(Path("fixtures/frameworks/trainer/checkpoint-2"))  # doctest: +SKIP
    >>> p.what  # doctest: +SKIP
    'Hugging Face Trainer checkpoint, step 2'
"""

from __future__ import annotations

import re
from pathlib import Path

from ...io.fileio import small_json
from ..producers import Producer
from .detect import HF_INDEXES, HF_SINGLE
from .index import HF_FILE

_STEP = re.compile(r"^checkpoint-(\d+)$")
_MAX_JSON = 1_000_000  # trainer_state.json holds a log line per logging step; a bigger JSON file is only listed
# What each file the Trainer (Trainer._save_checkpoint) writes beside the model holds.
TRAINER_FILES = {
    "optimizer.pt": "optimizer state (torch.save of optimizer.state_dict())",
    "scheduler.pt": "LR scheduler state",
    "scaler.pt": "GradScaler state (fp16 mixed precision)",
    "rng_state.pth": "RNG states: python, numpy, torch CPU and CUDA (numpy's needs trust to load)",
    "trainer_state.json": "TrainerState: global step, epoch, log history, best metric",
    "training_args.bin": "TrainingArguments (a pickled class: needs trust to load)",
    "config.json": "the model's configuration (architecture, sizes)",
    "generation_config.json": "generation defaults",
    "adapter_model.safetensors": "PEFT adapter weights (a file of its own: give it for those)",
    "adapter_config.json": "PEFT adapter configuration",
}
# And Accelerate's save_state (accelerate.checkpointing.save_accelerator_state), by name pattern.
ACCELERATE_FILES = [
    (re.compile(r"^optimizer(_\d+)?\.bin$"), "optimizer state"),
    (re.compile(r"^scheduler(_\d+)?\.bin$"), "LR scheduler state"),
    (re.compile(r"^(sampler|dl_state_dict)(_\d+)?\.bin$"), "data loader / sampler state"),
    (
        re.compile(r"^random_states_(\d+)\.pkl$"),
        "RNG states of process {0}: python, numpy, torch (a plain pickle: needs trust)",
    ),
    (re.compile(r"^scaler\.pt$"), "GradScaler state (fp16 mixed precision)"),
    (
        re.compile(r"^custom_checkpoint_(\d+)\.pkl$"),
        "object {0} registered with register_for_checkpointing (needs trust)",
    ),
    (
        re.compile(r"^(model|pytorch_model)_(\d+)\.(safetensors|bin)$"),
        "model {1}'s weights (a file of its own: give it for those)",
    ),
]


def _weights_files(folder: Path) -> list[str]:
    """The model file(s) ckptkit reads as the folder's weights: the index first, else the one file."""
    for name in (*HF_INDEXES, *HF_SINGLE):
        if (folder / name).is_file():
            return [name]
    return []


def _holds(name: str, table: dict[str, str]) -> str:
    if name in table:
        return table[name]
    for pattern, text in ACCELERATE_FILES:
        if m := pattern.match(name):
            return text.format(*m.groups())
    return "model weights (read as the checkpoint)" if HF_FILE.match(name) else ""


def _json(folder: Path, name: str) -> dict[str, object]:
    """The JSON object in ``folder/name``; empty where :func:`~...io.fileio.small_json` gives none
    or it is not an object: such a file is listed, not trusted."""
    found = small_json(folder / name, limit=_MAX_JSON)
    return found if isinstance(found, dict) else {}


def describe_folder(folder: Path) -> Producer | None:
    """A Trainer checkpoint, an Accelerate ``save_state`` folder or a ``save_pretrained`` folder,
    as a :class:`~..producers.Producer` (``weights``: the model file read; ``files``: every other
    file and what it holds), or None for a folder of none of these.
    """
    if not folder.is_dir():
        return None
    names = sorted(p.name for p in folder.iterdir() if p.is_file())
    weights = _weights_files(folder)
    notes: list[str] = []
    if "trainer_state.json" in names or ("training_args.bin" in names and weights):
        state = _json(folder, "trainer_state.json")
        step = state.get("global_step")
        if not isinstance(step, int):
            m = _STEP.match(folder.name)
            step = int(m.group(1)) if m else None
        epoch = state.get("epoch")
        what = "Hugging Face Trainer checkpoint" + (f", step {step}" if step is not None else "")
        what += f", epoch {epoch:g}" if isinstance(epoch, (int, float)) else ""
        name = "hf-trainer"
    elif any(p.match(n) for n in names for p, _ in ACCELERATE_FILES[:4]):
        what, name = "Accelerate save_state folder", "accelerate"
        more = [n for n in names if ACCELERATE_FILES[-1][0].match(n)]
        if more:
            notes.append(f"{len(more) + 1} models were saved: the first is read; give {', '.join(more)} for the others")
    elif "config.json" in names and weights:
        what, name = "Hugging Face save_pretrained folder", "hf-pretrained"
    else:
        return None
    config = _json(folder, "config.json")
    if isinstance(arch := config.get("architectures"), list):
        what += f" ({', '.join(map(str, arch))})"
    if config.get("tie_word_embeddings") is True and weights:
        notes.append(
            "tie_word_embeddings: Hugging Face stores the tied output layer once, under the embedding's name; "
            "load_for_rank fills it from the model's tie"
        )
    if not weights:
        adapter = "adapter_model.safetensors" in names
        notes.append(
            "it holds no model.safetensors, model.safetensors.index.json or pytorch_model.bin"
            + ("; its weights are a PEFT adapter: give adapter_model.safetensors" if adapter else "")
        )
    files = [{"name": n, "holds": _holds(n, TRAINER_FILES) or "-"} for n in names]
    return Producer(name, what, weights=", ".join(weights) or None, notes=notes, files=files)
