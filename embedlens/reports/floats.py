"""JSON text of a long list of floats, the bytes `json.dumps` writes, without a `repr` per item.

`vocab --json` holds every row's indicator and norm rounded to 6 decimals: 524,288 floats for a
262k vocabulary, whose `repr`s took json.dumps a tenth of the command's time. A float y that is
a whole number k of millionths (y is k / 10^6 rounded to the nearest double, as numpy's and
Python's rounding to 6 decimals give) and below 10^6 in size has, as its shortest repr, k's
digits with the point six places from the right and trailing zeros dropped: any other decimal of
as few digits lies at least 10^-7 away from k / 10^6, further than y's rounding interval
(under 2^-32) reaches. Python writes that decimal positionally from 10^-4 ('0.0001', '12.5',
'3.0', '-0.0'), below it in exponent form ('1e-05', '5.3e-05', '7e-06'). Each value is laid out
here in 16 bytes (two little-endian words) of characters from tables of three digits, the places
left unused NUL and dropped at the end; a list holding any other value is left to `json.dumps`.
"""

from __future__ import annotations

import functools
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

    Words = npt.NDArray[np.uint64]

LONG = 4096
"""Items from which a list of floats is written here (shorter ones cost json.dumps nothing)."""
_SCALE = 10**6
_LIMIT = 1e6


def dumps_floats(values: list[float], *, checked: bool = False) -> str | None:
    """`json.dumps(values)` (its default separators) for a list of floats that are each a whole
    number of millionths below 10^6 in size; None when the list holds anything else (another
    type, a non-finite float, a float with more decimals or as large) or is empty. `checked`:
    the caller has seen that every item is a float."""
    if not values or sys.float_repr_style != "short":
        return None
    if not checked and set(map(type, values)) != {float}:
        return None
    import numpy as np

    y = np.array(values, dtype=np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        k = np.rint(y * _SCALE)
        exact = bool(np.all(np.abs(y) < _LIMIT)) and bool(np.all(k / _SCALE == y))
    if not exact:  # NaN and infinities fail both tests
        return None
    whole = np.abs(k).astype(np.int64)
    sign = np.where(np.signbit(y), np.uint64(ord("-")), np.uint64(0))
    first, second = _positional(whole)
    _small(whole, first, second)
    text = np.stack([first | sign, second], axis=1).astype("<u8").view(np.uint8).ravel()
    written: bytes = text[text != 0].tobytes()
    return "[" + written[:-2].decode("ascii") + "]"


@functools.cache
def _tables() -> dict[str, npt.NDArray[np.uint64]]:
    """For every n below 1000, its three digits as the low three bytes of a word: leading zeros
    as NUL (`lead`), trailing zeros as NUL (`trail`), 0 left empty; then for 1000 + n all three
    digits. `units` (`lead` with 0 written '0') and `decimals` (`trail` with 0 written '0') are
    indexed by n, plus 1000 when the digits before (or after) are not all zero."""
    import numpy as np

    n = np.arange(1000, dtype=np.uint64)
    digits = [n // 100, n // 10 % 10, n % 10]
    shown = {
        "full": [n >= 0] * 3,
        "lead": [n >= 100, n >= 10, n >= 1],
        "trail": [n > 0, n % 100 > 0, n % 10 > 0],
    }
    out: dict[str, Any] = {}
    for name, keep in shown.items():
        out[name] = sum(
            np.where(k, d + np.uint64(ord("0")), np.uint64(0)) << np.uint64(8 * i)
            for i, (d, k) in enumerate(zip(digits, keep, strict=True))
        )
    zero = np.uint64(ord("0"))
    out["units"] = np.concatenate([out["lead"], out["full"]])
    out["units"][0] = zero << np.uint64(16)
    out["decimals"] = np.concatenate([out["trail"], out["full"]])
    out["decimals"][0] = zero
    return out


def _positional(whole: npt.NDArray[np.int64]) -> tuple[Words, Words]:
    """Every value as 'int.fraction' in two words: (sign place, 6 integer digits, '.') and
    (6 decimals, ', '), the integer part without leading zeros and the fraction without
    trailing zeros, each at least '0'."""
    import numpy as np

    t = _tables()
    integer, fraction = np.divmod(whole, _SCALE)
    thousands, units = np.divmod(integer, 1000)
    high, low = np.divmod(fraction, 1000)
    units_text = t["units"][units + 1000 * (thousands > 0)]
    high_text = t["decimals"][high + 1000 * (low > 0)]
    u = np.uint64
    first = (t["lead"][thousands] << u(8)) | (units_text << u(32)) | u(ord(".") << 56)
    second = high_text | (t["trail"][low] << u(24)) | u(ord(",") << 48 | ord(" ") << 56)
    return first, second


def _small(whole: npt.NDArray[np.int64], first: Words, second: Words) -> None:
    """Values below 10^-4 (1 to 99 millionths) rewritten as repr writes them: 'ke-06' for one
    digit, 'ae-05' or 'a.be-05' for two."""
    import numpy as np

    rows = np.flatnonzero((whole > 0) & (whole < 100))
    if rows.size == 0:
        return
    k = whole[rows].astype(np.uint64)
    u = np.uint64
    two = k >= 10
    lead = np.where(two, k // u(10), k) + u(ord("0"))
    tenth = two & (k % u(10) != 0)
    point = np.where(tenth, u(ord(".")) | ((k % u(10) + u(ord("0"))) << u(8)), u(0))
    first[rows] = (lead << u(8)) | (point << u(16))
    exponent = np.where(two, u(ord("5")), u(ord("6"))) << u(24)
    second[rows] = u(ord("e") | ord("-") << 8 | ord("0") << 16 | ord(",") << 48 | ord(" ") << 56)
    second[rows] |= exponent
