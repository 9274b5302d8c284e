"""Memory timeline: bytes per category and RSS at every hook event, one JSON line each, per rank.

Enabled with ``{"zero_engine": {"memory_timeline": {"enabled": true, "path": "out/timeline"}}}``; rank r writes
``out/timeline.rank{r}.jsonl`` (appended at each optimizer step). ``zero-engine plot FILE...`` draws them.
Each record: ``{"step", "event", "t", "params_gathered", "grads", "comm_buffers", "rss"}`` (bytes; ``t`` seconds since
the engine started). Sampling RSS costs a few microseconds per event, so the timeline is for diagnosis, not for
timed runs.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from .accounting import rss_bytes

__all__ = ["MemoryTimeline", "plot_timelines"]


class MemoryTimeline:
    def __init__(self, path: str, rank: int):
        self.path = Path(f"{path}.rank{rank}.jsonl")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("")
        self._start = time.perf_counter()
        self._rows: list[dict] = []

    def record(self, step: int, event: str, categories: dict[str, int]) -> None:
        self._rows.append({"step": step, "event": event, "t": round(time.perf_counter() - self._start, 6),
                           **categories, "rss": rss_bytes()})

    def flush(self) -> None:
        if self._rows:
            with open(self.path, "a") as f:
                f.writelines(json.dumps(row) + "\n" for row in self._rows)
            self._rows.clear()


def plot_timelines(files: list[str], output: str, categories=("params_gathered", "comm_buffers", "grads")) -> str:
    """One panel per file (e.g. coalesced vs sequential), engine categories in MiB over hook events."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:  # optional: pip install zero_engine[plot]
        raise RuntimeError("zero-engine plot needs matplotlib: pip install 'zero_engine[plot]'") from e
    fig, axes = plt.subplots(len(files), 1, figsize=(10, 3.2 * len(files)), sharex=True, squeeze=False)
    top = 0.0
    for ax, name in zip(axes[:, 0], files):
        rows = [json.loads(line) for line in open(name) if line.strip()]
        x = range(len(rows))
        for cat in categories:
            values = [r.get(cat, 0) / 2**20 for r in rows]
            top = max(top, max(values, default=0))
            ax.plot(x, values, label=cat, linewidth=1.2)
        ax.set_title(os.path.basename(name))
        ax.set_ylabel("MiB")
        ax.legend(loc="upper right", fontsize=8)
        ax.grid(alpha=0.3)
    for ax in axes[:, 0]:
        ax.set_ylim(0, top * 1.1 or 1)
    axes[-1, 0].set_xlabel("hook event (fetch / release / step), in order")
    fig.tight_layout()
    fig.savefig(output, dpi=110)
    plt.close(fig)
    return output
