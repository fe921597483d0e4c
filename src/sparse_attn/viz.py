"""Drawing BlockLayouts: the block grid of a few heads side by side, and token-level close-ups.

    from sparse_attn import viz, patterns
    fig = viz.draw_layout(patterns.local(4096, window=1024), name="local")
    viz.save(fig, "local.png")

Blocks are drawn in three states: absent (white), *full* (blue: no element mask) and *partial*
(orange: the element mask applies inside). matplotlib is imported lazily (``pip install
sparse_attn[bench]``), with the non-interactive Agg backend.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .layout import BlockLayout, as_int

ABSENT, FULL, PARTIAL = 0, 1, 2
COLORS = ("#ffffff", "#2b5c9e", "#f0962e")  # absent, full, partial
TOKEN_COLORS = ("#ffffff", "#2b5c9e")        # masked, attended


def _plt():
    import matplotlib
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    return plt


def _pick(name: str, i, n: int) -> int:
    """Index ``i`` into a layout dimension of size ``n``: a size-1 dimension broadcasts (any index
    reads entry 0); otherwise ``0 <= i < n`` or a ValueError (an out-of-range index was clamped and the
    panel labelled with the index asked for, showing another head)."""
    v = as_int(i)
    if v is None:
        raise TypeError(f"{name} must be an int, got {type(i).__name__} {i!r}")
    if v < 0 or (n > 1 and v >= n):
        raise ValueError(f"{name}={i}, but the layout has {n} (valid: 0..{n - 1}; a layout of 1 serves any)")
    return 0 if n == 1 else v


def _check_layout(layout, fn: str) -> None:
    if not isinstance(layout, BlockLayout):
        raise TypeError(f"{fn} draws a BlockLayout, got {type(layout).__name__}; build one with "
                        "sparse_attn.patterns or BlockLayout.from_block_mask")


# ----------------------------------------------------------------------------- data
def block_states(layout) -> torch.Tensor:
    """int8 ``[Bl, Hl, Qb, Kb]`` on the CPU: 0 absent, 1 full, 2 partial."""
    lay = layout.to("cpu")
    out = torch.zeros(lay.batch, lay.heads, lay.num_q_blocks, lay.num_kv_blocks + 1, dtype=torch.int8)
    valid = torch.arange(lay.max_k) < lay.kv_counts[..., None]
    idx = torch.where(valid, lay.kv_indices.long(), lay.num_kv_blocks)  # padding -> spill column
    state = torch.where(lay.kv_mask_ids >= 0, PARTIAL, FULL).to(torch.int8)
    out.scatter_(3, idx, state)
    return out[..., :lay.num_kv_blocks]


def token_region(layout, q0: int, k0: int, rows: int, cols: int | None = None, *, batch: int = 0,
                 head: int = 0) -> torch.Tensor:
    """bool ``[rows, cols]`` (clipped to the layout): the exact pattern of queries ``q0..`` x keys ``k0..``."""
    from .reference import token_mask_rows
    _check_layout(layout, "token_region")
    batch, head = _pick("batch", batch, layout.batch), _pick("head", head, layout.heads)
    if q0 < 0 or k0 < 0 or q0 >= max(layout.q_len, 1) or k0 >= max(layout.kv_len, 1):
        raise ValueError(f"token_region starts at query {q0}, key {k0}: both must lie in the layout "
                         f"(0..{layout.q_len - 1} x 0..{layout.kv_len - 1})")
    lay = layout.to("cpu")
    q1, k1 = min(q0 + rows, lay.q_len), min(k0 + (rows if cols is None else cols), lay.kv_len)
    rows = []
    r = q0
    while r < q1:
        r_end = min(q1, (r // lay.block_q + 1) * lay.block_q)
        m = token_mask_rows(lay, r, r_end)
        rows.append(m[batch, head, :, k0:k1])
        r = r_end
    return torch.cat(rows, 0) if rows else torch.zeros(0, max(k1 - k0, 0), dtype=torch.bool)


# a drawn block grid has at most this many cells a side: a panel's axes are ~300 pixels wide, and
# matplotlib's own resampling of a finer grid drops single visited blocks (BigBird's global row)
MAX_CELLS = 256


def cells_for(panel_inches: float, dpi: int) -> int:
    """Cells a side a panel of ``panel_inches`` shows at ``dpi`` without dropping any (a square axes box
    takes ~0.85 of the panel's width; 0.7 leaves room): at most :data:`MAX_CELLS`. At --dpi 72 a fixed
    256 lost 23 of 127 single visited columns to resampling."""
    return max(8, min(MAX_CELLS, int(0.7 * panel_inches * dpi)))


def pooled_states(layout, batch: int = 0, head: int = 0, max_cells: int = MAX_CELLS) -> tuple[torch.Tensor, int, int]:
    """One head's block states pooled to at most ``max_cells`` a side, built from its listed blocks
    (no ``[Qb, Kb]`` grid: 16K x 16K at 1M tokens in 64-blocks, which matplotlib turned into >12 GiB).

    Returns (int8 ``[ceil(Qb / fq), ceil(Kb / fk)]``, fq, fk): each cell covers ``fq x fk`` blocks and
    shows the strongest state among them (partial over full over absent), so a visited block is
    never hidden by pooling. ``fq = fk = 1`` when the grid fits (then it equals :func:`block_states`).
    """
    _check_layout(layout, "pooled_states")
    if as_int(max_cells) is None or max_cells < 1:
        raise ValueError(f"max_cells must be an int >= 1, got {max_cells!r}")
    b, h = _pick("batch", batch, layout.batch), _pick("head", head, layout.heads)
    lay = layout.to("cpu")
    nq, nk = lay.num_q_blocks, lay.num_kv_blocks
    fq, fk = max(1, math.ceil(nq / max_cells)), max(1, math.ceil(nk / max_cells))
    counts, idx, mid = lay.kv_counts[b, h], lay.kv_indices[b, h].long(), lay.kv_mask_ids[b, h]
    valid = torch.arange(lay.max_k) < counts[:, None].long()
    qb = torch.arange(nq)[:, None].expand_as(idx)[valid]
    cell = (qb // fq) * math.ceil(nk / fk) + idx[valid] // fk
    state = torch.where(mid[valid] >= 0, PARTIAL, FULL).to(torch.int8)
    out = torch.zeros(math.ceil(nq / fq) * math.ceil(nk / fk), dtype=torch.int8)
    out.scatter_reduce_(0, cell, state, reduce="amax")
    return out.view(math.ceil(nq / fq), math.ceil(nk / fk)), fq, fk


def per_head_density(states: torch.Tensor) -> torch.Tensor:
    """float ``[Bl, Hl]``: fraction of each head's grid that is visited."""
    return (states > 0).float().mean(dim=(-1, -2))


# ----------------------------------------------------------------------------- drawing
@dataclass
class CloseUp:
    """A token-level panel: queries ``q0 .. q0+rows`` x keys ``k0 .. k0+cols`` of one head."""

    q0: int
    k0: int
    rows: int = 384
    cols: int | None = None  # default: rows (square)
    head: int = 0

    @property
    def width(self) -> int:
        return self.rows if self.cols is None else self.cols


def _fit(cu: CloseUp, layout) -> CloseUp | None:
    """``cu`` moved and cut to lie inside the layout (the gallery's close-ups are placed for 4K tokens;
    at a few hundred they fell off the matrix, titled with negative or empty ranges); None if nothing
    of it is left."""
    q0 = min(max(cu.q0, 0), max(layout.q_len - 1, 0))
    k0 = min(max(cu.k0, 0), max(layout.kv_len - 1, 0))
    rows = min(cu.rows, layout.q_len - q0)
    cols = min(cu.width, layout.kv_len - k0)
    if rows <= 0 or cols <= 0:
        return None
    return dataclasses.replace(cu, q0=q0, k0=k0, rows=rows, cols=cols)


def _heads_to_draw(n_heads: int, max_heads: int) -> list[int]:
    if n_heads <= max_heads:
        return list(range(n_heads))
    return sorted({round(i * (n_heads - 1) / (max_heads - 1)) for i in range(max_heads)}) if max_heads > 1 else [0]


def draw_layout(layout, *, name: str = "", heads: list[int] | None = None, max_heads: int = 4, batch: int = 0,
                close_up: CloseUp | None = None, panel_inches: float = 3.4, dpi: int = 110):
    """A figure: one block-grid panel per drawn head (+ an optional token close-up panel).

    Density in the title is the whole layout's (blocks visited / grid, all heads); each panel
    gives its head's own, and the legend counts the blocks of the drawn batch row and heads. Each
    panel is square whatever ``Lq / Lk`` (cells stretch: with square cells a 1K x 64K grid was 10
    pixels tall), pooled to what ``dpi`` (the figure's, used by :func:`save`) can show. The close-up's
    head is always among the drawn ones, so its red frame is there.
    """
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch, Rectangle
    _check_layout(layout, "draw_layout")
    b = _pick("batch", batch, layout.batch)
    auto = heads is None
    heads = list(heads) if heads is not None else _heads_to_draw(layout.heads, max_heads)
    cu_head = None if close_up is None else _pick("close_up.head", close_up.head, layout.heads)
    if cu_head is not None and heads and cu_head not in heads:  # else the title's red frame was nowhere
        heads = sorted((heads[:-1] if auto and len(heads) >= max_heads else heads) + [cu_head])
    if not heads:
        raise ValueError("draw_layout: heads=[] draws nothing; pass at least one head index, or None for up to "
                         "max_heads of them")
    if any(as_int(h) is None or not 0 <= h < layout.heads for h in heads):
        raise ValueError(f"draw_layout: heads={heads}, but the layout has {layout.heads} head(s) "
                         f"(0..{layout.heads - 1})")
    plt = _plt()
    lay = layout.to("cpu")
    dens = lay.kv_counts.sum(-1).double() / max(lay.num_q_blocks * lay.num_kv_blocks, 1)  # [Bl, Hl]
    n_panels = len(heads) + (close_up is not None)
    size = (max(panel_inches * n_panels, 6.4), panel_inches + 1.2)
    fig, axes = plt.subplots(1, n_panels, figsize=size, squeeze=False, dpi=dpi)
    axes = axes[0]
    cmap = ListedColormap(COLORS)
    nq, nk = lay.num_q_blocks, lay.num_kv_blocks
    for ax, h in zip(axes, heads):
        cells, fq, fk = pooled_states(lay, b, h, max_cells=cells_for(panel_inches, dpi))
        # extent in block units: a pooled cell spans fq x fk blocks, drawn where those blocks are
        ax.imshow(cells.numpy(), cmap=cmap, vmin=0, vmax=2, interpolation="nearest", extent=(0, nk, nq, 0),
                  aspect="auto")
        ax.set_box_aspect(1)
        _grid(ax, nq, nk)
        label = "all heads" if lay.heads == 1 else f"head {h}"
        ax.set_title(f"{label}: {dens[b, h]:.3f}", fontsize=9)
        pooled = "" if (fq, fk) == (1, 1) else f"; a cell = {fq}x{fk} blocks"
        ax.set_xlabel(f"key block ({layout.block_k} tokens{pooled})", fontsize=8)
        ax.set_ylabel(f"query block ({layout.block_q} tokens)", fontsize=8)
        ax.tick_params(labelsize=7)
        if close_up is not None and h == cu_head:
            ax.add_patch(Rectangle((close_up.k0 / layout.block_k, close_up.q0 / layout.block_q),
                                   close_up.width / layout.block_k, close_up.rows / layout.block_q,
                                   fill=False, edgecolor="#c0392b", linewidth=1.2))
    if close_up is not None:
        _draw_close_up(axes[-1], layout, close_up, b)
    listed = torch.arange(lay.max_k) < lay.kv_counts[b, heads][..., None].long()  # the drawn panels' blocks
    n_part = int((listed & (lay.kv_mask_ids[b, heads] >= 0)).sum())
    n_full = int(listed.sum()) - n_part
    kv = "" if layout.kv_len == layout.q_len else f"x{layout.kv_len}"
    row = f", batch {b}" if lay.batch > 1 else ""
    title = (f"{name + ': ' if name else ''}L={layout.q_len}{kv}, blocks {layout.block_q}x{layout.block_k}, "
             f"density {layout.density:.3f}{row}")
    if close_up is not None:
        title += " (red: token close-up)"
    fig.suptitle(title, fontsize=11)
    handles = [Patch(facecolor=COLORS[FULL], label=f"full block ({n_full})"),
               Patch(facecolor=COLORS[PARTIAL], label=f"partial block ({n_part})"),
               Patch(facecolor=COLORS[ABSENT], edgecolor="#999999", label="skipped")]
    fig.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.935), ncol=3, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.9))
    return fig


def _grid(ax, nq: int, nk: int) -> None:
    """Thin block boundaries when the grid is small enough to see them."""
    if max(nq, nk) <= 64:
        ax.set_xticks(range(nk + 1), minor=True)
        ax.set_yticks(range(nq + 1), minor=True)
        ax.grid(which="minor", color="#d9d9d9", linewidth=0.4)
        ax.tick_params(which="minor", length=0)
    ax.set_xlim(0, nk)
    ax.set_ylim(nq, 0)


def _draw_close_up(ax, layout, cu: CloseUp, batch: int) -> None:
    from matplotlib.colors import ListedColormap
    tok = token_region(layout, cu.q0, cu.k0, cu.rows, cu.width, batch=batch, head=cu.head)
    rows, cols = tok.shape
    ax.imshow(tok.numpy(), cmap=ListedColormap(TOKEN_COLORS), vmin=0, vmax=1, interpolation="nearest",
              extent=(cu.k0, cu.k0 + cols, cu.q0 + rows, cu.q0), aspect="auto")
    for x in range(math.ceil(cu.k0 / layout.block_k) * layout.block_k, cu.k0 + cols, layout.block_k):
        ax.axvline(x, color="#c0392b", linewidth=0.6, alpha=0.7)
    for y in range(math.ceil(cu.q0 / layout.block_q) * layout.block_q, cu.q0 + rows, layout.block_q):
        ax.axhline(y, color="#c0392b", linewidth=0.6, alpha=0.7)
    title = f"tokens {cu.q0}..{cu.q0 + rows} x {cu.k0}..{cu.k0 + cols} (head {cu.head})"
    ax.set_title(title.replace(" x ", "\nx ") if len(title) > 44 else title, fontsize=9)  # long positions: 2 lines
    ax.set_xlabel("key", fontsize=8)
    ax.set_ylabel("query", fontsize=8)
    ax.tick_params(labelsize=7)


def save(fig, path, dpi: int | None = None) -> Path:
    """Write ``fig`` to ``path`` at ``dpi`` (None: the figure's own, which :func:`draw_layout` pools for)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi or fig.dpi)
    _plt().close(fig)
    return path


# ----------------------------------------------------------------------------- building by name
# Values used for a builder's *required* arguments when the caller gives none (L = seq_len).
# Pattern expressions ("local|random") live with the patterns; re-exported here for the CLI.
from .patterns.expr import DEFAULTS, NOT_BUILDERS, build_pattern, pattern_names  # noqa: E402,F401


# ----------------------------------------------------------------------------- the gallery
@dataclass
class GalleryItem:
    name: str          # file stem
    expr: str          # build_pattern expression ("" -> built by `make`)
    caption: str
    options: dict = field(default_factory=dict)
    close_up: tuple[int, ...] | None = None  # CloseUp(q0, k0, rows[, cols]) in tokens
    make: object = None  # callable(seq_len, block) -> layout, for patterns that are not builders


def _topk_example(seq_len: int, block: int):
    """``patterns.topk`` (k=6, causal) on a toy score map: near-diagonal blocks, two sink blocks, noise."""
    from . import patterns
    nq = nk = math.ceil(seq_len / block)
    g = torch.Generator().manual_seed(0)
    qb = torch.arange(nq)[:, None].float()
    kb = torch.arange(nk)[None, :].float()
    scores = -((qb - kb).abs() / 3.0) + 0.8 * torch.randn(nq, nk, generator=g) + 2.0 * (kb < 2)
    return patterns.topk(scores[None, None], k=6, seq_len=seq_len, block_q=block, block_k=block, causal=True)


def gallery_items(seq_len: int = 4096) -> list[GalleryItem]:
    L = seq_len
    return [
        GalleryItem("dense", "dense", "Every block, all full."),
        GalleryItem("causal", "causal", "Bottom-right causal: blocks below the diagonal full, diagonal blocks partial.",
                    close_up=(L // 2, L // 2 - 128, 384)),
        GalleryItem("local", "local", f"Causal sliding window of {L // 4} tokens (`local(L, window={L // 4})`).",
                    {"window": L // 4}, close_up=(L // 2, L // 4 - 64, 384)),
        GalleryItem("streaming", "streaming", f"StreamingLLM: {64} sink tokens + a window of {L // 4} tokens.",
                    {"window": L // 4, "num_sink": 64}, close_up=(L // 2, 0, 256, L // 2 + 256)),
        GalleryItem("block_diagonal", "block_diagonal",
                    "Documents of 600 tokens (not a multiple of 128, so blocks on document boundaries are partial).",
                    {"block_size": 600}, close_up=(512, 512, 384)),
        GalleryItem("strided", "strided", "Sparse-Transformer fixed pattern (causal): the diagonal block plus "
                    "every 4th key block as a summary column.",
                    {"stride": 4, "causal": True}),
        GalleryItem("dilated", "dilated", "Dilated window (non-causal): every 3rd key block, 6 on each side of "
                    "the diagonal counting it.",
                    {"window_blocks": 6, "dilation": 3}),
        GalleryItem("random", "random", "Random key blocks per head, density 0.2 (per-head layouts).",
                    {"density": 0.2, "heads": 4, "seed": 0}),
        GalleryItem("bigbird", "bigbird", "BigBird: 1 global block, 3-block window, 2 random blocks per row, per head.",
                    {"num_global_blocks": 1, "window_blocks": 3, "num_random_blocks": 2, "heads": 4, "seed": 0}),
        GalleryItem("topk", "", "`topk(scores, k=6, causal=True)` on a toy score map (pooled Q/K scores in practice).",
                    make=_topk_example),
        GalleryItem("local_or_random", "local|random",
                    f"Composition `local(window={L // 8}) | random(density=0.1)`: union of two layouts.",
                    {"window": L // 8, "density": 0.1, "heads": 4, "seed": 0}),
    ]


def write_gallery(out_dir, *, seq_len: int = 4096, block: int = 128, markdown=None, names=None,
                  dpi: int = 110) -> list[Path]:
    """Draw every gallery item to ``out_dir/<name>.png``; optionally write a markdown page."""
    out_dir = Path(out_dir)
    written, entries = [], []
    for item in gallery_items(seq_len):
        if names and item.name not in names:
            continue
        if item.make is not None:
            layout = item.make(seq_len, block)
        else:
            layout = build_pattern(item.expr, seq_len, block_q=block, block_k=block, **item.options)
        cu = _fit(CloseUp(*item.close_up), layout) if item.close_up else None
        fig = draw_layout(layout, name=item.expr or item.name, close_up=cu, dpi=dpi)
        path = save(fig, out_dir / f"{item.name}.png")
        written.append(path)
        entries.append((item, path, layout))
    if markdown is not None:
        _write_markdown(Path(markdown), entries, seq_len, block)
    return written


def _write_markdown(md: Path, entries, seq_len: int, block: int) -> None:
    import os
    lines = ["# Pattern gallery", "",
             f"Every pattern family at L = {seq_len} with {block}x{block} blocks. Blue blocks are *full* "
             "(no element mask), orange blocks are *partial* (the element mask is applied inside the "
             "block), white blocks are skipped. Density counts whole blocks. Some figures add a "
             "token-level close-up of the red square.", "",
             "Regenerate with `sparse-attn viz --gallery docs/gallery --markdown docs/gallery.md`; draw "
             "one pattern with e.g. `sparse-attn viz local --seq-len 8192 --window 1024 --out local.png`.", ""]
    for item, path, layout in entries:
        rel = os.path.relpath(path, md.parent)
        lines += [f"## {item.expr or item.name}", "", item.caption + f" Density {layout.density:.3f}.", "",
                  f"![{item.name}]({rel})", ""]
    md.parent.mkdir(parents=True, exist_ok=True)
    md.write_text("\n".join(lines))
