"""The paper-size diffusion sampler on a GPU, in PyTorch: seconds per batch for the batch sizes
of the paper's Figure 5, so its diffusion column can be set beside a named accelerator.

Random weights (speed does not depend on them): the `paper` preset (Table 3), Euler on the
probability-flow ODE with classifier-free guidance (two denoiser passes per step), fp32 and
bf16 autocast. Writes JSON and markdown (loadtest/results/gpu_sampler.*, beside the served
routes' figures). Needs torch with CUDA; not part of `make bench`:
`python -m loadtest.gpu_speed`.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from training.stage3_diffusion.denoiser import Denoiser, count_params, flops_per_step, preset
from training.stage3_diffusion.solvers import euler_pf_ode

BATCHES = (8, 16, 32, 64, 128, 256, 512, 1024)
PAPER_DIFFUSION_S = {8: 0.090, 16: 0.098, 32: 0.157, 64: 0.230, 128: 0.527, 256: 1.091,
                     512: 2.141, 1024: 3.930}


@torch.no_grad()
def seconds_per_batch(model: Denoiser, batch: int, steps: int, cfg: float,
                      dtype: torch.dtype | None, repeats: int) -> float:
    device = next(model.parameters()).device
    query = torch.randn(batch, model.config.dim, device=device)  # (B, d)
    query = torch.nn.functional.normalize(query, dim=-1)
    noise = torch.randn(batch, model.config.rows, model.config.dim, device=device)  # (B, L, d)
    context = None  # random unit neighbours: their values do not change the cost
    if model.config.context:
        context = torch.randn(batch, model.config.context, model.config.dim, device=device)
        context = torch.nn.functional.normalize(context, dim=-1)  # (B, C, d)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = []
    for _ in range(repeats + 1):  # the first run is a warm-up
        sync()
        started = time.perf_counter()
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            euler_pf_ode(model, query, steps, cfg, noise=noise, context=context)
        sync()
        times.append(time.perf_counter() - started)
    return min(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preset", default="paper")
    parser.add_argument("--steps", type=int, default=256)
    parser.add_argument("--cfg", type=float, default=0.1)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("loadtest/results"))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)))
    args = parser.parse_args()
    model = Denoiser(preset(args.preset)).to(args.device).eval()
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        fp32 = seconds_per_batch(model, batch, args.steps, args.cfg, None, args.repeats)
        bf16 = seconds_per_batch(model, batch, args.steps, args.cfg, torch.bfloat16, args.repeats)
        rows.append({"batch": batch, "fp32_s": fp32, "bf16_s": bf16,
                     "paper_s": PAPER_DIFFUSION_S[batch]})
        print(rows[-1], flush=True)
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    report = {"gpu": gpu, "torch": torch.__version__,
              "preset": args.preset, "params": count_params(model), "steps": args.steps,
              "cfg_weight": args.cfg, "gflop_per_query":
              flops_per_step(model.config, cfg=args.cfg != 0) * args.steps / 1e9, "rows": rows}
    lines = [f"Paper-size sampler ({report['params']:,} params, Euler {args.steps} steps, CFG "
             f"w={args.cfg}, {report['gflop_per_query']:.0f} GFLOP/query) on {report['gpu']}, "
             f"torch {report['torch']}, random weights:", "",
             "| batch | fp32 (s) | bf16 autocast (s) | paper diffusion (s, hardware unstated) |",
             "|---:|---:|---:|---:|"]
    lines += [f"| {r['batch']} | {r['fp32_s']:.3f} | {r['bf16_s']:.3f} | {r['paper_s']:.3f} |"
              for r in rows]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_sampler.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / "gpu_sampler.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
