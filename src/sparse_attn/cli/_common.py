"""Small helpers shared by the subcommands."""
from __future__ import annotations

import argparse
import sys


def tokens(text: str) -> int:
    """An int with an optional k/K (x1024) or m/M (x1024^2) suffix: ``4096``, ``8k``, ``128K``."""
    t = text.strip()
    mult = 1
    if t[-1:].lower() == "k":
        t, mult = t[:-1], 1024
    elif t[-1:].lower() == "m":
        t, mult = t[:-1], 1024 * 1024
    try:
        value = int(t) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer like 4096, 8k or 128K, got {text!r}") from None
    return value


def split_list(values: list[str] | None) -> list[str] | None:
    """``["a,b", "c"] -> ["a", "b", "c"]`` (lists may be given with spaces or commas)."""
    if not values:
        return None
    return [v for item in values for v in item.split(",") if v]


def console():
    from rich.console import Console
    return Console(width=None if sys.stdout.isatty() else 160, highlight=False)


def default_device() -> str:
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"
