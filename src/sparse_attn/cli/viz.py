"""``sparse-attn viz``: draw a pattern's block grid (a few heads side by side) to a PNG."""
from __future__ import annotations

import argparse
from pathlib import Path

from ._common import (PATTERN_OPTION_DESTS, Once, add_pattern_options, console, error, flag_of, nonneg_tokens,
                      positive_int, positive_tokens, seed_arg, usage_error, writable_dir)

DESCRIPTION = """Draw the block grid of a pattern: full blocks blue, partial blocks (element mask
applied inside) orange, skipped blocks white; the title gives the layout's density (whole
blocks). Per-head patterns (random, bigbird) draw up to --show-heads heads side by side.

PATTERN is a builder of sparse_attn.patterns (dense, causal, local, streaming, block_diagonal,
strided, dilated, random, bigbird) or several joined by '|' (union) or '&' (intersection),
evaluated left to right, e.g. 'local|random'. Each builder takes the options below that it
accepts (one that no builder of PATTERN takes is refused); a required one left out gets a default
(window = L/8, num_sink = 64, block_size = L/8, stride = 4, window_blocks = 3, dilation = 2,
density = 0.2).

With --gallery DIR, draws every pattern family instead (the docs/gallery pictures), at --seq-len
with square --block-q blocks, at --dpi; the pattern options and --out, --close-up, --show-heads do
not apply there and are refused."""


def add_parser(sub) -> None:
    p = sub.add_parser("viz", help="draw a pattern's block grid to a PNG", description=DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("pattern", nargs="?", metavar="PATTERN", help="builder name or an 'a|b' / 'a&b' expression")
    p.add_argument("--out", type=Path, help="PNG to write (default: PATTERN.png with | and & spelled out)")
    g = p.add_argument_group("pattern options (tokens accept 8k / 128K)")
    g.add_argument("--seq-len", type=positive_tokens, default=4096, help="query length L (default 4096)")
    g.add_argument("--kv-len", type=positive_tokens, help="key length (default: L)")
    # defaults None (the builders' own 128): --gallery must tell a given --block-k from the default
    g.add_argument("--block-q", type=int, help="query block size (multiple of 16, 16..256; default 128)")
    g.add_argument("--block-k", type=int, help="key block size (default 128)")
    add_pattern_options(g)
    g.add_argument("--heads", type=positive_int, action=Once, help="random/bigbird: heads with their own layout")
    g.add_argument("--seed", type=seed_arg, action=Once, help="random/bigbird: RNG seed")
    g.add_argument("--causal", action=argparse.BooleanOptionalAction, default=None,
                   help="causal variant where the builder has one (default: the builder's)")
    d = p.add_argument_group("drawing")
    d.add_argument("--show-heads", type=positive_int,
                   help="at most this many heads side by side (default 4)")
    d.add_argument("--close-up", nargs="+", type=nonneg_tokens, metavar="N",
                   help="add a token-level panel: Q0 K0 ROWS [COLS] (tokens; head 0)")
    d.add_argument("--dpi", type=positive_int, default=110, help="PNG resolution (default 110)")
    d.add_argument("--gallery", type=Path, metavar="DIR", help="draw every pattern family into DIR instead")
    d.add_argument("--markdown", type=Path, metavar="FILE", help="with --gallery: also write a markdown page")
    p.set_defaults(func=run)


OPTION_NAMES = ("kv_len", "block_q", "block_k", "heads", "seed", "causal") + PATTERN_OPTION_DESTS
# what --gallery draws with (write_gallery's seq_len, block, markdown, dpi): anything else given is refused
GALLERY_IGNORES = tuple(n for n in OPTION_NAMES if n not in ("block_q", "block_k")) + ("out", "close_up",
                                                                                       "show_heads")


def pattern_options(args) -> dict:
    """The options the user gave (None: not given; the builders' own defaults apply)."""
    return {n: getattr(args, n) for n in OPTION_NAMES if getattr(args, n, None) is not None}


def default_out(pattern: str) -> Path:
    return Path(pattern.replace("|", "_or_").replace("&", "_and_").replace(" ", "") + ".png")


def output_path(out: Path, flag: str = "--out") -> Path:
    """``out`` (``.png`` added when it has no suffix: matplotlib wrote that file under another name), in a
    folder it can be written to and with a format matplotlib writes; else exit 2 (naming ``flag``)
    before drawing."""
    from matplotlib.figure import Figure
    if not out.suffix:
        out = out.with_name(out.name + ".png")
    formats = Figure().canvas.get_supported_filetypes()
    if out.suffix[1:].lower() not in formats:
        usage_error(f"{flag} {out}: matplotlib cannot write {out.suffix!r} files; use one of "
                    f"{', '.join('.' + f for f in sorted(formats))}")
    writable_dir(out.parent, flag)
    return out


def gallery(args, con) -> int:
    from rich.markup import escape
    from .. import viz
    from ..layout import check_block_size
    if args.pattern:  # the gallery draws its own families: PATTERN was ignored without a word
        usage_error(f"give a PATTERN ({args.pattern}) or --gallery DIR (every family), not both")
    block = args.block_q if args.block_q is not None else 128
    ignored = [flag_of(n) for n in GALLERY_IGNORES if getattr(args, n, None) is not None]
    if args.block_k is not None and args.block_k != block:  # the gallery draws square blocks
        ignored.insert(0, flag_of("block_k"))
    if ignored:  # each was dropped without a word (the page even said 64x64 blocks for --block-k 32)
        usage_error(f"--gallery draws every family with its own options at --seq-len with square --block-q "
                    f"blocks and does not use {', '.join(ignored)} (draw one pattern with them: "
                    f"sparse-attn viz PATTERN ...)")
    try:  # before the folders are made (a bad block ended in a LayoutError traceback)
        check_block_size("--block-q", block)
    except ValueError as e:
        usage_error(str(e))
    writable_dir(args.gallery, "--gallery")
    if args.markdown is not None:
        writable_dir(args.markdown.parent, "--markdown")
    try:
        paths = viz.write_gallery(args.gallery, seq_len=args.seq_len, block=block, markdown=args.markdown,
                                  dpi=args.dpi)
    except (ValueError, TypeError) as e:  # e.g. a --seq-len some family cannot be built at
        return error(f"--gallery: {escape(str(e))}")
    con.print(f"wrote {len(paths)} pictures to {args.gallery}" + (f" and {args.markdown}" if args.markdown else ""))
    return 0


def run(args) -> int:
    from rich.markup import escape
    from .. import viz
    con = console()
    if args.gallery is not None:
        return gallery(args, con)
    if not args.pattern:
        return error(f"give a PATTERN (or --gallery DIR); choose from {', '.join(viz.pattern_names())}")
    if args.markdown is not None:  # the help says "with --gallery": without it nothing was written, exit 0
        usage_error(f"--markdown {args.markdown} writes the gallery's page: give it with --gallery DIR")
    close_up = None
    if args.close_up:
        if len(args.close_up) not in (3, 4):
            return error("--close-up takes Q0 K0 ROWS [COLS]")
        if min(args.close_up[2:]) < 1:
            return error(f"--close-up ROWS and COLS must be positive, got {args.close_up[2:]}")
        close_up = viz.CloseUp(*args.close_up)
    from ..patterns.expr import unused_options
    given = pattern_options(args)
    unused = [flag_of(n) for n in unused_options(args.pattern, given)]
    if unused:  # build_pattern drops what no builder takes: `viz dense --window 5` drew plain dense
        usage_error(f"pattern option(s) {', '.join(unused)} apply to no builder of {args.pattern!r}; give them "
                    f"to a pattern that takes them (see sparse-attn viz --help)")
    try:
        layout = viz.build_pattern(args.pattern, args.seq_len, **given)
    except (ValueError, TypeError) as e:
        return error(f"cannot build {escape(repr(args.pattern))}: {escape(str(e))}")
    if close_up is not None and (close_up.q0 >= layout.q_len or close_up.k0 >= layout.kv_len):
        return error(f"--close-up Q0 K0 = {close_up.q0} {close_up.k0} lies outside the {layout.q_len} x "
                     f"{layout.kv_len} attention matrix")
    out = output_path(args.out or default_out(args.pattern))
    viz.save(viz.draw_layout(layout, name=args.pattern, max_heads=args.show_heads or 4, close_up=close_up,
                             dpi=args.dpi), out)
    con.print(f"wrote {out}: {args.pattern}, L={layout.q_len}, blocks {layout.block_q}x{layout.block_k}, "
              f"{'one layout for all heads' if layout.heads == 1 else f'{layout.heads} per-head layouts'}, "
              f"density {layout.density:.4f}")
    return 0
