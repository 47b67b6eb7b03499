"""Probability-flow ODE samplers for the VE denoiser (Karras et al. 2022, "EDM").

The ODE is dx/dσ = (x − D(x; σ, q)) / σ, integrated from σ_max to 0 on the EDM time grid
σ_i = (σ_max^{1/ρ} + i/(N−1)·(σ_min^{1/ρ} − σ_max^{1/ρ}))^ρ, ρ = 7, σ_N = 0. `euler_pf_ode` is
the paper's solver; `heun_edm` is EDM's second-order Algorithm 1 (deterministic), 2N − 1
evaluations for N steps. Both call `Denoiser.guided`, as the exported graph does. Generated
rows are projected onto the unit sphere at the end, where every target row lives.
"""

from __future__ import annotations

from itertools import pairwise

import torch

from service.errors import InputError
from training.stage3_diffusion.command import SOLVER_NAMES
from training.stage3_diffusion.denoiser import Denoiser

RHO = 7.0


def sigma_schedule(steps: int, sigma_min: float, sigma_max: float, rho: float = RHO) -> list[float]:
    """N noise levels from σ_max down to σ_min on the EDM grid, then a final 0 (N + 1 values)."""
    if steps < 1:
        raise InputError("steps must be at least 1")
    if steps == 1:
        return [sigma_max, 0.0]
    lo, hi = sigma_min ** (1 / rho), sigma_max ** (1 / rho)
    return [(hi + i / (steps - 1) * (lo - hi)) ** rho for i in range(steps)] + [0.0]


def solver_evaluations(solver: str, steps: int) -> int:
    """Denoiser evaluations per query: Euler N, Heun 2N − 1 (the last step is Euler)."""
    if solver == "euler":
        return steps
    if solver == "heun":
        return 2 * steps - 1
    raise InputError(f"unknown solver {solver!r}; use one of {SOLVER_NAMES}")


def initial_noise(shape: tuple[int, ...], generator: torch.Generator | None) -> torch.Tensor:
    device = generator.device if generator is not None else None
    return torch.randn(shape, generator=generator, device=device)


def _unit_rows(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True).clamp_min(1e-12)  # (B, L, d)


def _start(denoiser: Denoiser, query: torch.Tensor, steps: int,
           generator: torch.Generator | None,
           noise: torch.Tensor | None) -> tuple[torch.Tensor, list[float], torch.Tensor]:
    """Shared set-up of the ODE solvers: x (B, L, d) at σ_max, the schedule, ones (B,)."""
    config = denoiser.config
    if noise is None:
        noise = initial_noise((query.shape[0], config.rows, config.dim), generator)
    sigmas = sigma_schedule(steps, config.sigma_min, config.sigma_max)
    ones = torch.ones(query.shape[0], device=query.device)  # (B,)
    return noise * sigmas[0], sigmas, ones


@torch.no_grad()
def euler_pf_ode(denoiser: Denoiser, query: torch.Tensor, steps: int = 256,
                 cfg_weight: float = 0.0, generator: torch.Generator | None = None,
                 noise: torch.Tensor | None = None,
                 context: torch.Tensor | None = None) -> torch.Tensor:
    """First-order Euler on the probability-flow ODE. query (B, d), context (B, C, d) or None
    → rows (B, L, d)."""
    x, sigmas, ones = _start(denoiser, query, steps, generator, noise)  # x: (B, L, d)
    for sigma, sigma_next in pairwise(sigmas):
        slope = (x - denoiser.guided(x, ones * sigma, query, cfg_weight, context)) / sigma
        x = x + (sigma_next - sigma) * slope
    return _unit_rows(x)


@torch.no_grad()
def heun_edm(denoiser: Denoiser, query: torch.Tensor, steps: int = 8, cfg_weight: float = 0.0,
             generator: torch.Generator | None = None,
             noise: torch.Tensor | None = None,
             context: torch.Tensor | None = None) -> torch.Tensor:
    """EDM Algorithm 1 (Heun's 2nd order, deterministic). query (B, d), context (B, C, d) or
    None → rows (B, L, d)."""
    x, sigmas, ones = _start(denoiser, query, steps, generator, noise)  # x: (B, L, d)
    for sigma, sigma_next in pairwise(sigmas):
        slope = (x - denoiser.guided(x, ones * sigma, query, cfg_weight, context)) / sigma
        x_euler = x + (sigma_next - sigma) * slope
        if sigma_next == 0.0:
            x = x_euler
            break
        denoised = denoiser.guided(x_euler, ones * sigma_next, query, cfg_weight, context)
        slope_next = (x_euler - denoised) / sigma_next
        x = x + (sigma_next - sigma) * 0.5 * (slope + slope_next)
    return _unit_rows(x)


SOLVERS = dict(zip(SOLVER_NAMES, (euler_pf_ode, heun_edm), strict=True))


def sample(denoiser: Denoiser, query: torch.Tensor, solver: str, steps: int,
           cfg_weight: float = 0.0, generator: torch.Generator | None = None,
           noise: torch.Tensor | None = None,
           context: torch.Tensor | None = None) -> torch.Tensor:
    """Rows (B, L, d) from the solver named `solver` (one of SOLVER_NAMES)."""
    if solver not in SOLVERS:
        raise InputError(f"unknown solver {solver!r}; available: {sorted(SOLVERS)}")
    return SOLVERS[solver](denoiser, query, steps, cfg_weight, generator, noise, context)
