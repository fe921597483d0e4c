"""``sparse-attn viz``: draw a pattern's block grid (a few heads side by side) to a PNG."""
from __future__ import annotations

import argparse
from pathlib import Path

from ._common import (Once, add_pattern_options, console, nonneg_tokens, positive_int, positive_tokens, usage_error,
                      writable_dir)

DESCRIPTION = """Draw the block grid of a pattern: full blocks blue, partial blocks (element mask
applied inside) orange, skipped blocks white; the title gives the layout's density (whole
blocks). Per-head patterns (random, bigbird) draw up to --show-heads heads side by side.

PATTERN is a builder of sparse_attn.patterns (dense, causal, local, streaming, block_diagonal,
strided, dilated, random, bigbird) or several joined by '|' (union) or '&' (intersection),
evaluated left to right, e.g. 'local|random'. Each builder takes the options below that it
accepts; a required one left out gets a default (window = L/8, num_sink = 64, block_size = L/8,
stride = 4, window_blocks = 3, dilation = 2, density = 0.2).

With --gallery DIR, draws every pattern family instead (the docs/gallery pictures)."""


def add_parser(sub) -> None:
    p = sub.add_parser("viz", help="draw a pattern's block grid to a PNG", description=DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("pattern", nargs="?", metavar="PATTERN", help="builder name or an 'a|b' / 'a&b' expression")
    p.add_argument("--out", type=Path, help="PNG to write (default: PATTERN.png with | and & spelled out)")
    g = p.add_argument_group("pattern options (tokens accept 8k / 128K)")
    g.add_argument("--seq-len", type=positive_tokens, default=4096, help="query length L (default 4096)")
    g.add_argument("--kv-len", type=positive_tokens, help="key length (default: L)")
    g.add_argument("--block-q", type=int, default=128, help="query block size (multiple of 16, 16..256; default 128)")
    g.add_argument("--block-k", type=int, default=128, help="key block size (default 128)")
    add_pattern_options(g)
    g.add_argument("--heads", type=positive_int, action=Once, help="random/bigbird: heads with their own layout")
    g.add_argument("--seed", type=int, action=Once, help="random/bigbird: RNG seed")
    g.add_argument("--causal", action=argparse.BooleanOptionalAction, default=None,
                   help="causal variant where the builder has one (default: the builder's)")
    d = p.add_argument_group("drawing")
    d.add_argument("--show-heads", type=positive_int, default=4,
                   help="at most this many heads side by side (default 4)")
    d.add_argument("--close-up", nargs="+", type=nonneg_tokens, metavar="N",
                   help="add a token-level panel: Q0 K0 ROWS [COLS] (tokens; head 0)")
    d.add_argument("--dpi", type=positive_int, default=110, help="PNG resolution (default 110)")
    d.add_argument("--gallery", type=Path, metavar="DIR", help="draw every pattern family into DIR instead")
    d.add_argument("--markdown", type=Path, metavar="FILE", help="with --gallery: also write a markdown page")
    p.set_defaults(func=run)


def pattern_options(args) -> dict:
    names = ("kv_len", "block_q", "block_k", "window", "window_right", "num_sink", "block_size", "stride",
             "local_blocks", "window_blocks", "dilation", "num_global_blocks", "num_random_blocks", "density",
             "top_k", "heads", "seed", "causal", "exponential")
    return {n: getattr(args, n) for n in names if getattr(args, n) is not None}


def default_out(pattern: str) -> Path:
    return Path(pattern.replace("|", "_or_").replace("&", "_and_").replace(" ", "") + ".png")


def output_path(out: Path) -> Path:
    """``out`` (``.png`` added when it has no suffix: matplotlib wrote that file under another name), in a
    folder it can be written to and with a format matplotlib writes; else exit 2 before drawing."""
    from matplotlib.figure import Figure
    if not out.suffix:
        out = out.with_name(out.name + ".png")
    formats = Figure().canvas.get_supported_filetypes()
    if out.suffix[1:].lower() not in formats:
        usage_error(f"--out {out}: matplotlib cannot write {out.suffix!r} files; use one of "
                    f"{', '.join('.' + f for f in sorted(formats))}")
    writable_dir(out.parent, "--out")
    return out


def run(args) -> int:
    from rich.markup import escape
    from .. import viz
    con = console()
    if args.gallery is not None:
        if args.pattern:  # the gallery draws its own families: PATTERN was ignored without a word
            usage_error(f"give a PATTERN ({args.pattern}) or --gallery DIR (every family), not both")
        writable_dir(args.gallery, "--gallery")
        if args.markdown is not None:
            writable_dir(args.markdown.parent, "--markdown")
        paths = viz.write_gallery(args.gallery, seq_len=args.seq_len, block=args.block_q, markdown=args.markdown,
                                  dpi=args.dpi)
        con.print(f"wrote {len(paths)} pictures to {args.gallery}" + (f" and {args.markdown}" if args.markdown else ""))
        return 0
    if not args.pattern:
        con.print("[red]give a PATTERN (or --gallery DIR); choose from "
                  f"{', '.join(viz.pattern_names())}[/red]")
        return 2
    close_up = None
    if args.close_up:
        if len(args.close_up) not in (3, 4):
            con.print("[red]--close-up takes Q0 K0 ROWS [COLS][/red]")
            return 2
        if min(args.close_up[2:]) < 1:
            con.print(f"[red]--close-up ROWS and COLS must be positive, got {args.close_up[2:]}[/red]")
            return 2
        close_up = viz.CloseUp(*args.close_up)
    try:
        layout = viz.build_pattern(args.pattern, args.seq_len, **pattern_options(args))
    except (ValueError, TypeError) as e:
        con.print(f"[red]cannot build {escape(repr(args.pattern))}: {escape(str(e))}[/red]")
        return 2
    if close_up is not None and (close_up.q0 >= layout.q_len or close_up.k0 >= layout.kv_len):
        con.print(f"[red]--close-up Q0 K0 = {close_up.q0} {close_up.k0} lies outside the {layout.q_len} x "
                  f"{layout.kv_len} attention matrix[/red]")
        return 2
    out = output_path(args.out or default_out(args.pattern))
    viz.save(viz.draw_layout(layout, name=args.pattern, max_heads=args.show_heads, close_up=close_up), out,
             dpi=args.dpi)
    con.print(f"wrote {out}: {args.pattern}, L={layout.q_len}, blocks {layout.block_q}x{layout.block_k}, "
              f"{'one layout for all heads' if layout.heads == 1 else f'{layout.heads} per-head layouts'}, "
              f"density {layout.density:.4f}")
    return 0
