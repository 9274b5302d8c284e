"""Which ops can be used here and why not: the table behind ``zero-engine ops`` (like DeepSpeed's ds_report)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from .builder import (OP_NAMES, OpBuildError, build_directory, find_nvcc, is_loaded, load_op, nvcc_version,
                      plan_build)


class OpStatus(NamedTuple):
    name: str
    available: bool
    reason: str


def _status(op_name: str, build: bool) -> OpStatus:
    try:
        plan = plan_build(op_name)
        if build:
            load_op(op_name)
    except OpBuildError as err:
        return OpStatus(op_name, False, err.reason)
    if is_loaded(plan):
        return OpStatus(op_name, True, f"{plan.description}, loaded from {build_directory(plan)}")
    return OpStatus(op_name, True, f"{plan.description}, prerequisites present; builds on first use into "
                                   f"{build_directory(plan)}")


def op_report(build: bool = False) -> list[OpStatus]:
    """One row per op. ``build=False`` only checks prerequisites (fast); ``build=True`` builds each op
    (seconds when not cached) so that ``available`` also covers compiler errors."""
    return [_status(op_name, build) for op_name in OP_NAMES]


def op_report_text(build: bool = False, rows: list[OpStatus] | None = None) -> str:
    """The table ``zero-engine ops`` prints, of ``rows`` when given (from op_report) or of a fresh report."""
    rows = op_report(build) if rows is None else rows
    nvcc = find_nvcc()
    toolkit = f"{nvcc_version(nvcc)} ({nvcc})" if nvcc else "not found"
    lines = [
        f"torch {torch.__version__}, torch CUDA {torch.version.cuda}, CUDA toolkit {toolkit}, "
        f"CUDA device visible: {torch.cuda.is_available()}",
        "",
        f"{'op':<12} {'available':<10} reason",
    ]
    for row in rows:
        lines.append(f"{row.name:<12} {'yes' if row.available else 'NO':<10} {row.reason}")
    return "\n".join(lines)
