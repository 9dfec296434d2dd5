"""``python -m ckptkit.train`` (what ``ckptkit train`` starts under torchrun)."""

import sys

from . import main

sys.exit(main())
