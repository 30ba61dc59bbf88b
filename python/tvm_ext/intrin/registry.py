"""Registering tensor intrinsics once, from any thread.

TVM's registry raises when a name is registered twice, and `functools.cache` does not stop two
threads from running a first call together: threads warming up a server, or MetaSchedule's
postprocessors in worker threads, then failed (or crashed inside TensorIntrin::Register). One
lock serializes the check and the registration; descriptions are built under it too (tens of
milliseconds, once per intrinsic per process).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from tvm import tirx
from tvm.s_tir import TensorIntrin

_LOCK = threading.RLock()  # re-entrant: building one description may register another


def register_once(name: str, make: Callable[[], tuple[tirx.PrimFunc, tirx.PrimFunc]]) -> str:
    """Register `make()`'s (description, implementation) as `name` unless it is registered."""
    if TensorIntrin.get(name, allow_missing=True) is not None:
        return name
    with _LOCK:
        if TensorIntrin.get(name, allow_missing=True) is None:
            TensorIntrin.register(name, *make())
    return name
