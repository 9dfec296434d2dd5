"""Operations on checkpoints: what the public API does, built on the layers below.

Reading (``read``, ``load``, ``resume``; torch's loader behind ckptkit's checks in ``torchload``,
whole pickled modules in ``pickled``, DCP through torch in ``dcp_read``), writing (``write``, the
one write path; ``save``, rank-0 saving; ``async_save``; ``folder``, step-numbered checkpoint
folders; ``dcp_write``), checking (``verify``, ``verify_dcp``; ``safety``, what may be unpickled),
and the commands' work (``convert``, ``convert_job``, ``reports``, ``inspect``, ``inspect_read``,
``diff``, ``sanitize``, ``torchcast``).
"""
