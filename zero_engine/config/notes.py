"""What one load_config call noticed besides hard errors, logged together at the end so each kind is said once."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

from zero_engine.errors import ConfigError

logger = logging.getLogger("zero_engine.config")


@dataclass
class LoadNotes:
    # (path, what it became) for every "auto", in the order resolved.
    autos: list[tuple[str, str]] = field(default_factory=list)
    # Sections accepted but not acted on (tensorboard, flops_profiler, ...).
    ignored_sections: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    # "not supported yet" problems; raised after the whole file was checked for unknown keys, so a typo is
    # reported as a typo even when the file also uses a feature we lack.
    unsupported: list[str] = field(default_factory=list)
    # (path, why it has no effect, set to something else than its default) for keys that change nothing here.
    inert: list[tuple[str, str, bool]] = field(default_factory=list)

    def auto(self, path: str, became: str) -> None:
        self.autos.append((path, became))

    def warn(self, message: str) -> None:
        self.warnings.append(message)

    def deprecated(self, old_path: str, replacement: str) -> None:
        self.warn(f"{old_path} is deprecated; read as {replacement}. Write that instead.")

    def no_effect(self, path: str, reason: str, changed: bool) -> None:
        if not any(path.startswith(f"{noted}.") for noted, _, _ in self.inert):  # a section says it for its keys
            self.inert.append((path, reason, changed))

    def not_supported(self, message: str) -> None:
        self.unsupported.append(message)

    def raise_if_unsupported(self) -> None:
        if not self.unsupported:
            return
        if len(self.unsupported) == 1:
            raise ConfigError(self.unsupported[0])
        raise ConfigError(f"{len(self.unsupported)} config problems:\n  " + "\n  ".join(self.unsupported))

    def log(self) -> None:
        for message in self.warnings:
            logger.warning(message)
        if self.ignored_sections:
            logger.info(
                "accepted but not acted on (zero_engine does not implement these tools): %s",
                ", ".join(self.ignored_sections),
            )
        changed = [f"{path} ({reason})" for path, reason, was_changed in self.inert if was_changed]
        if changed:
            logger.warning("set, but no effect in zero_engine: %s", "; ".join(changed))
        same = [path for path, _, was_changed in self.inert if not was_changed]
        if same:
            logger.info("accepted at their defaults, no effect in zero_engine (see docs/config.md): %s",
                        ", ".join(same))
        if self.autos:
            logger.info('resolved "auto": %s', ", ".join(f"{path}={became}" for path, became in self.autos))
