"""Exception types shared across zero_engine: one family per kind of problem.

    ConfigError            a ds_config problem (key path, bad value, what is allowed, did-you-mean)
    DistributedError       ranks could not complete a collective step together
      RankDivergenceError  ranks issued different collectives, or ran different work in one step
      RankLostError        a rank stopped (killed, crashed, exited, unreachable) while the others waited for it
        RankFailedError    ... because of an error on that rank, which the message names (type and message)
    UsageError             a call in the wrong order or state where DeepSpeed asserts (no_sync() at stage 2-3,
                           nested no_sync(), step() inside no_sync(), step() of an engine without an optimizer):
                           a RuntimeError and an AssertionError
    ArgumentError          a bad argument where DeepSpeed asserts (initialize(model=None), different checkpoint
                           tags under tag_validation "Fail"): a ValueError and an AssertionError

[Note: errors that are also AssertionError]
DeepSpeed answers some misuse with ``assert``, so code and tests written for it catch AssertionError. Our rule is
ValueError for a bad argument and RuntimeError for a wrong call order, with a message that says what to do.
UsageError and ArgumentError are both: ``except RuntimeError`` / ``except ValueError`` and ``except
AssertionError`` all catch them. They are used exactly where DeepSpeed asserts for the same misuse (listed in
docs/deepspeed_compat.md); everywhere else the plain types stay. Unlike a bare assert, they are raised under
``python -O`` too.
"""


class ConfigError(ValueError):
    """Every problem with a ds_config: the message names the full key path, the bad value, what is allowed,
    and for an unknown key the closest known key. ``zero_engine.DeepSpeedConfigError`` is the same class."""


class DistributedError(RuntimeError):
    """Ranks could not finish a collective piece of work together. Raised on every surviving rank; the message
    names the ranks, the module, the phase and the step involved, and says what to do."""


class RankDivergenceError(DistributedError):
    """Ranks disagreed: different collectives at the same position, or a different step fingerprint."""


class RankLostError(DistributedError):
    """A rank stopped taking part (process killed, crashed, or unreachable)."""


class RankFailedError(RankLostError):
    """A rank stopped taking part because it raised: the message names that rank's exception (type and message) as
    it posted it (see [Note: failure notes] in comm/liveness.py). Its traceback is in that rank's own log."""


class UsageError(RuntimeError, AssertionError):
    """A call in the wrong order or state where DeepSpeed asserts; see [Note: errors that are also AssertionError]."""


class ArgumentError(ValueError, AssertionError):
    """A bad argument where DeepSpeed asserts; see [Note: errors that are also AssertionError]."""
