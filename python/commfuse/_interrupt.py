"""Ctrl-C while a fused op waits for its peers.

JAX checks for signals every 200 ms while Python blocks on a result, so
Python's SIGINT handler runs then; it raises KeyboardInterrupt, but the
computation goes on: a fused op whose peers will never arrive would keep
waiting for its deadline, and the process could not exit before. Wrapping
Python's default handler makes it first tell the library (``config::interrupt``
in ``src/config.rs``): every wait under way ends at once with CANCELLED.

Only Python's default handler is wrapped: a program with a handler of its
own (a "stop after this step" flag, say) keeps it, and its running ops are
left to finish.
"""

from __future__ import annotations

import signal
import threading

from . import _native


def _interrupting_default_handler(signum, frame):
    _native.interrupt()
    signal.default_int_handler(signum, frame)


def install() -> bool:
    """Wraps the default SIGINT handler; returns whether it did (only the
    main thread may set handlers, and only the default one is wrapped)."""
    if threading.current_thread() is not threading.main_thread():
        return False
    current = signal.getsignal(signal.SIGINT)
    if current is _interrupting_default_handler:
        return True
    if current is not signal.default_int_handler:
        return False
    signal.signal(signal.SIGINT, _interrupting_default_handler)
    return True
