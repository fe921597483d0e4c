"""Edge cases of the tool APIs found by an adversarial pass (metrics, model-eval metrics, CPU timing,
gallery close-ups, merged reports): each test failed before its fix."""
from __future__ import annotations

import json

import pytest
import torch

from sparse_attn import metrics, patterns, viz
from sparse_attn.bench.timing import time_fn
from sparse_attn.model_eval import greedy_metrics, logits_metrics


def test_cosine_and_rmse_neither_underflow_nor_overflow():
    """float64 values near 1e-170 squared to 0 (cosine(t, -t) read 1.0, as two all-zero inputs) and
    near 1e200 overflowed (nan)."""
    t = torch.tensor([3e-170, 1e-170], dtype=torch.float64)
    assert metrics.cosine_similarity(t, -t) == pytest.approx(-1.0)
    assert metrics.cosine_similarity(t, torch.tensor([3e-170, 0.0], dtype=torch.float64)) == pytest.approx(0.9486833)
    assert metrics.rmse(t, 2 * t) == pytest.approx(float(((t ** 2).mean() * 1e300).sqrt()) * 1e-150, rel=1e-9)
    big = torch.tensor([1e200, 2e200], dtype=torch.float64)
    assert metrics.cosine_similarity(big, big) == pytest.approx(1.0)
    assert metrics.rmse(big, 0.5 * big) == pytest.approx(float(torch.tensor([0.5, 1.0]).square().mean().sqrt()) * 1e200)
    assert metrics.cosine_similarity(torch.zeros(3), torch.zeros(3)) == 1.0


def test_logits_metrics_take_a_models_batch_of_one_and_refuse_other_shapes():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(6, 50, generator=g), torch.randn(6, 50, generator=g)
    assert logits_metrics(a[None], b[None]) == logits_metrics(a, b)  # top-1 once came out 3.0 here
    with pytest.raises(ValueError, match=r"\[L, V\] logits \(or \[1, L, V\]\), got \(2, 3, 50\)"):
        logits_metrics(torch.zeros(2, 3, 50), torch.zeros(2, 3, 50))
    a[2] = 0
    assert logits_metrics(a, a.clone())["cosine_min"] == pytest.approx(1.0)  # an all-zero row equals itself


def test_greedy_metrics_count_missing_tokens_as_different():
    assert greedy_metrics([1, 2], [1, 2, 3]) == {"greedy_match": pytest.approx(2 / 3), "greedy_prefix": pytest.approx(2 / 3)}
    assert greedy_metrics([], [1, 2, 3]) == {"greedy_match": 0.0, "greedy_prefix": 0.0}


def test_cpu_timing_keeps_an_explicit_warmup():
    calls = []
    time_fn(lambda: calls.append(1), "cpu", reps=3, warmup=10)
    assert len(calls) == 1 + 10 + 3


def test_gallery_close_ups_fit_small_matrices(tmp_path):
    with pytest.raises(ValueError, match="must lie in the layout"):
        viz.token_region(patterns.causal(1024), 512, -64, 128)
    lay = patterns.causal(200, block_q=16, block_k=16)
    cu = viz._fit(viz.CloseUp(100, -28, 384), lay)
    assert (cu.q0, cu.k0, cu.rows, cu.width) == (100, 0, 100, 200)
    assert viz._fit(viz.CloseUp(512, 512, 384), lay) is not None  # moved inside, not an empty panel
    assert len(viz.write_gallery(tmp_path, seq_len=256, block=16, names=["causal", "block_diagonal"])) == 2


def test_report_of_slices_from_different_devices_says_so(tmp_path):
    from sparse_attn import report
    from sparse_attn.bench import Row
    from dataclasses import asdict
    for k, gpu in ((1, "NVIDIA H100 80GB HBM3"), (2, "NVIDIA H200")):
        row = Row("sdpa-cudnn" if k == 1 else "sparse_attn", "local", 32768, 1, 32, 32, 128, "bf16", "fwd", False,
                  0.5, 14.0 if k == 1 else 4.0, 100.0, None, None)
        (tmp_path / f"s{k}.json").write_text(json.dumps({"header": {"suite": "report-gpu", "gpu": gpu,
                                                                    "slice": f"{k}/2"}, "rows": [asdict(row)]}))
    header, rows, _ = report.merge_results(sorted(tmp_path.glob("*.json")))
    assert header["gpu"] == "NVIDIA H100 80GB HBM3 + NVIDIA H200"
    assert any("ran on different devices" in line for line in report.header_lines(header, rows))


def test_pooled_states_keep_every_visited_block_and_the_strongest_state():
    blocks = {"block_q": 16, "block_k": 32}
    lay = patterns.random(700, density=0.2, heads=3, seed=5, **blocks) | patterns.local(700, 40, causal=False, **blocks)
    states = viz.block_states(lay)
    same, fq, fk = viz.pooled_states(lay, head=2)
    assert (fq, fk) == (1, 1) and torch.equal(same, states[0, 2])  # the grid fits: no pooling
    cells, fq, fk = viz.pooled_states(lay, head=1, max_cells=10)  # 44 x 22 blocks
    assert (fq, fk) == (5, 3) and cells.shape == (9, 8)
    grid = torch.zeros(9 * 5, 8 * 3, dtype=torch.int8)
    grid[:44, :22] = states[0, 1]
    assert torch.equal(cells, grid.view(9, 5, 8, 3).amax(dim=(1, 3)))


def test_drawing_a_million_tokens_does_not_build_the_block_grid(tmp_path):
    """draw_layout at 1M tokens in 64-blocks went over 12 GiB (a 16K x 16K grid through matplotlib)."""
    lay = patterns.local(1 << 20, 4096, block_q=64, block_k=64)
    fig = viz.draw_layout(lay, name="local", close_up=viz.CloseUp(1 << 19, (1 << 19) - 128, 256))
    image = fig.axes[0].get_images()[0].get_array()
    assert max(image.shape) <= viz.MAX_CELLS and int((image == viz.PARTIAL).sum()) > 0
    assert viz.save(fig, tmp_path / "m.png").stat().st_size > 0
    with pytest.raises(ValueError, match="has 1 head"):
        viz.draw_layout(lay, heads=[3])


def test_viz_refuses_heads_and_batches_the_layout_lacks():
    """An out-of-range batch or close-up head was clamped: a panel titled 'head 7' showed head 2."""
    lay = patterns.random(100, density=0.3, heads=3, batch=2, seed=1, block_q=16, block_k=16)
    assert torch.equal(viz.token_region(lay, 0, 0, 32, head=2, batch=1),
                       lay.to_token_mask()[1, 2, :32, :32])
    for kwargs in ({"head": 3}, {"batch": 2}, {"head": -1}):
        with pytest.raises(ValueError, match="valid: 0.."):
            viz.token_region(lay, 0, 0, 32, **kwargs)
        with pytest.raises(ValueError, match="valid: 0.."):
            viz.pooled_states(lay, **kwargs)
    with pytest.raises(ValueError, match="close_up.head=7"):
        viz.draw_layout(lay, close_up=viz.CloseUp(0, 0, 32, head=7))
    with pytest.raises(ValueError, match="batch=5"):
        viz.draw_layout(lay, batch=5)
    with pytest.raises(ValueError, match="heads=\\[\\] draws nothing"):
        viz.draw_layout(lay, heads=[])
    with pytest.raises(TypeError, match="draws a BlockLayout, got Tensor"):
        viz.draw_layout(torch.ones(4, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="max_cells"):
        viz.pooled_states(lay, max_cells=0)
    # a layout of one head / batch serves every index (it broadcasts), as in attention
    shared = patterns.local(100, 20, block_q=16, block_k=16)
    assert torch.equal(viz.token_region(shared, 0, 0, 32, head=5, batch=3), viz.token_region(shared, 0, 0, 32))


def _visited_columns_drawn(fig, ax, columns, nq) -> list[bool]:
    """Whether the rendered panel ``ax`` colours the centre of each key block in ``columns`` on the
    middle query row (white = skipped)."""
    import numpy as np
    fig.canvas.draw()
    rgba = np.asarray(fig.canvas.buffer_rgba())
    height = rgba.shape[0]
    out = []
    for c in columns:
        x, y = ax.transData.transform((c + 0.5, nq / 2))
        out.append(bool(rgba[int(height - y), int(x), :3].min() < 250))
    return out


@pytest.mark.parametrize("dpi", [60, 72, 110])
def test_no_visited_block_is_lost_at_any_dpi(dpi):
    """At --dpi 72 the 256-cell grid went into ~214 pixels: matplotlib's resampling dropped 23 of 127
    single visited key columns, drawn as skipped."""
    nb = 256
    mask = torch.zeros(1, 1, nb, nb, dtype=torch.bool)
    mask[..., 1::2] = True
    lay = patterns.from_block_mask(mask, block_q=16, block_k=16)
    fig = viz.draw_layout(lay, dpi=dpi)
    assert all(_visited_columns_drawn(fig, fig.axes[0], range(1, nb, 2), nb))


def test_panels_stay_readable_when_lq_and_lk_differ():
    """With square cells a 1K x 64K grid drew a panel 10 pixels tall (its 8 partial blocks invisible)."""
    for lq, lk in ((1024, 65536), (65536, 1024)):
        fig = viz.draw_layout(patterns.causal(lq, lk))
        fig.canvas.draw()
        box = fig.axes[0].get_window_extent()
        assert min(box.width, box.height) > 0.8 * max(box.width, box.height), (lq, lk, box)


def test_the_legend_counts_the_drawn_heads_and_the_close_up_head_is_drawn():
    """The legend counted every batch row and head, not the panels; a close-up of a head not drawn had
    no red frame although the title promised one."""
    lay = patterns.random(512, density=0.3, heads=8, batch=2, seed=3, block_q=64, block_k=64)
    fig = viz.draw_layout(lay, heads=[0, 1], batch=1)
    listed = int(lay.kv_counts[1, :2].sum())
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    n = [int(t.split("(")[1].rstrip(")")) for t in labels[:2]]
    assert sum(n) == listed and "batch 1" in fig._suptitle.get_text()
    fig = viz.draw_layout(lay, close_up=viz.CloseUp(0, 0, 64, head=5))
    drawn = [ax.get_title().split(":")[0] for ax in fig.axes[:-1]]
    assert "head 5" in drawn and len(drawn) == 4
    assert any(p.get_edgecolor()[:3] != (0, 0, 0) for ax in fig.axes[:-1] for p in ax.patches)
