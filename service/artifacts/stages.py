"""A bundle's stages, in one registry: each stage's name, the stages it reads, the command that
builds it and its roles. Staleness (bundle.py), the build plan, the shipped default, the routes
stage and the commands that need a stage all read this table; nothing else lists stages."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from service.errors import BundleError
from service.runtime.milvus import MILVUS_STAGE

CATALOG_COMMAND = "r4t --bundle {bundle} catalog"
BUNDLE_COMMAND = "r4t --bundle {bundle} bundle"
ROUTES_FILE = "routes.json"  # the `routes` stage's choice: {"weights": R4T_ROUTES's form, ...}
# the `ar` route's models: stage 1's fan-out LM (its GRPO policy, then its warm start, each
# exported to ONNX) and a pretrained GGUF policy; the route serves the first a bundle has
AR_STAGE, AR_WARMSTART, LLM_STAGE = "folm", "folm-warmstart", "llm"
ONNX_POLICIES = (AR_STAGE, AR_WARMSTART)
AR_POLICIES = (*ONNX_POLICIES, LLM_STAGE)


@dataclass(frozen=True)
class StageSpec:
    """One stage of a bundle."""

    name: str
    inputs: tuple[str, ...]  # the stages it reads: a change to one rebuilds it
    command: str = BUNDLE_COMMAND  # what builds it into a bundle (`{bundle}`: its folder)
    built: bool = True  # built by `r4t bundle`, in this table's order (else by its own command)
    catalog: bool = False  # built by `r4t catalog` before anything trains (no torch)
    labeled: bool = False  # reads the benchmark's labels: skipped for a catalog without them
    shipped: bool = False  # in models/shipped/default, adopted where its inputs match
    route: str | None = None  # the fan-out route it is the model of


STAGES: tuple[StageSpec, ...] = (
    StageSpec("catalog", (), CATALOG_COMMAND, catalog=True),
    StageSpec("lexical", ("catalog",), CATALOG_COMMAND, catalog=True, route="hybrid"),
    StageSpec("benchmark", ("catalog",), CATALOG_COMMAND, catalog=True, labeled=True),
    # the teacher, trained on the labeled train queries
    StageSpec("ranker", ("catalog", "lexical", "benchmark"), CATALOG_COMMAND, labeled=True,
              route="ranked"),
    # stage 1, the fan-out LM: its warm start, then its GRPO policy; both read the lexical
    # index through their prompts' candidates, as stages 2 and 3 do
    StageSpec(AR_WARMSTART, ("catalog", "lexical", "benchmark"), shipped=True),
    StageSpec(AR_STAGE, ("catalog", "lexical", "benchmark", AR_WARMSTART), shipped=True),
    # stage 2: a run folder, no bundle files; either teacher
    StageSpec("synthesis", ("catalog", "lexical", "benchmark", "ranker", AR_STAGE), shipped=True),
    StageSpec("diffusion", ("catalog", "lexical", "synthesis"), shipped=True, route="diffusion"),
    # the default A/B weights, measured on val over the routes the bundle serves
    StageSpec("routes", ("catalog", "lexical", "benchmark", "ranker", AR_STAGE, "diffusion"),
              labeled=True),
    # a pretrained GGUF policy: it reads no stage
    StageSpec(LLM_STAGE, (), "r4t --bundle {bundle} llm SOURCE", built=False),
    # the catalog loaded into an external engine: no files, a collection
    StageSpec(MILVUS_STAGE, ("catalog",), "r4t --bundle {bundle} index", built=False),
)
STAGE: dict[str, StageSpec] = {spec.name: spec for spec in STAGES}

# the registry's views, by role
PIPELINE = tuple(s.name for s in STAGES if s.built)  # what `r4t bundle` builds, in order
CATALOG_STAGES = tuple(s.name for s in STAGES if s.catalog)
LABELED_STAGES = tuple(s.name for s in STAGES if s.labeled)
SHIPPED_STAGES = tuple(s.name for s in STAGES if s.shipped)
ROUTE_STAGES = {s.route: s.name for s in STAGES if s.route}  # fan-out route → its stage


def inputs_of(name: str) -> tuple[str, ...]:
    """The stages `name` reads (none for a stage the registry does not know)."""
    spec = STAGE.get(name)
    return () if spec is None else spec.inputs


def recorded_routes(bundle_dir: Path) -> str | None:
    """The A/B weights the bundle's `routes` stage chose on its val split, if it has one."""
    path = Path(bundle_dir) / ROUTES_FILE
    if not path.is_file():
        return None
    try:
        return str(json.loads(path.read_text())["weights"])
    except (ValueError, KeyError, TypeError) as exc:
        raise BundleError(f"{path}: no readable weights ({type(exc).__name__}: {exc}); "
                          "rebuild it with `r4t bundle`") from exc
