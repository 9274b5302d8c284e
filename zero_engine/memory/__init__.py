"""Memory accounting: exact bytes per category from the engine, and process RSS from the OS."""

from .accounting import MemoryAccounting, reset_rss_peak, rss_bytes, rss_peak_bytes
from .estimator import MemoryEstimate, RankMemory, estimate_from_counts, estimate_zero3_model_states_mem_needs_all_live

__all__ = ["MemoryAccounting", "rss_bytes", "rss_peak_bytes", "reset_rss_peak", "MemoryEstimate", "RankMemory",
           "estimate_from_counts", "estimate_zero3_model_states_mem_needs_all_live"]
