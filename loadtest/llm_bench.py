"""Figure 5 with a real LLM: the AR route over the bundle's GGUF policy (llm/, llama.cpp) against
the diffusion student (when the bundle has one) and `single` (one dense query, the floor), seconds
per batch, same run, same machine, the service's own path objects.

llama.cpp decodes one sequence at a time, so the LLM's batch costs the sum of its queries: it is
measured up to --llm-max-batch, and each larger batch is shown as that measured per-query cost
times the batch, marked "projected" (never mixed with the measured figures). Run alone.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from tqdm import tqdm

from loadtest.bench import (
    BATCHES,
    PAPER_SECONDS,
    REPEATS,
    best_of,
    compute_s,
    diffusion_path,
    machine,
    timed_batch,
)
from loadtest.figure import figure
from loadtest.report import publish
from service.api.state import settle_heap
from service.arguments import positive, positive_list
from service.artifacts.bundle import load_bundle, require_stages
from service.errors import R4TError
from service.routes.single import SingleRoute
from service.runtime.encoder import Encoder
from service.runtime.index import IndexChoice
from service.scheduling.assembly import SAMPLER_FILE, llm_route
from service.settings import DEFAULT_BUNDLE, Settings

LLM_MAX_BATCH = 64  # minutes of Gemma 3 270M on 2 cores; larger batches are projected
K = 10


def run(bundle_dir: Path, batches: tuple[int, ...], threads: int, llm_max_batch: int,
        out_dir: Path) -> dict[str, Any]:
    require_stages(bundle_dir, ("catalog", "lexical", "benchmark", "llm"), "llm_bench")
    bundle = load_bundle(bundle_dir, IndexChoice.parse(Settings(bundle=bundle_dir).index))
    encoder = Encoder(bundle.encoder_config, threads)
    fast: dict[str, Any] = {"single": SingleRoute(bundle, encoder)}
    if bundle.has(SAMPLER_FILE):
        fast["diffusion"] = diffusion_path(bundle_dir, threads, encoder, bundle=bundle)
    settings = Settings(bundle=bundle_dir, threads=threads, ar_backend="llama",
                        fanout_cache_size=0)  # timed batches repeat
    llm = llm_route(settings, bundle, encoder)
    texts = [json.loads(line)["query"] for line in
             (bundle_dir / "benchmark" / "test.jsonl").read_text().splitlines()]
    for path in (*fast.values(), llm):
        timed_batch(path, texts[:2], K)  # warm-up (llama.cpp caches the prompts' shared prefix)
    settle_heap()
    rows, per_query = [], None
    for b in tqdm(batches, desc="bench llm", unit="batch size"):
        queries = [texts[i % len(texts)] for i in range(b)]
        row: dict[str, Any] = {"batch": b, "paper_ar_s": PAPER_SECONDS.get(b, (None, None))[0],
                               "paper_diffusion_s": PAPER_SECONDS.get(b, (None, None))[1]}
        for name, path in fast.items():
            clock = best_of(REPEATS, timed_batch, path, queries, K)
            row.update({f"{name}_s": compute_s(clock), f"{name}_stages_s": clock})
        if b <= llm_max_batch:  # one run: minutes, and the machine is quiet
            a = timed_batch(llm, queries, K)
            per_query = compute_s(a) / b
            row.update(llm_s=compute_s(a), llm_measured=True, llm_tokens_per_query=a.get(
                "tokens", 0.0) / b, llm_stages_s={s: v for s, v in a.items() if s != "tokens"})
        elif per_query is not None:
            row.update(llm_s=per_query * b, llm_measured=False)
        if "llm_s" in row:
            row["llm_vs_single"] = row["llm_s"] / row["single_s"]
            if "diffusion_s" in row:
                row["speedup"] = row["llm_s"] / row["diffusion_s"]
        rows.append(row)
    described = llm.backend.describe()
    report = {"machine": machine(), "threads": threads, "llm_max_batch": llm_max_batch,
              "llm": {key: described.get(key) for key in
                      ("backend", "model", "mode", "temperature", "max_new_tokens", "providers")},
              "sampler": None if "diffusion" not in fast else {
                  key: fast["diffusion"].sampler.config.get(key) for key in
                  ("solver", "steps", "draws", "params", "flops_per_query")},
              "repeats": {"diffusion": REPEATS, "llm": 1}, "rows": rows}
    llm.backend.close()
    publish(out_dir, "bench-llm", report, markdown(report), echo=False)
    plot(report, out_dir / "bench-llm.png")
    return report


def markdown(report: dict[str, Any]) -> str:
    m, llm, s = report["machine"], report["llm"], report["sampler"]
    lines = [
        "# Figure 5 with a real LLM: the GGUF policy's AR route vs the diffusion student", "",
        f"- machine: {m['cpu']}, {m['cores']} cores; threads={report['threads'] or 'all'}",
        f"- AR: {llm['model']} in {llm['backend']} ({llm['providers'][0]}), {llm['mode']} mode, "
        f"T={llm['temperature']}, ≤ {llm['max_new_tokens']} new tokens, one run per batch",
        "- diffusion: " + ("none in this bundle (its column is empty)" if s is None else
                           f"{s['solver']}, {s['steps']} step(s), {s.get('draws') or 1} draw(s), "
                           f"{s['params']:,} params") + f"; it and `single`: the fastest of "
        f"{REPEATS} runs",
        f"- LLM batches above {report['llm_max_batch']} are projected: the largest measured "
        "batch's seconds per query times the batch (llama.cpp decodes one sequence at a time)",
        "",
        "| batch | LLM AR (s) | diffusion (s) | single (s) | LLM / diffusion | LLM / single | "
        "LLM tokens/query | paper AR / diff. (s) | paper speedup |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["rows"]:
        mark = "" if r.get("llm_measured") else " (proj.)"
        ar = "–" if "llm_s" not in r else f"{r['llm_s']:.2f}{mark}"
        diffusion = f"{r['diffusion_s']:.3f}" if "diffusion_s" in r else "–"
        speed = f"{r['speedup']:.0f}x{mark}" if "speedup" in r else "–"
        vs_single = f"{r['llm_vs_single']:.0f}x{mark}" if "llm_vs_single" in r else "–"
        tokens = f"{r['llm_tokens_per_query']:.0f}" if r.get("llm_measured") else "–"
        paper = (f"{r['paper_ar_s']} / {r['paper_diffusion_s']} | "
                 f"{r['paper_ar_s'] / r['paper_diffusion_s']:.1f}x" if r["paper_ar_s"]
                 else "– | –")
        lines.append(f"| {r['batch']} | {ar} | {diffusion} | {r['single_s']:.4f} | {speed} | "
                     f"{vs_single} | {tokens} | {paper} |")
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], path: Path) -> None:
    rows = report["rows"]
    measured = [r for r in rows if r.get("llm_measured")]
    projected = [r for r in rows if "llm_s" in r and not r.get("llm_measured")]
    with figure(path, (7, 4.5)) as ax:
        ax.plot([r["batch"] for r in measured], [r["llm_s"] for r in measured], "o-",
                label=f"{report['llm']['model']} AR (llama.cpp)")
        if projected:
            ax.plot([measured[-1]["batch"]] + [r["batch"] for r in projected],
                    [measured[-1]["llm_s"]] + [r["llm_s"] for r in projected], "o:",
                    alpha=0.5, label="LLM AR, projected")
        if report["sampler"] is not None:
            ax.plot([r["batch"] for r in rows], [r["diffusion_s"] for r in rows], "s-",
                    label="r4t diffusion student")
        ax.plot([r["batch"] for r in rows], [r["single_s"] for r in rows], "^-",
                label="single (one dense query)")
        ax.plot([r["batch"] for r in rows], [r["paper_ar_s"] for r in rows], "o--", alpha=0.4,
                label="paper AR (4B, unstated hardware)")
        ax.plot([r["batch"] for r in rows], [r["paper_diffusion_s"] for r in rows], "s--",
                alpha=0.4, label="paper diffusion")
        ax.set(xscale="log", yscale="log", xlabel="batch size", ylabel="seconds per batch",
               title=f"{report['machine']['cpu']} ({report['machine']['cores']} cores)")
        ax.legend(fontsize=8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--bundle", type=Path, default=DEFAULT_BUNDLE,
                        help="a bundle with llm/ (r4t llm), and diffusion/ for its column")
    parser.add_argument("--batches", type=positive_list, default=BATCHES)
    parser.add_argument("--llm-max-batch", type=positive, default=LLM_MAX_BATCH,
                        help="the largest batch the LLM runs; larger ones are projected")
    parser.add_argument("--threads", type=int, default=0, help="threads of both (0 = all)")
    parser.add_argument("--out", type=Path, default=Path("loadtest/results"))
    args = parser.parse_args()
    try:
        report = run(args.bundle, args.batches, args.threads, args.llm_max_batch, args.out)
    except R4TError as exc:
        parser.exit(2, f"{parser.prog}: error: {exc}\n")  # one line
    print(markdown(report))


if __name__ == "__main__":
    main()
