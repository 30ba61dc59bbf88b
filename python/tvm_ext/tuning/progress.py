"""Tuning progress: a MetaSchedule measure callback that prints a progress line per batch of
trials (per task and overall, best GFLOP/s so far), keeps each task's tuning curve, and draws it.

MetaSchedule's task scheduler starts a batch (up to num_trials_per_iter candidates) whenever
fewer than max_trials are done and measures it whole, so a run may measure up to a batch less
one past its budget. Those trials are counted apart ("48/48 trials +9 past the budget", and the
summary says what they are), not as "57/48"."""

from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path
from typing import TextIO

from tvm.ir.utils import derived_object
from tvm.s_tir.meta_schedule.measure_callback import PyMeasureCallback


@derived_object
class TuningProgress(PyMeasureCallback):
    """Counts trials and the best latency of each task as results arrive."""

    def __init__(self, tasks: list, max_trials: int, stream: TextIO = sys.stderr):
        super().__init__()
        self.names = [t.name for t in tasks]
        self.flops = [t.flops for t in tasks]
        self.max_trials = max_trials
        self.stream = stream
        self.trials = [0] * len(tasks)
        self.best = [math.inf] * len(tasks)  # seconds
        self.curves: list[list[tuple[int, float]]] = [[] for _ in tasks]  # (trial, best seconds so far)

    def apply(self, task_scheduler, task_id: int, measure_candidates, builder_results, runner_results) -> None:
        for result in runner_results:
            self.trials[task_id] += 1
            if result.error_msg is None and result.run_secs:
                seconds = statistics.median(float(getattr(s, "value", s)) for s in result.run_secs)
                self.best[task_id] = min(self.best[task_id], seconds)
            if math.isfinite(self.best[task_id]):
                self.curves[task_id].append((self.trials[task_id], self.best[task_id]))
        width = 30
        filled = min(width, round(width * sum(self.trials) / max(1, self.max_trials)))
        print(f"\r[{'#' * filled}{'.' * (width - filled)}] {self.count()} | task {task_id} "
              f"({self.trials[task_id]} trials): best {self.gflops(task_id):.1f} GFLOP/s", end="",
              file=self.stream, flush=True)

    def count(self) -> str:
        """Trials done against the budget; those past it (the rest of the batch begun under it,
        which MetaSchedule measures whole) counted apart."""
        done = sum(self.trials)
        extra = done - self.max_trials
        if extra <= 0:
            return f"{done}/{self.max_trials} trials"
        return f"{self.max_trials}/{self.max_trials} trials +{extra} past the budget"

    def gflops(self, task_id: int) -> float:
        return self.flops[task_id] / self.best[task_id] / 1e9 if math.isfinite(self.best[task_id]) else 0.0

    def summary(self) -> str:
        rows = [("task", "trials", "best ms", "GFLOP/s")]
        rows += [(name, str(self.trials[i]), f"{self.best[i] * 1e3:.3f}" if math.isfinite(self.best[i]) else "-",
                  f"{self.gflops(i):.1f}") for i, name in enumerate(self.names)]
        widths = [max(len(r[c]) for r in rows) for c in range(4)]
        table = "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows)
        extra = sum(self.trials) - self.max_trials
        if extra > 0:
            table += (f"\n{sum(self.trials)} trials: the budget of {self.max_trials} and {extra} more, the rest of "
                      "the batch begun under it (MetaSchedule measures a batch whole)")
        return table

    def plot(self, path: Path) -> Path | None:
        """The tuning curves (best latency against trials, per task) as a PNG; None without matplotlib."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return None
        fig, ax = plt.subplots(figsize=(8, 5))
        for name, curve in zip(self.names, self.curves, strict=True):
            if curve:
                ax.step([t for t, _ in curve], [s * 1e3 for _, s in curve], where="post", label=name[:60])
        ax.set_xlabel("trials")
        ax.set_ylabel("best latency (ms)")
        ax.set_title("tvm_ext tuning curves")
        ax.legend(fontsize=6)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path
