"""``python -m ckptkit.train`` (what ``ckptkit train`` starts under torchrun)."""

import signal
import sys

# Until the loop installs its own handler (ckptkit.StopSignal) there is nothing to save, so a
# signal should just end the process, quietly. The kernel's default action does that even while
# the process is blocked in C++ (gloo connecting to a peer that already died, the rendezvous
# store waiting for workers), where a Python handler would never run: the worker would hang
# until the store's timeout, and the launcher with it.
for _sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(_sig, signal.SIG_DFL)

from . import main  # noqa: E402  (after the handlers: importing torch takes a while)

sys.exit(main())
