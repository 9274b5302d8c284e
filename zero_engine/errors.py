"""Exception types shared across zero_engine."""


class ConfigError(ValueError):
    """Every problem with a ds_config: the message names the full key path, the bad value, what is allowed,
    and for an unknown key the closest known key."""
