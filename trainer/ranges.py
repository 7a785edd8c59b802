"""The values a number of the config may take, declared beside its field:

    lr: Annotated[float, Range(0, low_open=True)] = 3e-3  # peak learning rate

trainer/preflight/check.py reads every field's ranges in one walk over the config and refuses the first value
out of one with `<where>: <key>: is <value>; <Range.says>`. A field may carry several (checked in
order), and a tuple field one per element (`item`). The config's loader strips the annotation
(typing.get_type_hints without extras), so a field's type is what it was.

Standard library only, importing nothing of the package: the sections defined below the config
(optim.py, health.py, models/) use it as config.py does.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass

# Largest train.seed: numpy's legacy seed limit; (seed x 1_000_003 + 2**32) stays within torch's 2**64.
MAX_SEED = 2**32 - 1
# Largest parallel.timeout_s, checkpoint.timeout_s and health.command_timeout_s in seconds: a week.
# timedelta ends at 8.6e13 s, c10d's clocks (int64 nanoseconds) at 9.2e9 s; a collective that waits
# a week is lost anyway.
MAX_TIMEOUT_S = 7 * 24 * 3600


@dataclass(frozen=True)
class Range:
    """Numbers from `low` to `high` (None: no bound on that side; `low_open`, `high_open`: the bound
    itself excluded). `says` is what the error says after `is <value>; `: by default the range in
    words ("it must be positive", "it must be in [0, 1)"), then `note`."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    note: str = ""  # appended to the range in words: ", e.g. 0.9", " (7 days)"
    says: str | None = None  # the whole text instead of the range in words
    item: int | None = None  # a tuple field: the element this range is for

    def allows(self, value: float) -> bool:
        if self.low is not None and not (value > self.low if self.low_open else value >= self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def bounds(self) -> str:
        """The range in symbols, as the config's key table shows it: "> 0", "[0, 1)", "<= 604800"."""
        low, high = self.low, self.high
        if low is not None and high is not None:
            return f"{'(' if self.low_open else '['}{low}, {high}{')' if self.high_open else ']'}"
        if low is not None:
            return f"{'>' if self.low_open else '>='} {low}"
        return f"{'<' if self.high_open else '<='} {high}"

    def __str__(self) -> str:
        if self.says is not None:
            return self.says
        low, high = self.low, self.high
        if low is not None and high is not None:
            words = f"in {'(' if self.low_open else '['}{low}, {high}{')' if self.high_open else ']'}"
        elif low is not None and self.low_open:
            words = "positive" if low == 0 else f"more than {low}"
        elif low is not None:
            words = "0 or more" if low == 0 else f"at least {low}"
        else:
            words = f"{'less than' if self.high_open else 'at most'} {high}"
        return f"it must be {words}{self.note}"


POSITIVE = Range(0, low_open=True)  # floats > 0
NOT_NEGATIVE = Range(0)  # 0 or more
AT_LEAST_1 = Range(1)  # counts of things, steps and sizes
TIMEOUT_S = (Range(1), Range(high=MAX_TIMEOUT_S, note=" (7 days)"))  # seconds a wait may last


def of(hint) -> tuple[Range, ...]:
    """The ranges a field's type hint (typing.get_type_hints(..., include_extras=True)) declares."""
    if typing.get_origin(hint) is not typing.Annotated:
        return ()
    out: list[Range] = []
    for extra in typing.get_args(hint)[1:]:
        out += extra if isinstance(extra, tuple) else [extra]
    return tuple(r for r in out if isinstance(r, Range))
