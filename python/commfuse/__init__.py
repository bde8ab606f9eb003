"""commfuse: fused, overlapped collective matmuls for JAX.

Inside a ``jax.shard_map`` body::

    y = commfuse.all_gather_matmul(x, w, "tp")        # == all_gather(x, "tp", tiled=True) @ w
    z = commfuse.matmul_reduce_scatter(h, w2, "tp")   # == psum_scatter(h @ w2, "tp", tiled=True)

Under ``jax.jit`` on sharded arrays::

    y = commfuse.matmul(x, w)   # == x @ w, the collective its shardings need fused

``commfuse.overlap(f)`` does either for an existing program.
"""

from __future__ import annotations

import math

from . import _interrupt, reference
from ._all_gather_matmul import all_gather_matmul
from ._all_gather_both_matmul import all_gather_both_matmul
from ._all_gather_matmul_reduce_scatter import all_gather_matmul_reduce_scatter
from ._all_to_all import all_to_all_matmul, matmul_all_to_all
from ._explain import explain
from ._fused import checkpoint_policy
from ._matmul import matmul
from ._matmul_all_gather import matmul_all_gather
from ._matmul_all_reduce import matmul_all_reduce
from ._matmul_reduce_scatter import matmul_reduce_scatter
from ._native import LIBRARY_PATH, cuda_libraries, set_timeout_ms as _set_timeout_ms, set_transport as _set_transport
from ._overlap import overlap
from ._planner import Plan, constrain, plan, remat_policy
from ._reshard import PendingReshard, reshard, reshard_start
from ._trace import trace

_interrupt.install()

__version__ = "0.1.0"
__all__ = [
    "matmul",
    "all_gather_matmul",
    "matmul_reduce_scatter",
    "matmul_all_gather",
    "matmul_all_reduce",
    "all_gather_both_matmul",
    "all_gather_matmul_reduce_scatter",
    "all_to_all_matmul",
    "matmul_all_to_all",
    "overlap",
    "reshard",
    "reshard_start",
    "PendingReshard",
    "trace",
    "explain",
    "checkpoint_policy",
    "plan",
    "Plan",
    "remat_policy",
    "constrain",
    "configure",
    "cuda_libraries",
    "reference",
]


_KEEP = object()


# A deadline past any run (the library keeps milliseconds in 64 bits).
_MAX_TIMEOUT_S = 1e9


def configure(*, timeout_s: float | None = _KEEP, transport: str | None = _KEEP) -> None:
    """Sets run-time settings; what is not passed stays as it is.

    ``timeout_s``: the deadline, in seconds, of every wait across devices. A
    rank that waits longer (because a peer never reached the op) fails with
    DEADLINE_EXCEEDED, naming the ranks that never arrived. ``None`` goes back
    to the environment variable ``COMMFUSE_TIMEOUT_S`` (default 30).

    ``transport``: how the ranks of a group exchange blocks on GPUs:
    ``"copies"`` (copy engines: device-to-device copies ordered by events,
    for groups whose devices are all this process's), ``"nccl"`` (NCCL
    send/receive), or ``"auto"`` (copies where they serve, else NCCL). ``None``
    goes back to ``COMMFUSE_TRANSPORT`` (default ``auto``). Calls read it when
    they run; the CPU backend has one transport and ignores it.
    """
    if timeout_s is not _KEEP:
        if timeout_s is None:
            _set_timeout_ms(0)
        elif isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) \
                or not math.isfinite(timeout_s) or not 0 < timeout_s <= _MAX_TIMEOUT_S:
            raise ValueError(f"commfuse.configure: timeout_s must be a positive number of seconds, at most "
                             f"{_MAX_TIMEOUT_S:.0e}, got {timeout_s!r}")
        else:
            _set_timeout_ms(max(1, round(timeout_s * 1000)))
    if transport is not _KEEP:
        if transport is not None and not isinstance(transport, str) or not _set_transport(transport):
            raise ValueError(f"commfuse.configure: transport must be 'auto', 'copies', 'nccl' or None, got {transport!r}")
