"""Autotuning of tvm_ext kernels with MetaSchedule: design spaces (space) and whole-network tuning (tune)."""

from .tuner import Task, extract_tasks, open_database, tune, tuned_kernel

__all__ = ["Task", "extract_tasks", "open_database", "tune", "tuned_kernel"]
