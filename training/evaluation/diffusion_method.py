"""The diffusion retriever in the evaluation harness: method `diffusion` at any schedule.

`diffusion(bundle, k, steps=None)` is the served route: `service.routes.diffusion.DiffusionRoute`
over the
bundle's exported sampler, its items those an HTTP answer with the same seed returns. The
generated rows that claimed the items are the probes, so the harness scores their content-side
groundedness. With `steps` (or `solver`) given, a sampler with that schedule is composed from
the bundle's `step.onnx`.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import numpy as np

from service.artifacts.bundle import Bundle
from service.errors import InputError
from service.routes.diffusion import DiffusionRoute
from service.runtime.encoder import Encoder
from service.runtime.sampler import (
    CONFIG_FILE,
    SAMPLER_FILE,
    STEP_FILE,
    DiffusionSampler,
    read_config,
)
from training.evaluation.baselines import Method, route_method


def composed_sampler_dir(diffusion_dir: Path, solver: str, steps: int, form: str) -> Path:
    """A temporary folder holding a sampler with another schedule, composed from step.onnx."""
    import onnx  # the train extra's

    from training.stage3_diffusion.export import sampler_evaluations_flops
    from training.stage3_diffusion.sampler_graph import compose_sampler
    from training.stage3_diffusion.solvers import solver_evaluations

    config = read_config(diffusion_dir)
    items = config.get("items_file")  # a projected export: one evaluation, its item table
    if items is not None and solver_evaluations(solver, steps) != 1:
        raise InputError("this student is exported projected, for one evaluation: re-export "
                         f"it for {solver} × {steps} (`r4t export diffusion --solver {solver} "
                         f"--steps {steps}`) to measure that schedule")
    step = onnx.load(str(diffusion_dir / STEP_FILE))
    graph = compose_sampler(step, config["rows"], config["dim"], solver, steps,
                            config["sigma_min"], config["sigma_max"], form)
    out = Path(tempfile.mkdtemp(prefix="r4t-sampler-"))
    onnx.save(graph, str(out / SAMPLER_FILE))
    if items is not None:
        shutil.copyfile(diffusion_dir / items, out / items)
    nfe, flops = sampler_evaluations_flops(config, solver, steps)
    config.update(solver=solver, steps=steps, form=form, evaluations=nfe,
                  flops_per_query=flops, sampler_file=SAMPLER_FILE)
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return out


def open_sampler(bundle: Bundle, steps: int | None = None, solver: str | None = None,
                 threads: int = 0) -> DiffusionSampler:
    diffusion_dir = bundle.path / "diffusion"
    config = read_config(diffusion_dir)
    if (steps is None or steps == config["steps"]) and solver in (None, config["solver"]):
        return DiffusionSampler(diffusion_dir, threads=threads)
    # A 256-step sampler as a Loop keeps the graph small; few steps unroll.
    steps = steps or int(config["steps"])
    form = "loop" if steps > 32 else "unrolled"
    temp = composed_sampler_dir(diffusion_dir, solver or config["solver"], steps, form)
    try:
        return DiffusionSampler(temp, threads=threads)
    finally:
        shutil.rmtree(temp, ignore_errors=True)


def diffusion(bundle: Bundle, k: int = 10, steps: int | None = None, solver: str | None = None,
              seed: int = 0, threads: int = 0, draws: int | None = None) -> Method:
    """Eval factory: the served diffusion route with noise seed `seed` (and, given `draws`,
    that many blocks per query instead of the export's)."""
    sampler = open_sampler(bundle, steps, solver, threads)
    if draws is not None:
        sampler.config["draws"] = draws
    path = DiffusionRoute(bundle, Encoder(bundle.encoder_config), sampler, seed)

    def context(texts: list[str], queries: np.ndarray) -> list[np.ndarray] | None:
        rows = path.context.rows(texts, queries)  # (Q, C): what the student chooses among
        return None if rows is None else list(rows)

    return route_method(bundle, path, k, context if path.context.n else None)
