"""Strict JSON for every result file the tools write.

Python's ``json`` writes ``NaN`` / ``Infinity`` for non-finite floats by default, which is not JSON:
strict parsers (``jq``, JavaScript's ``JSON.parse``, Go, Rust's serde_json) reject the whole file. A
metric can be non-finite for honest reasons (cosine of an all-zero output, a failed timing), so the
writers map non-finite floats to ``null`` and then refuse anything else non-finite (``allow_nan=False``).
The readers already treat ``None`` as "no value" (rendered as ``-``).
"""
from __future__ import annotations

import json
import math
from pathlib import Path


def _python_scalar(obj):
    """A numpy or torch scalar (numpy number, 0-d array or tensor) as a Python number; anything else as is."""
    if type(obj).__module__.partition(".")[0] in ("numpy", "torch") and getattr(obj, "shape", None) == ():
        return obj.item()
    return obj


def json_safe(obj):
    """``obj`` with every non-finite float (nan, inf, -inf), at any depth, replaced by ``None``; numpy and
    torch scalars become Python numbers first (a NaN in one went out as the string 'nan' or
    'tensor(nan)' under ``default=str``, and failed under ``default=float``)."""
    obj = _python_scalar(obj)
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def dumps(payload, *, default=None) -> str:
    """Strict JSON text of ``payload`` (indent 1; non-finite floats as ``null``)."""
    return json.dumps(json_safe(payload), indent=1, allow_nan=False, default=default)


def write_text_atomic(path, text: str) -> Path:
    """Write ``text`` to ``path`` through a temporary file, so an interrupted run never leaves half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return path
