"""Compiled optimizer ops: CPUAdam (SIMD + OpenMP) and FusedAdam (CUDA multi-tensor), built on first use.

    from zero_engine.ops import make_adam
    optimizer, description = make_adam(model.parameters(), "cpu", lr=1e-3, weight_decay=0.01)

``make_adam`` falls back to torch's fused/foreach AdamW, with one warning, when an op cannot be built;
``op_report_text()`` says which ops are available here and why not.
"""

from .builder import OpBuildError, load_op
from .cpu_adam import CPUAdam
from .fallback import make_adam
from .fused_adam import FusedAdam
from .report import OpStatus, op_report, op_report_text

__all__ = ["CPUAdam", "FusedAdam", "OpBuildError", "OpStatus", "load_op", "make_adam", "op_report",
           "op_report_text"]
