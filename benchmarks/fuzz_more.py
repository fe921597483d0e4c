"""Run the randomized GPU cases (tests/gpu/test_fuzz_gpu.py's three kinds and test_grouped_gpu.py's
grouped one) for more seeds than the suites hold, within a time budget:
    python benchmarks/fuzz_more.py --start 48 --budget-s 300 [--kinds grouped varlen]
Prints each failure with its drawn configuration; exit 1 if any failed."""
import argparse
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "gpu"))
import test_fuzz_gpu as F  # noqa: E402
import test_grouped_gpu as G  # noqa: E402

KINDS = {"fwd-bwd": F.test_fuzz_forward_backward, "varlen": F.test_fuzz_varlen,
         "quantized": F.test_fuzz_quantized_vs_bf16, "grouped": G.test_fuzz_grouped}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--start", type=int, default=48)
    ap.add_argument("--budget-s", type=float, default=300)
    ap.add_argument("--kinds", nargs="+", choices=list(KINDS), default=list(KINDS))
    a = ap.parse_args()
    t0, n, failed = time.monotonic(), 0, []
    kinds = [KINDS[k] for k in a.kinds]
    seed = a.start
    while time.monotonic() - t0 < a.budget_s:
        for fn in kinds:
            try:
                fn(seed)
            except Exception as e:  # noqa: BLE001 -- report every failure, keep going
                failed.append((fn.__name__, seed))
                print(f"FAILED {fn.__name__}[{seed}]: {str(e)[:600]}", flush=True)
                if "CUDA error" in str(e) or "AcceleratorError" in type(e).__name__:
                    traceback.print_exc()
                    print("CUDA context lost: stopping", flush=True)
                    print(f"ran up to seed {seed}, failed {failed}")
                    return 1
            n += 1
        seed += 1
    print(f"ran {n} cases (seeds {a.start}..{seed - 1}) in {time.monotonic() - t0:.0f} s; failed {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
