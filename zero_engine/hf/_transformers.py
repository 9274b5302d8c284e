"""transformers is optional: imported on first use, with an install hint when it is missing."""

from __future__ import annotations

import importlib

__all__ = ["require_transformers"]

MIN_VERSION = (5, 0)


def require_transformers(what: str):
    try:
        transformers = importlib.import_module("transformers")
    except ImportError as error:
        raise ImportError(f"{what} needs Hugging Face transformers: pip install 'zero_engine[hf]'") from error
    major_minor = tuple(int(part) for part in transformers.__version__.split(".")[:2] if part.isdigit())
    if major_minor < MIN_VERSION:
        raise ImportError(f"{what} needs transformers>={'.'.join(map(str, MIN_VERSION))} (its meta-device loading "
                          f"and init flags); found {transformers.__version__}: pip install -U 'zero_engine[hf]'")
    return transformers
