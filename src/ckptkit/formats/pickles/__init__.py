"""Pickles, as torch zips, DCP and DeepSpeed files hold them: read through inert stand-ins
(``reader``), the globals they name and which stand-ins model them (``globals``), the globals a
pickle would import (``scan``), and pickles written from stand-ins (``dump``)."""
