"""Small helpers shared by the subcommands."""
from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path


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


def _at_least(parse, low: int, what: str):
    """An argparse type: ``parse`` then refuse values below ``low`` (a length, count or size of 0 or
    less ran on empty or wrongly sliced inputs, or failed deep inside with a traceback)."""
    def check(text: str) -> int:
        value = parse(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
        return value
    check.__name__ = f"{what} {parse.__name__}"
    return check


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


positive_int = _at_least(_integer, 1, "a positive integer")
nonneg_int = _at_least(_integer, 0, "an integer >= 0")
positive_tokens = _at_least(tokens, 1, "a positive length like 4096, 8k or 128K")
nonneg_tokens = _at_least(tokens, 0, "a length >= 0 like 0, 4096 or 8k")


def seed_arg(text: str) -> int:
    """An argparse type for --seed: an integer in [0, 2**64), what a torch.Generator takes (a larger one
    failed as a check or row deep in the run with 'Overflow when unpacking long long')."""
    value = nonneg_int(text)
    if value >= 1 << 64:
        raise argparse.ArgumentTypeError(f"must be below 2**64 (a torch.Generator seed), got {text!r}")
    return value


def device_arg(text: str) -> str:
    """An argparse type for --device: cpu or cuda[:N], refused at once when this machine cannot run it
    (a CUDA device on a torch without CUDA ended in 'Torch not compiled with CUDA enabled' tracebacks
    deep in the work, some only after the first results)."""
    import torch
    try:
        device = torch.device(text.strip())
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"expected cpu or cuda[:N], got {text!r}") from None
    if device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"expected cpu or cuda[:N], got {text!r}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(f"got {text!r} but torch.cuda.is_available() is False "
                                             f"(torch {torch.__version__}): use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(f"got {text!r} but there are {torch.cuda.device_count()} CUDA "
                                             f"devices (cuda:0..cuda:{torch.cuda.device_count() - 1})")
    return text.strip()


class Once(argparse.Action):
    """Store an option's value, refusing the option a second time. argparse keeps the last value
    silently; for pattern options that hid a mistake: in ``'dilated|dilated' --dilation 1 --dilation 2``
    every builder of the expression gets the one set of options, so both drew dilation 2."""

    def __call__(self, parser, namespace, values, option_string=None):
        given = namespace.__dict__.setdefault("_given_once", set())
        if self.dest in given:
            parser.error(f"{option_string} given twice; every builder of a pattern expression takes the same "
                         f"options (for different values, build the layouts in Python and join them with |)")
        given.add(self.dest)
        setattr(namespace, self.dest, values)


# Builder arguments of sparse_attn.patterns as command-line options (viz, bench): flag, type, help.
PATTERN_OPTIONS = (
    ("--window", tokens, "local/streaming: window in tokens"),
    ("--window-right", tokens, "local: keys after the query (non-causal windows)"),
    ("--num-sink", tokens, "streaming: sink tokens at the start"),
    ("--block-size", tokens, "block_diagonal: document length in tokens"),
    ("--stride", int, "strided: every STRIDE-th key block is a summary block"),
    ("--local-blocks", int, "strided: width of the local band in blocks"),
    ("--window-blocks", int, "dilated/bigbird: window in blocks"),
    ("--dilation", int, "dilated: step between visited key blocks"),
    ("--num-global-blocks", int, "bigbird: global blocks"),
    ("--num-random-blocks", int, "bigbird: random blocks per row"),
    ("--density", float, "random: fraction of key blocks per row"),
    ("--top-k", int, "random: key blocks per row (instead of --density)"),
)


PATTERN_OPTION_DESTS = tuple(flag[2:].replace("-", "_") for flag, _, _ in PATTERN_OPTIONS) + ("exponential",)


def flag_of(dest: str) -> str:
    """An argparse destination as its command-line flag: ``block_k`` -> ``--block-k``."""
    return "--" + dest.replace("_", "-")


def add_pattern_options(group) -> tuple[str, ...]:
    """Add :data:`PATTERN_OPTIONS` (each at most once per command line, :class:`Once`) and
    ``--exponential`` to ``group``; returns their argparse dests."""
    for flag, kind, text in PATTERN_OPTIONS:
        group.add_argument(flag, type=kind, action=Once, help=text)
    group.add_argument("--exponential", action="store_true", default=None,
                       help="dilated: offsets 0, d, 2d, 4d, ... (d = --dilation) instead of 0, d, 2d, 3d, ...")
    return PATTERN_OPTION_DESTS


def usage_error(message: str):
    """A bad option found after parsing: one line on stderr and exit code 2, as argparse's own errors."""
    print(f"sparse-attn: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def error(message: str, code: int = 2) -> int:
    """Print ``message`` (rich markup; escape what it quotes) in red on stderr and return ``code`` for the
    command to return. Errors printed through the stdout console vanished with ``>/dev/null`` or into the
    results of ``> out.txt``, while argparse's and :func:`usage_error`'s went to stderr."""
    from rich.console import Console
    Console(stderr=True, width=None if sys.stderr.isatty() else 160, highlight=False).print(f"[red]{message}[/red]")
    return code


def file_stem(text: str) -> str:
    """An argparse type for ``--name``: a file name in the output folder, not a path. ``--name sub/x``
    failed with FileNotFoundError after the whole run (the subfolder was never created)."""
    import os
    seps = {os.sep, "/"} | ({os.altsep} if os.altsep else set())
    if not text.strip() or text in (".", "..") or any(s in text for s in seps):
        raise argparse.ArgumentTypeError(f"expected a file name without a folder, got {text!r}; "
                                         "choose the folder with --out-dir")
    return text


def writable_dir(path, flag: str) -> Path:
    """Create the output folder ``path`` now and check that a file can be written in it, so that a bad
    ``flag`` fails before the work starts (it failed with a traceback after it, e.g. after a whole
    model evaluation); exits with code 2 when it cannot."""
    import tempfile
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        usage_error(f"{flag} {path}: cannot write there ({e.strerror or e}); give a folder you can write to")
    return path


@contextlib.contextmanager
def device_scope(device: str, threads: int | None, default: int = 1):
    """Run the block on ``device``. On a CPU with torch's intra-op threads at ``threads`` (None:
    ``default``; 0: torch's own), restoring the count after. One thread by default: on a busy shared
    machine torch's spinning OpenMP threads made CPU timings noise (dense SDPA 48 ms instead of 0.7 ms).
    On CUDA with ``device`` (e.g. ``cuda:1``) as the current device: CUDA events, the L2 flush buffer
    and the memory counters the timing uses follow the current device, which stayed cuda:0."""
    import torch
    if str(device).startswith("cuda"):
        with torch.cuda.device(torch.device(device)):
            yield
        return
    n = default if threads is None else threads
    if n <= 0:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


CPU_TIMING_NOTE = ("CPU timings are indicative only (the PyTorch reference path on a possibly shared machine), "
                   "not kernel performance")


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
    p.add_argument("--device", type=device_arg, default=None,
                   help="cpu or cuda (default: cuda when available, else cpu)")
    p.add_argument("--dtype", choices=ACCURACY_DTYPES,
                   help="input dtype (default: fp32 on cpu, bf16 on cuda; the CUDA kernels take fp16 or bf16)")
    p.add_argument("--head-dim", type=positive_int, default=64, help="head dim (default 64)")
    p.add_argument("--seed", type=seed_arg, default=0, help="input seed (default 0)")
    t = p.add_argument_group("thresholds")
    below_1 = "a number below 1 ({} > 1 never passes)"
    t.add_argument("--min-cosine", type=threshold_type(below_1.format("cosine"), lambda x: x < 1),
                   default=0.95, help="pass if cosine > this (default 0.95)")
    t.add_argument("--max-l1", type=threshold_type("a number above 0 (relative L1 < 0 never passes)", lambda x: x > 0),
                   default=0.1, help="pass if relative L1 < this (default 0.1)")
    t.add_argument("--min-sparsity", type=threshold_type(below_1.format("sparsity"), lambda x: x < 1),
                   default=0.05, help="pass if sparsity > this (default 0.05)")


ACCURACY_DTYPES = ("fp32", "fp16", "bf16")  # --dtype of add_accuracy_options (bench.suites.DTYPES names)


def accuracy_dtype(name: str | None, device: str, head_dim: int | None = None):
    """The torch dtype of ``--dtype name`` (None: bf16 on CUDA, fp32 on the CPU) for inputs on ``device``.
    On CUDA the block-sparse kernels take fp16/bf16 and head dims up to 256 (``head_dim`` None: not known
    yet, e.g. read from a file later): ``accuracy --dtype fp32`` there ended in a TypeError traceback at
    its first case. Those are usage errors (exit 2) before any input is made."""
    name = name or ("bf16" if str(device).startswith("cuda") else "fp32")
    if str(device).startswith("cuda"):
        from ..ops.block_sparse import MAX_HEAD_DIM
        if name == "fp32":
            usage_error(f"--dtype fp32 on {device}: the CUDA kernels take fp16 or bf16; give --dtype bf16 or "
                        "--dtype fp16, or --device cpu (the fp32 PyTorch reference)")
        if head_dim is not None and head_dim > MAX_HEAD_DIM:
            usage_error(f"--head-dim {head_dim} on {device}: the CUDA kernels take head dims up to {MAX_HEAD_DIM}; "
                        "give a smaller --head-dim, or --device cpu (the PyTorch reference)")
    from ..bench.suites import DTYPES
    return DTYPES[name]


def threshold_type(rule: str, ok):
    """An argparse type for a pass/fail threshold: a float ``ok`` accepts (``rule`` says which, in errors). One no result can meet
    (--min-cosine 1, --max-l1 -1, nan) ran and failed whatever the attention did."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {rule}, got {text!r}") from None
        if value != value or not ok(value):
            raise argparse.ArgumentTypeError(f"must be {rule}, got {text!r}")
        return value
    parse.__name__ = "threshold"
    return parse
