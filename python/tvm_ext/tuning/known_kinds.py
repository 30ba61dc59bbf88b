"""The kinds of tuning task tvm_ext has (BRGEMM convolutions, poolings, convolutions on the maxDNN
tile), and the lookup of a function's kind: above :mod:`.space`, :mod:`.pool_space` and
:mod:`.maxdnn_space`, which define them with :class:`.kinds.TaskKind`."""

from __future__ import annotations

import tvm

from .kinds import TaskKind
from .maxdnn_space import MAXDNN_CONV2D
from .pool_space import POOL2D
from .space import CONV2D

KINDS: tuple[TaskKind, ...] = (CONV2D, POOL2D, MAXDNN_CONV2D)


def kind_of(func: tvm.tirx.PrimFunc) -> TaskKind | None:
    """The kind of a tvm_ext workload or kernel, or None for any other function."""
    return next((kind for kind in KINDS if kind.describes(func)), None)


def task_kind(func: tvm.tirx.PrimFunc) -> TaskKind:
    """The kind of a function that must be a tvm_ext workload or kernel (a task's, a record's)."""
    kind = kind_of(func)
    if kind is None:
        raise ValueError(f"not a tvm_ext tuning workload or kernel: none of the attributes "
                         f"{', '.join(k.attr for k in KINDS)}")
    return kind
