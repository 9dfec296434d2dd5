"""``python -m ckptkit.train`` (what ``ckptkit train`` starts under torchrun)."""

import os
import signal
import sys


def _stopped_before_training(signum: int, frame: object) -> None:
    # A signal before the loop's own handler exists: nothing to save yet. Leave quietly
    # instead of a KeyboardInterrupt traceback from inside an import.
    os._exit(130)


for _sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(_sig, _stopped_before_training)

from . import main  # noqa: E402  (after the handlers: importing torch takes a while)

sys.exit(main())
