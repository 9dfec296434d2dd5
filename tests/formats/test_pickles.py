"""The pickle reader's stand-ins read what torch's weights-only unpickler reads, opcode for opcode."""

from __future__ import annotations

import inspect
import re

import torch
import torch._weights_only_unpickler as weights_only

from ckptkit.formats.pickles.reader import WEIGHTS_ONLY_OPCODES


def test_the_opcodes_admitted_are_those_torchs_weights_only_unpickler_reads() -> None:
    source = inspect.getsource(weights_only.Unpickler.load)
    handled = set(re.findall(r"key\[0\] == ([A-Z_0-9]+)\[0\]", source))
    for group in re.findall(r"key\[0\] in \[(.*)\]:", source):
        handled |= set(re.findall(r"([A-Z_0-9]+)\[0\]", group))
    assert handled >= WEIGHTS_ONLY_OPCODES  # never admits what this torch refuses
    if torch.__version__.startswith("2.13."):  # the pinned torch: nothing it reads is refused either
        assert handled == WEIGHTS_ONLY_OPCODES
