"""Autotuning of tvm_ext kernels with MetaSchedule: design spaces (space) and whole-network tuning (tune)."""

from .records import open_database, tuned_kernel
from .tuner import Task, extract_tasks, tune

__all__ = ["Task", "extract_tasks", "open_database", "tune", "tuned_kernel"]
