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


def add_accuracy_options(p: argparse.ArgumentParser) -> None:
    """Options shared by ``quick`` and ``accuracy``: input device/dtype/shape/seed and the pass/fail
    thresholds (cosine > 0.95, relative L1 < 0.1, sparsity > 5% by default)."""
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available, else cpu)")
    p.add_argument("--dtype", choices=["fp32", "fp16", "bf16"], help="input dtype (default: fp32 on cpu, bf16 on cuda)")
    p.add_argument("--head-dim", type=int, default=64, help="head dim (default 64)")
    p.add_argument("--seed", type=int, default=0, help="input seed (default 0)")
    t = p.add_argument_group("thresholds")
    t.add_argument("--min-cosine", type=float, default=0.95, help="pass if cosine > this (default 0.95)")
    t.add_argument("--max-l1", type=float, default=0.1, help="pass if relative L1 < this (default 0.1)")
    t.add_argument("--min-sparsity", type=float, default=0.05, help="pass if sparsity > this (default 0.05)")
