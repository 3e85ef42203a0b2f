"""Training speed: seconds per iteration of one preset under each training speed setting, side by side.

The settings change how the same arithmetic runs, not what it computes (tests/test_train.py checks that the
explicit attention kernel gives the fused kernel's loss and gradients): bf16 autocast with the fused SDPA
kernel (the first embedded model's recipe), the explicit kernel, and the explicit kernel with the encoder and
decoder compiled. Variants run in rounds, alternating, in one process, on the same batches; the first
iterations of each are warm-up (compilation included) and not timed.

    python benchmarks/bench_train.py --preset fashion_b128 --threads 2 --rounds 2 --iters 6

writes ``benchmarks/results/train_speed.json`` (median seconds per iteration per variant and ratios to the first).
The float32 variants (``--amp none``) answer whether bf16 autocast pays on a given CPU: AVX-512-BF16 alone (no AMX)
was not enough on one Xeon (issue 14, phase 8), so the file records the CPU's bf16-related flags:

    python benchmarks/bench_train.py --variants explicit,explicit+fp32 --threads 1 --rounds 2 --iters 4 \
        --name train_speed_amp
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_result  # noqa: E402

from mar_probe.machine import cpu_flags  # noqa: E402

VARIANTS = {"sdpa": dict(attention="sdpa", compile=False), "explicit": dict(attention="explicit", compile=False),
            "explicit+compile": dict(attention="explicit", compile=True),
            "explicit+fp32": dict(attention="explicit", compile=False, amp="none"),
            "explicit+compile+fp32": dict(attention="explicit", compile=True, amp="none")}
DEFAULT_VARIANTS = ("sdpa", "explicit", "explicit+compile")
BF16_FLAGS = ("avx512_bf16", "amx_bf16", "amx_tile", "avx2")


def parse_variants(text: str) -> tuple[str, ...]:
    names = tuple(n for n in text.split(",") if n)
    unknown = [n for n in names if n not in VARIANTS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown variant(s) {unknown!r} in {text!r}; valid: {sorted(VARIANTS)!r}")
    return names


def _setup(preset: str, variant: dict, batch_size: int):
    """One variant's model, EMA, optimiser and random streams (seed 0, like every other variant)."""
    from mar_probe.train import TrainConfig, TrainState, _prepare_for_speed
    state = TrainState.create(TrainConfig(preset=preset, batch_size=batch_size, **variant))
    _prepare_for_speed(state.cfg, state.model)
    return state


def _time(state, latents, labels, start: int, iters: int) -> list[float]:
    times = []
    for it in range(start, start + iters):
        t0 = time.perf_counter()
        state.step(latents, labels, it)
        times.append(time.perf_counter() - t0)
    return times


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="fashion_b128")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--warmup", type=int, default=4, help="untimed iterations per variant (compilation happens here)")
    p.add_argument("--iters", type=int, default=6, help="timed iterations per variant and round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--variants", type=parse_variants, default=DEFAULT_VARIANTS,
                   help=f"comma-separated, the first is the reference of the ratios; valid: {', '.join(VARIANTS)}")
    p.add_argument("--name", default="train_speed", help="result file: benchmarks/results/NAME.json")
    args = p.parse_args(argv)
    import torch

    from mar_probe.data import load_fashion_mnist
    from mar_probe.models import preset_config
    from mar_probe.models.tokenizer import PixelTokenizer
    torch.set_num_threads(args.threads)
    c = preset_config(args.preset)
    images, labels = load_fashion_mnist("train")
    latents = PixelTokenizer(c.img_size, c.vae_stride, c.image_channels, c.crop_size).encode(images[:2048])
    labels = torch.as_tensor(labels[:2048])
    states = {name: _setup(args.preset, VARIANTS[name], args.batch_size) for name in args.variants}
    for state in states.values():
        _time(state, latents, labels, 0, args.warmup)
    times = {name: [] for name in args.variants}
    for r in range(args.rounds):
        for name in (args.variants if r % 2 == 0 else reversed(args.variants)):
            start = args.warmup + r * args.iters
            times[name] += _time(states[name], latents, labels, start, args.iters)
    med = {name: statistics.median(t) for name, t in times.items()}
    first = args.variants[0]
    payload = dict(command="python benchmarks/bench_train.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                   preset=args.preset, batch_size=args.batch_size, threads=args.threads,
                   cpu_flags=cpu_flags(BF16_FLAGS), seconds_per_iteration_median=med, reference=first,
                   **{f"speedup_over_{first}": {n: med[first] / m for n, m in med.items()}},
                   seconds=times)
    print(write_result(args.name, payload))
    for name, m in med.items():
        print(f"{name:18s} {m:.3f} s/iteration  {med[first] / m:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
