"""``python -m ckptkit.cli``: the same as the ``ckptkit`` command."""

from . import main

main()
