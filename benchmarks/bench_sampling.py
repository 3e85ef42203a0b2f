"""Time baseline MAR sampling per component (encoder, decoder, diffusion head).

Default: the mar_base architecture with random weights, batch 1, 64 steps, CFG 3.0, 100 diffusion steps, on
the CPU — the setting of the numbers in ``shared/facts.md`` (official code: 181 s per image on 2 cores).

    python benchmarks/bench_sampling.py                 # mar_base, writes results/sampling_mar_base.json
    python benchmarks/bench_sampling.py --preset fashion_small --batch 16
"""
from __future__ import annotations

import time

import torch

from common import bench_parser, write_result
from mar_probe import create_model, sample


def run(preset: str, batch: int, num_iter: int, cfg: float, steps: str, repeats: int, device: str) -> dict:
    torch.manual_seed(0)
    model = create_model(preset, num_sampling_steps=steps).to(device).eval()
    labels = list(range(batch))
    runs = []
    for r in range(repeats):
        t0 = time.perf_counter()
        res = sample(model, labels, num_iter=num_iter, cfg=cfg, seed=r, progress=True)
        total = time.perf_counter() - t0
        runs.append({"total_s": total, **{f"{k}_s": v for k, v in res.timings.items()}})
        print(f"run {r}: total {total:.1f} s; " + ", ".join(f"{k} {v:.1f} s" for k, v in res.timings.items()))
    best = min(runs, key=lambda x: x["total_s"])
    return {"preset": preset, "batch": batch, "num_iter": num_iter, "cfg": cfg, "num_sampling_steps": steps,
            "runs": runs, "best": best, "seconds_per_image": best["total_s"] / batch}


def main(argv=None):
    p = bench_parser(__doc__)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--device", default="cpu")
    a = p.parse_args(argv)
    out = run(a.preset, a.batch, a.num_iter, a.cfg, a.num_sampling_steps, a.repeats, a.device)
    print(f"wrote {write_result(f'sampling_{a.preset}', out)}")


if __name__ == "__main__":
    main()
