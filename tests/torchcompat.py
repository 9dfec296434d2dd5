"""What the supported torch range (pyproject: torch>=2.6) differs in, where tests must care.

``dcp.save``/``dcp.load`` take ``no_dist=True`` from a release after 2.6; torch 2.6 infers it
(no process group in this process: the same single-process save or load). Tests that build DCP
folders pass ``**SAVE_ALONE``/``**LOAD_ALONE`` instead of the keyword.
"""

from __future__ import annotations

import inspect

import torch.distributed.checkpoint as dcp

SAVE_ALONE = {"no_dist": True} if "no_dist" in inspect.signature(dcp.save).parameters else {}
LOAD_ALONE = {"no_dist": True} if "no_dist" in inspect.signature(dcp.load).parameters else {}
