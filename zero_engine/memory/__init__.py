"""Memory accounting: exact bytes per category from the engine, and process RSS from the OS."""

from .accounting import MemoryAccounting, rss_bytes, rss_peak_bytes, reset_rss_peak

__all__ = ["MemoryAccounting", "rss_bytes", "rss_peak_bytes", "reset_rss_peak"]
