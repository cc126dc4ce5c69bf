"""Byte sizes as operators write them in flags: '4GiB', '512MiB', '2G' or a plain number of bytes."""

from __future__ import annotations

import re

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}


def parse_size(text: str) -> int:
    """Bytes from '4GiB', '512MiB', '2G' or a plain number of bytes (binary units)."""
    match = _SIZE.match(text)
    if match is None:
        raise ValueError(f"{text!r} is not a size; use e.g. 2GiB, 512MiB or a number of bytes")
    unit = (match.group(2) or "").upper()[:1]
    return int(float(match.group(1)) * _UNITS[unit])
