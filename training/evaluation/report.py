"""`eval/report.html`: the evaluation reports as pictures a reader can follow without the
tables — quality per method with error bars, reach vs coverage, the steps curve, and the
queries on which the methods differ most, with what each returned. One self-contained file
(figures inlined as PNG), rewritten by every `r4t eval`."""

from __future__ import annotations

import base64
import html
import io
import json
from collections.abc import Callable
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import numpy as np

from service.artifacts.bundle import REPORTS_DIR
from service.artifacts.items import ItemStore
from service.artifacts.stages import AR_STAGE
from service.fanout.format import item_name
from training.data.metrics import standard_error
from training.data.query_sets import load_queries
from training.evaluation.harness import DIAGNOSTICS_DIR
from training.evaluation.steps_curve import CURVE_DIR
from training.evaluation.trigger_curve import CURVE_DIR as TRIGGER_DIR

REPORT_FILE = "report.html"
SPLITS = ("test", "val")
EXAMPLES = 4  # queries shown per split
EXAMPLE_METHODS = ("single", "mmr", "hybrid-names", AR_STAGE, "diffusion")  # the README's rows
STYLE = """body{font:15px/1.45 system-ui,sans-serif;max-width:1100px;margin:2rem auto;
color:#1d232b;padding:0 1rem}figure{margin:1.5rem 0}figcaption{color:#445;max-width:900px}
img{max-width:100%}table{border-collapse:collapse;font-size:.85rem;margin:.5rem 0 1.5rem}
td,th{border:1px solid #dde;padding:.3rem .5rem;vertical-align:top;text-align:left}
.hit{background:#dff5d8}.miss{color:#778}"""

NO_PLOTS = "matplotlib is in the train extra (`make train-install`)"


def load_reports(bundle_dir: Path) -> dict[str, dict[str, dict[str, Any]]]:
    """split → method → report, with its per-query diagnostics under "diagnostics"."""
    directory = bundle_dir / REPORTS_DIR
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for path in sorted(directory.glob("*.json")):
        report = json.loads(path.read_text())
        extra = directory / DIAGNOSTICS_DIR / path.name
        report["diagnostics"] = json.loads(extra.read_text()) if extra.is_file() else {}
        out.setdefault(report["split"], {})[report["method"]] = report
    return out


def error_bar(report: dict[str, Any], metric: str) -> float:
    """The standard error over queries of a method's metric, 0 when its reports predate it."""
    values = report["diagnostics"].get("per_query", {}).get(metric)
    if not values:
        return 0.0
    array = np.asarray(values, dtype=float)
    return standard_error(array[np.isfinite(array)])


def png(fig: Any) -> str:
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return base64.b64encode(buffer.getvalue()).decode()


def quality_figure(reports: dict[str, dict[str, dict[str, Any]]]) -> str:
    import matplotlib.pyplot as plt

    splits = [s for s in SPLITS if s in reports] or sorted(reports)
    methods = sorted({m for s in splits for m in reports[s]},
                     key=lambda m: reports[splits[0]].get(m, {}).get("metrics", {})
                     .get("coverage@10") or 0.0)
    fig, axes = plt.subplots(1, 2, figsize=(11, 0.45 * len(methods) + 1.5), sharey=True)
    y = np.arange(len(methods))
    height = 0.8 / len(splits)
    for ax, metric in zip(axes, ("coverage@10", "recall@5k"), strict=True):
        for j, split in enumerate(splits):
            found = [reports[split].get(m) for m in methods]
            values = [r["metrics"].get(metric) or 0.0 if r else 0.0 for r in found]
            errors = [error_bar(r, metric) if r else 0.0 for r in found]
            ax.barh(y + j * height, values, height, xerr=errors, capsize=2, label=split)
        ax.set(xlabel=metric, title=f"{metric} (± standard error over queries)")
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_yticks(y + height * (len(splits) - 1) / 2, methods)
    axes[0].legend(loc="lower right")
    fig.tight_layout()
    return png(fig)


def reach_figure(reports: dict[str, dict[str, dict[str, Any]]]) -> str | None:
    import matplotlib.pyplot as plt

    points = [(split, method, r["metrics"]["reach@10"], r["metrics"]["coverage@10"])
              for split, by_method in reports.items() for method, r in by_method.items()
              if r["metrics"].get("reach@10") is not None]
    if not points:
        return None
    fig, ax = plt.subplots(figsize=(7.5, 6))
    top = max(max(p[2] for p in points), max(p[3] for p in points)) * 1.1
    ax.plot([0, top], [0, top], "k--", alpha=0.4, label="coverage = reach (perfect selection)")
    for split, marker in zip(SPLITS, "os", strict=True):
        chosen = [p for p in points if p[0] == split]
        ax.scatter([p[2] for p in chosen], [p[3] for p in chosen], marker=marker, label=split)
        for _, method, reach, coverage in chosen:
            ax.annotate(method, (reach, coverage), fontsize=8, xytext=(4, 2),
                        textcoords="offset points")
    ax.set(xlabel="reach@10: best coverage possible among the candidates the method chose from",
           ylabel="coverage@10 achieved", xlim=(0, top), ylim=(0, top))
    ax.legend(loc="upper left")
    ax.grid(alpha=0.3)
    return png(fig)


def steps_figure(bundle_dir: Path) -> str | None:
    import matplotlib.pyplot as plt

    curves = {p.stem: json.loads(p.read_text())
              for p in sorted((bundle_dir / REPORTS_DIR / CURVE_DIR).glob("*.json"))}
    if not curves:
        return None
    fig, (quality, cost) = plt.subplots(1, 2, figsize=(11, 4))
    for split, curve in curves.items():
        for solver in sorted({p["solver"] for p in curve["points"]}):
            chosen = [p for p in curve["points"] if p["solver"] == solver]
            steps = [p["steps"] for p in chosen]
            label = f"{solver}, {split}"
            quality.plot(steps, [p["coverage@10"] for p in chosen], "o-", label=label)
            cost.plot(steps, [p["solver_ms_per_query"] for p in chosen], "o-", label=label)
    quality.set(xscale="log", xlabel="solver steps", ylabel="coverage@10", title="quality")
    cost.set(xscale="log", yscale="log", xlabel="solver steps", ylabel="solver ms per query",
             title="cost")
    for ax in (quality, cost):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return png(fig)


def trigger_figure(bundle_dir: Path) -> str | None:
    """Per split: share fanned out vs the gain, harm and net of fanning out (the curve's
    objective), and the harm to hit@1 (narrow queries' exact item)."""
    import matplotlib.pyplot as plt

    curves = [json.loads(p.read_text())
              for p in sorted((bundle_dir / REPORTS_DIR / TRIGGER_DIR).glob("*.json"))]
    if not curves:
        return None
    fig, axes = plt.subplots(1, len(curves), figsize=(5.5 * len(curves), 4), squeeze=False)
    for ax, curve in zip(axes[0], curves, strict=True):
        share = [p["share_fanned_out"] for p in curve["points"]]
        goal = curve["objective"]
        for key, style in (("gain", "g-"), ("harm", "r-"), ("net", "k-")):
            ax.plot(share, [p[goal][key] for p in curve["points"]], style, label=f"{goal} {key}")
        ax.plot(share, [p["hit@1"]["harm"] for p in curve["points"]], "r:", label="hit@1 harm")
        served = curve["served"]
        ax.axvline(served["share_fanned_out"], color="0.5", ls="--", label="served threshold")
        ax.set(xlabel="share of queries fanned out", ylabel="mean per query vs single",
               title=f"{curve['fanout']} when the trigger says so, {curve['split']}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return png(fig)


def example_queries(coverage: dict[str, np.ndarray], n: int) -> list[int]:
    """The queries that tell the served student from one dense query most: half where
    diffusion beats single by the most, half where it loses by the most. Without both, the
    queries whose coverage spreads most across the methods."""
    if "diffusion" in coverage and "single" in coverage:
        gain = np.nan_to_num(coverage["diffusion"] - coverage["single"])  # (Q,)
        order = np.argsort(-gain, kind="stable")
        wins = [int(i) for i in order[: (n + 1) // 2] if gain[i] > 0]
        losses = [int(i) for i in order[::-1][: n // 2] if gain[i] < 0]
        return wins + losses
    table = np.array(list(coverage.values()))  # (M, Q)
    spread = np.nan_to_num(np.nanmax(table, axis=0) - np.nanmin(table, axis=0))
    return [int(i) for i in np.argsort(-spread, kind="stable")[:n]]


def examples(bundle_dir: Path, split: str, by_method: dict[str, dict[str, Any]],
             items: ItemStore, n: int = EXAMPLES) -> str:
    """HTML tables for the example queries: the query's branches, and per method the items
    it returned, each marked with its branch."""
    queries = load_queries(bundle_dir, split)
    kept = {m: by_method[m] for m in EXAMPLE_METHODS  # whole-split reports only (no --limit)
            if m in by_method and len(by_method[m]["diagnostics"].get("items") or ()) ==
            len(queries)}
    if len(kept) < 2:
        return ("<p>Per-query examples appear once two methods are evaluated on the whole "
                "split by this version.</p>")
    coverage = {m: np.array([c if c is not None else np.nan for c in
                             r["diagnostics"]["per_query"]["coverage@10"]])
                for m, r in kept.items()}
    out = []
    for i in example_queries(coverage, n):
        query = queries[i]
        branch_of = {item: b for b, group in enumerate(query.groups) for item in group}
        heads = ", ".join(f"{b}: {html.escape(name_of(items, g[0]))}"
                          for b, g in enumerate(query.groups))
        rows = []
        for method, report in kept.items():
            cells = []
            for item in report["diagnostics"]["items"][i]:
                branch = branch_of.get(item)
                tag = "miss" if branch is None else "hit"
                label = "–" if branch is None else str(branch)
                cells.append(f'<span class="{tag}">{html.escape(name_of(items, item))} '
                             f"[{label}]</span>")
            rows.append(f"<tr><th>{html.escape(method)}<br>coverage "
                        f"{coverage[method][i]:.2f}</th><td>{'; '.join(cells)}</td></tr>")
        out.append(f"<h3>“{html.escape(query.query)}” — {len(query.groups)} branches</h3>"
                   f"<p class='miss'>branches: {heads}</p><table>{''.join(rows)}</table>")
    return "\n".join(out)


def name_of(items: ItemStore, item_id: str) -> str:
    return item_name(items.texts[items.row(item_id)])


def figure(data: str | None, caption: str, missing: str) -> str:
    if data is None:
        return f"<p>{missing}</p>"
    return (f'<figure><img alt="{html.escape(caption[:60])}" src="data:image/png;base64,{data}">'
            f"<figcaption>{caption}</figcaption></figure>")


def plotting() -> bool:
    """Whether matplotlib (the train extra) is here; `make serve`'s install writes the report
    without its plots."""
    if find_spec("matplotlib") is None:
        return False
    import matplotlib

    matplotlib.use("Agg")
    return True


def write_html_report(bundle_dir: Path) -> Path:
    """Write eval/report.html from every report in the bundle's eval folder."""
    plots = plotting()

    def drawn(draw: Callable[..., str | None], *inputs: Any) -> str | None:
        return draw(*inputs) if plots else None

    reports = load_reports(bundle_dir)
    items = ItemStore.load(bundle_dir, mmap=True)
    sections = [
        f"<h1>Evaluation of bundle <code>{html.escape(bundle_dir.name)}</code></h1>",
        "" if plots else f"<p>Without plots: {html.escape(NO_PLOTS)}.</p>",
        "<h2>Quality per method</h2>",
        figure(drawn(quality_figure, reports) if reports else None,
               "How many of a query's branches (child categories) the 10 returned items touch "
               "(coverage@10), and how much of the query's subtree the method's 5,000-item pool "
               "holds (recall@5k). Longer is better; whiskers are ± one standard error over the "
               "split's queries, so bars whose whiskers overlap are not told apart.",
               "No evaluation reports yet: run <code>r4t eval</code>."),
        "<h2>Generation or selection?</h2>",
        figure(drawn(reach_figure, reports),
               "Each method's coverage against its reach, the best coverage any 10 of the "
               "candidates it chose from could give. A point far below the dashed line lost at "
               "selection; a point low on both axes never had the right candidates.",
               "No method reports reach@10 yet."),
        "<h2>When to fan out</h2>",
        figure(drawn(trigger_figure, bundle_dir),
               "route=auto fans a query out when its breadth reaches a threshold. Left to "
               "right, lower thresholds fan out more queries: what that gains (green) and "
               "costs (red) against answering every query with one dense query, per query "
               "over the whole split; the black net is their sum.",
               "No trigger curve yet: run <code>r4t eval --trigger-curve --split "
               "mixed-val</code>."),
        "<h2>The steps curve</h2>",
        figure(drawn(steps_figure, bundle_dir),
               "Diffusion quality and solver cost against the number of solver steps: where "
               "the left curve flattens, more steps only cost time.",
               "No steps curve yet: run <code>r4t eval --steps-curve</code>."),
    ]
    for split, by_method in reports.items():
        sections.append(f"<h2>Example queries ({html.escape(split)})</h2>"
                        "<p>Where the served student (diffusion) gains most over one dense "
                        "query, then where it loses most; without both, where the methods "
                        "spread most. Coverage is the mean over seeds; the items shown are the "
                        "first seed's. Each item is tagged with the branch it belongs to "
                        "(<span class='hit'>[n]</span>) or none (<span class='miss'>[–]</span>)."
                        "</p>")
        sections.append(examples(bundle_dir, split, by_method, items))
    page = (f"<!doctype html><html lang='en'><head><meta charset='utf-8'><title>r4t evaluation"
            f"</title><style>{STYLE}</style></head><body>{''.join(sections)}</body></html>\n")
    path = bundle_dir / REPORTS_DIR / REPORT_FILE
    path.write_text(page)
    return path
