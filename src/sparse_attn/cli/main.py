"""``sparse-attn``: benchmark, draw and demo the block-sparse attention library.

Run ``sparse-attn COMMAND --help`` for a command's options; ``python -m sparse_attn.cli.main``
works the same. Each subcommand module exposes ``add_parser(subparsers)`` and sets ``func``.
"""
from __future__ import annotations

import argparse
import sys

EPILOG = """examples:
  sparse-attn demo                                  run a benchmark suite and draw the pattern gallery
  sparse-attn bench --device cpu                    the CPU-sized 'small' suite -> out/bench/
  sparse-attn bench --suite kernels --device cuda --patterns 'random*' --seq-lens 32k
  sparse-attn bench --list                          suites and providers (and why some cannot run)
  sparse-attn bench --suite report-gpu --plan       the long-context report cut into slices (estimated times)
  sparse-attn report --from runs/ --out-dir out/report   merge sliced results into report.md + plots
  sparse-attn viz streaming --seq-len 8k --window 1024 --num-sink 64 --out streaming.png
  sparse-attn viz 'local|random' --density 0.1 --heads 4 --out mix.png
  sparse-attn quick --seq-len 4096 --causal          dense vs adaptive-sparse on one input, pass/fail
  sparse-attn accuracy --quick --sweep              accuracy suite: report, attention-map PNGs, threshold sweep
  sparse-attn eval-model --patterns streaming --window 1024 --lengths 1k 2k   dense vs sparse model logits
  sparse-attn sage-test --test-correctness --benchmark-perf   8-bit attention on SageAttention block indices
"""


def build_parser() -> argparse.ArgumentParser:
    from . import accuracy, bench, demo, eval_model, quick, report, sage_test, viz
    from .. import __version__
    parser = argparse.ArgumentParser(
        prog="sparse-attn", description="Block-sparse FlashAttention: benchmarks, pattern pictures, demo.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"sparse_attn {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in (bench, viz, demo, report, quick, accuracy, eval_model, sage_test):
        module.add_parser(sub)
    return parser


def hyphenate_options(argv: list[str]) -> list[str]:
    """``--seq_len 512`` / ``--quant_gran=per_warp`` -> ``--seq-len`` / ``--quant-gran=per_warp``.

    The tools this CLI stands in for (the SageAttention test suite, SpargeAttn's quick test) spell
    their flags with underscores, so command lines copied from their READMEs work here too. Only
    option names are rewritten (never values, and nothing after a bare ``--``); every option of
    this CLI is hyphenated, so no name is ambiguous.
    """
    out = []
    for i, token in enumerate(argv):
        if token == "--":
            return out + list(argv[i:])
        if token.startswith("--") and "_" in token.split("=", 1)[0]:
            name, eq, value = token.partition("=")
            token = name.replace("_", "-") + eq + value
        out.append(token)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(hyphenate_options(list(argv)))
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
