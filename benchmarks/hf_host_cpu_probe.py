"""Host time of the transformers integration in an eager padded ``generate()``, on any machine (no GPU): the calls
take the CUDA path (the kernels' device plan over a padded batch read in place, ``integrations._unpad.in_place``)
with every Triton launch a no-op (the stand-in of ``replay_cpu_probe.py``), so what is timed is our Python: the mask
interface once a forward (``sparse_attn_mask``) and the attention function once a layer (``sparse_attention_forward``),
each summed over a generate() of a random 4-layer Llama (8 left-padded prompts of 40-300 tokens, heads of 64, fp16 on
the CPU; ``--one``: the longest prompt alone, whose calls go through attention() rather than a padded batch's path). The model's outputs are garbage (no kernel runs); only the host path is real. Medians of ROUNDS generates,
microseconds per decoding step (the prefill's calls left out).

    PYTHONPATH=src:benchmarks python benchmarks/hf_host_cpu_probe.py [--rounds 5] [--tokens 48] [--one] [--new-lengths]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported

import torch  # noqa: E402
from replay_cpu_probe import install_stand_in  # noqa: E402

from sparse_attn import api  # noqa: E402


def _stand_in() -> None:
    """Calls on CPU tensors take the kernels' path, whose launches do nothing (replay_cpu_probe's stand-in)."""
    install_stand_in()
    api._use_kernels = lambda q: True


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
                      attn_implementation="sdpa", pad_token_id=0)
    return LlamaForCausalLM(cfg).half().eval()


def _inputs(one: bool):
    lengths = [300] if one else [300, 260, 220, 180, 140, 100, 70, 40]
    width = max(lengths)
    x = torch.randint(1, 512, (len(lengths), width), generator=torch.Generator().manual_seed(1))
    mask = torch.zeros_like(x)
    for b, n in enumerate(lengths):
        mask[b, width - n:] = 1
        x[b, :width - n] = 0
    return x, mask


def main() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from sparse_attn.integrations import transformers as integ
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--one", action="store_true", help="one prompt, no padding (attention() calls, not varlen)")
    ap.add_argument("--new-lengths", action="store_true",
                    help="each round's prompts TOKENS + 1 tokens shorter than the last's, so that no step's cache "
                         "length recurs from an earlier round (whose recorded launches a step's first layer would find)")
    args = ap.parse_args()
    _stand_in()
    model = _model()
    integ.enable(model)
    spent = {"mask": [], "attention": []}
    decoding = [False]

    def timed(kind, fn):
        def call(*a, **kw):
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            if decoding[0]:
                spent[kind][-1] += time.perf_counter() - t0
            return out
        return call
    AttentionInterface.register(integ.NAME, timed("attention", integ.sparse_attention_forward))
    AttentionMaskInterface.register(integ.NAME, timed("mask", integ.sparse_attn_mask))
    x, mask = _inputs(args.one)
    if args.new_lengths and (args.tokens + 1) * args.rounds >= x.shape[1]:
        raise SystemExit(f"--new-lengths cuts {args.tokens + 1} tokens a round: at most "
                         f"{(x.shape[1] - 1) // (args.tokens + 1)} rounds of {args.tokens} tokens fit {x.shape[1]}")
    steps = args.tokens - 1

    def prefill_done(*_a, **_kw):  # generate()'s first forward is the prefill: time from the second on
        decoding[0] = True
    for rnd in range(args.rounds + 1):
        for kind in spent:
            spent[kind].append(0.0)
        decoding[0] = False
        hook = model.model.layers[-1].register_forward_hook(prefill_done)
        with torch.no_grad():
            cut = (args.tokens + 1) * rnd if args.new_lengths else 0
            model.generate(x[:, cut:], attention_mask=mask[:, cut:], max_new_tokens=args.tokens,
                           min_new_tokens=args.tokens,
                           do_sample=False)
        hook.remove()
    for kind in spent:  # round 0 warms up
        per_step = [s / steps * 1e6 for s in spent[kind][1:]]
        print(f"{kind}: {statistics.median(per_step):.1f} us a step (rounds {', '.join(f'{v:.1f}' for v in per_step)})")
    total = [(a + m) / steps * 1e6 for a, m in zip(spent["attention"][1:], spent["mask"][1:])]
    print(f"total: {statistics.median(total):.1f} us a step, 4 layers")


if __name__ == "__main__":
    main()
