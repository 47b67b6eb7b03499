"""Metadata filters: `{"field": value}` on a request, every pair required (AND).

A filter is applied inside the engine (FAISS: an ID selector over the matching rows; Milvus: a
boolean expression), so a filtered query still gets its k best matches, not k best then fewer.
`Where` is the canonical hashable form: a batch groups its queries by it, one search each.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from service.errors import InputError

Scalar = str | int | float | bool
# sorted (field, type name, value): the type keeps `true` and `1` apart, which Python's
# equality would not, so two such filters never share a batch's search
Where = tuple[tuple[str, str, Scalar], ...]
FIELD = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
INT64 = 2**63


def where_of(mapping: Mapping[str, Scalar] | None, fields: Iterable[str]) -> Where | None:
    """The canonical filter of a request's mapping, checked against the catalog's metadata
    `fields` (InputError, a 422, for an unknown or malformed field or a non-scalar value)."""
    if not mapping:
        return None
    known = set(fields)
    for name, value in mapping.items():
        if not FIELD.fullmatch(name):
            raise InputError(f"filter field {name!r} is not a field name")
        if name not in known:
            listed = ", ".join(sorted(known)) or "none"
            raise InputError(f"filter field {name!r} is not in the catalog's metadata "
                             f"(fields: {listed})")
        if not isinstance(value, Scalar):
            raise InputError(f"filter value of {name!r} must be a string, number or boolean")
        if isinstance(value, str) and not value.isprintable():
            raise InputError(f"filter value of {name!r} holds a control character")
        if (isinstance(value, float) and not math.isfinite(value)) or (
                isinstance(value, int) and not -INT64 <= value < INT64):
            raise InputError(f"filter value of {name!r} must be finite and fit in 64 bits")
    return tuple(sorted((name, type(value).__name__, value) for name, value in mapping.items()))


def expression(where: Where) -> str:
    """Milvus's boolean expression for a filter: `a == "x" and b == 2`."""
    return " and ".join(f"{name} == {literal(value)}" for name, _, value in where)


def literal(value: Scalar) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):  # double-quoted; Milvus's parser knows no \\u escapes: raw UTF-8
        return json.dumps(value, ensure_ascii=False)
    return repr(value)


def metadata_fields(metadata: Sequence[Mapping[str, object]]) -> set[str]:
    """Every field with a scalar value in some item's metadata."""
    return {name for record in metadata for name, value in record.items()
            if isinstance(value, Scalar)}


class RowFilter:
    """Catalog rows matching a filter, from the items' metadata (for in-process indexes)."""

    def __init__(self, metadata: Sequence[Mapping[str, object]]) -> None:
        self.metadata = metadata
        self._by_field: dict[str, dict[object, np.ndarray]] = {}

    def rows(self, where: Where) -> np.ndarray:
        """(M,) int64 sorted rows whose metadata has every (field, value) of `where`."""
        out: np.ndarray | None = None
        for name, _, value in where:
            found = self._values(name).get(_key(value), np.zeros(0, dtype=np.int64))
            out = found if out is None else np.intersect1d(out, found, assume_unique=True)
        return out if out is not None else np.arange(len(self.metadata), dtype=np.int64)

    def _values(self, name: str) -> dict[object, np.ndarray]:
        if name not in self._by_field:
            groups: dict[object, list[int]] = {}
            for row, record in enumerate(self.metadata):
                if name in record:
                    groups.setdefault(_key(record[name]), []).append(row)
            self._by_field[name] = {v: np.asarray(r, dtype=np.int64) for v, r in groups.items()}
        return self._by_field[name]


def _key(value: object) -> object:
    """Equality as Milvus sees it: 1 == 1.0, but True is not 1 and "1" is not 1."""
    return (type(value) is bool, value)
