"""The honest speed benchmark: the served routes, same run, same machine, per stage.

For each batch size, seconds per batch of the diffusion path (encode → context → solver →
search), of the autoregressive path (decode → encode sub-queries → search), of the `ranked`
route (the served default, when the bundle has a ranker) and of one dense query (`single`, the
floor), each the service's own path object with its own stage clock; what
route=auto's fan-out trigger adds to a batch (one decision per query) beside `single`; the
speedup, the solver's FLOPs per query, the AR tokens generated, and this machine's measured
fp32 matmul peak with the solver's share of it. Writes JSON, a markdown table in the style of
the paper's Figure 5, and a PNG plot. Run alone: anything else computing on the machine skews
every number.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
from tqdm import tqdm

from loadtest.figure import figure
from loadtest.report import publish
from service.api.state import settle_heap
from service.arguments import positive_list
from service.artifacts.bundle import Bundle, load_bundle, require_stages
from service.artifacts.stages import AR_STAGE, ONNX_POLICIES
from service.errors import R4TError
from service.ranker.ranker import RANKER_CONFIG, RANKER_DIR
from service.routes.answer import RouteQuery, searched_s
from service.routes.diffusion import DiffusionRoute
from service.routes.ranked import RankedRoute
from service.routes.single import SingleRoute
from service.runtime.encoder import Encoder
from service.runtime.index import IndexChoice
from service.runtime.sampler import DiffusionSampler
from service.scheduling.assembly import ar_route
from service.scheduling.trigger import FanoutTrigger
from service.settings import DEFAULT_BUNDLE, Settings

BATCHES = (8, 16, 32, 64, 128, 256, 512, 1024)
REPEATS = 3  # per batch size and path; the fastest run is reported
PAIRS = 7  # alternating runs of two paths (a route and single, or the baseline), per batch size
PAPER_SECONDS = {8: (1.456, 0.090), 16: (1.518, 0.098), 32: (1.652, 0.157), 64: (1.852, 0.230),
                 128: (5.632, 0.527), 256: (11.448, 1.091), 512: (24.531, 2.141),
                 1024: (49.766, 3.930)}


def matmul_peak_gflops(n: int = 2048, repeats: int = 5) -> float:
    """Best-of-N fp32 GEMM rate of this machine through numpy's BLAS."""
    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    a @ a  # warm-up
    best = min(_timed(lambda: a @ a) for _ in range(repeats))
    return 2 * n**3 / best / 1e9


def best_of(repeats: int, measure: Any, *args: Any) -> dict[str, float]:
    """The fastest of `repeats` runs (by total seconds): the least disturbed measurement."""
    runs = [measure(*args) for _ in range(repeats)]
    return min(runs, key=compute_s)


def _timed(fn: Any) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def machine() -> dict[str, Any]:
    model = "unknown"
    if Path("/proc/cpuinfo").is_file():
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {"cpu": model, "cores": os.cpu_count(), "python": platform.python_version(),
            "onnxruntime": ort.__version__, "available_providers": ort.get_available_providers()}


def timed_batch(path: Any, queries: list[str], k: int) -> dict[str, float]:
    """One batch through a served path: its own per-stage seconds (and AR tokens)."""
    answers = path([RouteQuery(text, k) for text in queries])
    clock = {stage: float(seconds) for stage, seconds in answers[0].timings_s.items()}
    if any(a.tokens for a in answers):
        clock["tokens"] = float(sum(a.tokens for a in answers))
    return clock


def paired_ratio(a: Any, b: Any, queries: list[str], k: int, pairs: int = PAIRS) -> float:
    """Median over alternating runs (a then b, then b then a) of a's time / b's: holds while
    the machine's speed drifts."""
    ratios = []
    for i in range(pairs):
        first, second = (a, b) if i % 2 == 0 else (b, a)
        t_first, t_second = (compute_s(timed_batch(p, queries, k)) for p in (first, second))
        ratios.append(t_first / t_second if i % 2 == 0 else t_second / t_first)
    return float(np.median(ratios))


BENCH_STAGES = ("catalog", "lexical", "benchmark", ONNX_POLICIES, "diffusion")


def trigger_s(trigger: FanoutTrigger, queries: list[str]) -> float:
    """The fastest of REPEATS runs of route=auto's decision for every query of a batch."""
    return min(_timed(lambda: [trigger.decide(text) for text in queries])
               for _ in range(REPEATS))


def run_trigger(bundle_dir: Path, batches: tuple[int, ...], out_dir: Path) -> dict:
    """`--trigger-only`: the trigger beside `single` alone, for a bundle without stages 1-3."""
    require_stages(bundle_dir, ("catalog", "lexical", "benchmark"), "bench --trigger-only")
    settings = Settings(bundle=bundle_dir)
    bundle = load_bundle(bundle_dir, IndexChoice.parse(settings.index))
    single = SingleRoute(bundle, Encoder(bundle.encoder_config))
    trigger = FanoutTrigger(bundle.lexical, settings.fanout_threshold)
    texts = benchmark_texts(bundle_dir)
    timed_batch(single, texts[:8], 10)  # warm-up
    rows = []
    for b in tqdm(batches, desc="bench trigger", unit="batch size"):
        queries = [texts[i % len(texts)] for i in range(b)]
        single_s = compute_s(best_of(REPEATS, timed_batch, single, queries, 10))
        decide_s = trigger_s(trigger, queries)
        rows.append({"batch": b, "single_s": single_s, "trigger_s": decide_s,
                     "trigger_vs_single": decide_s / single_s})
    report = {"machine": machine(), "index": bundle.index.describe(), "rows": rows}
    lines = ["# route=auto's fan-out trigger beside `single`, same run", "",
             f"- machine: {report['machine']['cpu']}, {report['machine']['cores']} cores; "
             f"fastest of {REPEATS} runs; the benchmark's test queries", "",
             "| batch | single (s) | trigger (s) | trigger / single |", "|---:|---:|---:|---:|"]
    lines += [f"| {r['batch']} | {r['single_s']:.4f} | {r['trigger_s']:.5f} | "
              f"{r['trigger_vs_single']:.3f}x |" for r in rows]
    publish(out_dir, "bench-trigger", report, "\n".join(lines), echo=False)
    return report


def benchmark_texts(bundle_dir: Path) -> list[str]:
    return [json.loads(line)["query"] for line in
            (bundle_dir / "benchmark" / "test.jsonl").read_text().splitlines()]


def compute_s(clock: dict[str, float]) -> float:
    return sum(v for key, v in clock.items() if key != "tokens")


def diffusion_path(bundle_dir: Path, threads: int, encoder: Encoder | None = None,
                   index: str | None = None, bundle: Bundle | None = None) -> DiffusionRoute:
    """The bundle's diffusion path (`bundle`: that bundle already loaded, its index built)."""
    if bundle is None:
        choice = IndexChoice.parse(index or Settings(bundle=bundle_dir).index)
        bundle = load_bundle(bundle_dir, choice)
    sampler = DiffusionSampler(bundle_dir / "diffusion", threads=threads)
    return DiffusionRoute(bundle, encoder or Encoder(bundle.encoder_config, threads), sampler,
                         seed=0)


def run(bundle_dir: Path, batches: tuple[int, ...], threads: int, out_dir: Path,
        baseline: Path | None = None, baseline_index: str | None = None) -> dict:
    require_stages(bundle_dir, BENCH_STAGES, "make bench")
    if baseline is not None:
        require_stages(baseline, BENCH_STAGES, "make bench BASELINE=")
    diffusion = diffusion_path(bundle_dir, threads)
    bundle, encoder, sampler = diffusion.bundle, diffusion.encoder, diffusion.sampler
    paths = {"diffusion": diffusion,
             "ar": ar_route(Settings(bundle=bundle_dir, threads=threads, seed=0, ar_backend="onnx",
                                    fanout_cache_size=0),  # timed batches repeat
                           bundle, encoder),
             "single": SingleRoute(bundle, encoder)}
    if (bundle_dir / RANKER_DIR / RANKER_CONFIG).is_file():
        paths["ranked"] = RankedRoute(bundle, encoder)
    if baseline is not None or baseline_index:  # another diffusion path, in the same loop
        paths["baseline"] = diffusion_path(baseline or bundle_dir, threads, encoder,
                                           baseline_index)
        if paths["baseline"].bundle.encoder_identity != bundle.encoder_identity:
            raise SystemExit(f"--baseline {baseline} has another encoder; compare like bundles")
    k = int(sampler.config.get("k", 10))
    texts = benchmark_texts(bundle_dir)
    for path in paths.values():
        timed_batch(path, texts[:8], k)  # warm-up
    settle_heap()  # as the service does once loaded: no full collection walks the bundles
    peak = matmul_peak_gflops()
    trigger = FanoutTrigger(bundle.lexical, Settings(bundle=bundle_dir).fanout_threshold)
    rows = []
    for b in tqdm(batches, desc="bench", unit="batch size"):
        queries = [texts[i % len(texts)] for i in range(b)]
        clocks = {name: best_of(REPEATS, timed_batch, path, queries, k)
                  for name, path in paths.items()}
        clocks["trigger"] = {"decide": trigger_s(trigger, queries)}
        rows.append(_row(b, clocks, sampler.config, peak))
        for name in ("diffusion", "ranked"):  # against single, robust to the machine's drift
            if name in paths:
                rows[-1][f"paired_{name}_vs_single"] = paired_ratio(paths[name], paths["single"],
                                                                    queries, k)
        if "baseline" in paths:
            rows[-1]["paired_vs_baseline"] = paired_ratio(paths["diffusion"], paths["baseline"],
                                                          queries, k)
    decoder = paths["ar"].backend.decoder  # type: ignore[union-attr]
    report = {"machine": machine(), "matmul_peak_gflops": peak, "threads": threads,
              "providers": {name: path.providers for name, path in paths.items()},
              "sampler": {key: sampler.config.get(key) for key in
                          ("solver", "steps", "cfg_weight", "draws", "context_source", "params",
                           "flops_per_query", "rows")},
              AR_STAGE: {"params": decoder.config.get("params"),  # the served budget and T:
                       "max_new_tokens": paths["ar"].backend.max_new_tokens,  # type: ignore
                       "decoding": paths["ar"].backend.decoding,  # type: ignore[union-attr]
                       "temperature": paths["ar"].backend.temperature},  # type: ignore
              "index": bundle.index.describe(),
              "baseline": None if "baseline" not in paths else {
                  "bundle": str(baseline or bundle_dir),
                  "index": paths["baseline"].bundle.index.describe(),
                  "sampler": paths["baseline"].sampler.config},
              "rows": rows}
    write_outputs(report, out_dir)
    return report


def _row(b: int, clocks: dict[str, dict[str, float]], config: dict, peak: float) -> dict:
    d, a, single = clocks["diffusion"], clocks["ar"], clocks["single"]
    d_total, a_total, s_total = compute_s(d), compute_s(a), compute_s(single)
    ranked = compute_s(clocks["ranked"]) if "ranked" in clocks else None
    baseline = {} if "baseline" not in clocks else {
        "baseline_s": compute_s(clocks["baseline"]), "baseline_stages_s": clocks["baseline"],
        "diffusion_vs_baseline": d_total / compute_s(clocks["baseline"])}
    flops = float(config.get("flops_per_query") or 0.0)
    solver = d.get("solver", 0.0)
    achieved = flops * b / solver / 1e9 if solver > 0 else 0.0
    # a lower bound on this model and context here: its inputs as measured, its denoiser's
    # FLOPs at the machine's measured matmul peak (its resolution left out)
    bound = d.get("encode", 0.0) + d.get("context", 0.0) + flops * b / (peak * 1e9)
    return {
        "batch": b,
        "diffusion_s": d_total, "diffusion_stages_s": d,
        "ar_s": a_total, "ar_stages_s": {key: v for key, v in a.items() if key != "tokens"},
        "single_s": s_total, "single_stages_s": single,
        "ranked_s": ranked, "ranked_vs_single": None if ranked is None else ranked / s_total,
        "trigger_s": clocks["trigger"]["decide"],
        "trigger_vs_single": clocks["trigger"]["decide"] / s_total,
        "ar_tokens": int(a.get("tokens", 0)), "ar_tokens_per_query": a.get("tokens", 0.0) / b,
        "speedup": a_total / d_total, "diffusion_vs_single": d_total / s_total,
        "inputs_vs_single": (d.get("encode", 0.0) + d.get("context", 0.0)) / s_total,
        "bound_vs_single": bound / s_total,
        "solver_gflops": achieved, "solver_share_of_peak": achieved / peak if peak else None,
        "paper_ar_s": PAPER_SECONDS.get(b, (None, None))[0],
        "paper_diffusion_s": PAPER_SECONDS.get(b, (None, None))[1],
        **baseline,
    }


def markdown(report: dict) -> str:
    m, s, ar = report["machine"], report["sampler"], report[AR_STAGE]
    lines = [
        "# r4t speed benchmark: autoregressive vs diffusion, same run, same machine", "",
        f"- machine: {m['cpu']}, {m['cores']} cores, ONNX Runtime {m['onnxruntime']}, "
        f"providers diffusion={report['providers']['diffusion'][0]} "
        f"ar={report['providers']['ar'][0]}, threads={report['threads'] or 'default'}",
        f"- measured fp32 matmul peak: {report['matmul_peak_gflops']:.1f} GFLOP/s",
        f"- diffusion sampler: {s['solver']}, {s['steps']} steps, CFG w={s['cfg_weight']}, "
        f"{s.get('draws') or 1} draw(s), context {s.get('context_source') or 'nearest'}, "
        f"{s['params']:,} params, {s['flops_per_query'] / 1e6:.0f} MFLOP/query",
        f"- AR fan-out model: {ar['params']:,} params, T={ar.get('temperature')} (as served), "
        f"{ar.get('decoding', 'lines')} decoding, "
        f"≤ {ar['max_new_tokens']} new tokens, named sub-queries looked up",
        f"- each figure is the fastest of {REPEATS} runs; seconds per batch through the "
        "service's path objects (k distinct items), their own stage clocks",
        "- inputs / single: the diffusion path's encode and context lookup (what its denoiser "
        "reads) over the whole `single` path; bound / single: those plus the denoiser's FLOPs "
        "at the measured matmul peak, a lower bound on this model and context here",
        "- trigger / single: route=auto's fan-out decision for every query of the batch "
        "(service/scheduling/trigger.py) over the whole `single` path on the same queries",
        f"- paired: the median over {PAIRS} alternating runs of the route's time over "
        "`single`'s, which holds while the machine's speed drifts (the fastest runs above "
        "may come from different moments)", "",
        "| batch | AR (s) | diffusion (s) | single (s) | ranked (s) | speedup | "
        "diffusion / single | ranked / single | diffusion / single (paired) | "
        "ranked / single (paired) | "
        "inputs / single | bound / single | trigger / single | AR decode | AR encode+search | "
        "diff. encode | diff. context | diff. solver | diff. search | AR tokens/query | "
        "solver GFLOP/s (share of peak) | paper AR / diff. (s) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
        "---:|---:|---:|---:|",
    ]
    for r in report["rows"]:
        a, d = r["ar_stages_s"], r["diffusion_stages_s"]
        lines.append(
            f"| {r['batch']} | {r['ar_s']:.3f} | {r['diffusion_s']:.3f} | {r['single_s']:.4f} | "
            f"{_seconds(r.get('ranked_s'))} | {r['speedup']:.1f}x | "
            f"{r['diffusion_vs_single']:.1f}x | {_ratio(r.get('ranked_vs_single'))} | "
            f"{_ratio(r.get('paired_diffusion_vs_single'))} | "
            f"{_ratio(r.get('paired_ranked_vs_single'))} | "
            f"{r['inputs_vs_single']:.1f}x | {r['bound_vs_single']:.1f}x | "
            f"{r['trigger_vs_single']:.3f}x | {a['decode']:.3f} | "
            f"{a['encode'] + a.get('context', 0.0) + a['search']:.3f} | {d['encode']:.3f} | "
            f"{d.get('context', 0.0):.3f} | {d['solver']:.3f} | {d['search']:.3f} | "
            f"{r['ar_tokens_per_query']:.0f} | "
            f"{r['solver_gflops']:.1f} ({100 * (r['solver_share_of_peak'] or 0):.0f}%) | "
            f"{r['paper_ar_s']} / {r['paper_diffusion_s']} |")
    if report.get("baseline"):
        lines += baseline_table(report)
    return "\n".join(lines) + "\n"


def _seconds(value: float | None) -> str:
    return "–" if value is None else f"{value:.3f}"


def _ratio(value: float | None) -> str:
    return "–" if value is None else f"{value:.1f}x"


def baseline_table(report: dict) -> list[str]:
    """This bundle's diffusion path beside the baseline bundle's, per stage, same run."""
    base, own = report["baseline"], report.get("index", {})
    what = (f"the same bundle searching {base['index'].get('backend')} "
            f"({base['index'].get('collection') or base['index'].get('choice')}) instead of "
            f"{own.get('backend')} ({own.get('choice') or own.get('collection')})"
            if own and base.get("index", {}).get("backend") != own.get("backend")
            else f"the baseline bundle `{base['bundle']}`")
    lines = ["", f"## Against {what}", "",
             f"Paired: the median over {PAIRS} alternating runs of the two paths' time ratio, "
             "which holds while the machine's speed drifts; the other columns are each path's "
             "fastest run.", "",
             "| batch | diffusion (s) | baseline (s) | diffusion / baseline (paired) | "
             "diffusion / baseline (fastest) | context+search (s) | baseline context+search (s) | "
             "solver (s) | baseline solver (s) |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in report["rows"]:
        d, base = r["diffusion_stages_s"], r["baseline_stages_s"]
        lines.append(f"| {r['batch']} | {r['diffusion_s']:.3f} | {r['baseline_s']:.3f} | "
                     f"{r['paired_vs_baseline']:.2f}x | "
                     f"{r['diffusion_vs_baseline']:.2f}x | {searched_s(d):.3f} | "
                     f"{searched_s(base):.3f} | {d['solver']:.3f} | {base['solver']:.3f} |")
    return lines


def plot(report: dict, path: Path) -> None:
    batches = [r["batch"] for r in report["rows"]]
    with figure(path, (7, 4.5)) as ax:
        ax.plot(batches, [r["ar_s"] for r in report["rows"]], "o-", label="r4t autoregressive")
        ax.plot(batches, [r["diffusion_s"] for r in report["rows"]], "s-", label="r4t diffusion")
        ax.plot(batches, [r["paper_ar_s"] for r in report["rows"]], "o--", alpha=0.4,
                label="paper AR (4B, unstated hardware)")
        ax.plot(batches, [r["paper_diffusion_s"] for r in report["rows"]], "s--", alpha=0.4,
                label="paper diffusion")
        ax.set(xscale="log", yscale="log", xlabel="batch size", ylabel="seconds per batch",
               title=f"{report['machine']['cpu']} ({report['machine']['cores']} cores)")
        ax.legend()


def write_outputs(report: dict, out_dir: Path) -> None:
    publish(out_dir, "bench", report, markdown(report), echo=False)
    plot(report, out_dir / "bench.png")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--bundle", type=Path, default=DEFAULT_BUNDLE)
    parser.add_argument("--batches", type=positive_list, default=BATCHES)
    parser.add_argument("--threads", type=int, default=0, help="ONNX Runtime threads (0 = all)")
    parser.add_argument("--out", type=Path, default=Path("loadtest/results"))
    parser.add_argument("--baseline", type=Path,
                        help="another bundle whose diffusion path is measured beside this one's")
    parser.add_argument("--baseline-index", default=None, metavar="R4T_INDEX",
                        help="measure the diffusion path beside itself searching this index "
                             "(e.g. milvus, bundle)")
    parser.add_argument("--trigger-only", action="store_true",
                        help="only route=auto's trigger beside single (a bundle without stages "
                             "1-3) -> bench-trigger.md")
    args = parser.parse_args()
    try:
        if args.trigger_only:
            run_trigger(args.bundle, args.batches, args.out)
            print((args.out / "bench-trigger.md").read_text())
            return
        report = run(args.bundle, args.batches, args.threads, args.out, args.baseline,
                     args.baseline_index)
    except R4TError as exc:  # a missing or refused bundle, a bad R4T_INDEX
        parser.exit(2, f"{parser.prog}: error: {exc}\n")  # one line
    print(markdown(report))


if __name__ == "__main__":
    main()
