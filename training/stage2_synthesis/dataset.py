"""Stage 2's run folder: `queries.json`, `query_emb.npy` and shards of blocks (query, its k
items' rows and embeddings, the reward's terms), written by the policy's sampler or a picking
teacher, read whole by stage 3; a shard's `.npz` lands last, so a finished shard is complete."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SHARDS = "shards"


@dataclass
class SynthesisDataset:
    queries: list[str]
    query_emb: np.ndarray  # (N, d) float32
    target_emb: np.ndarray  # (N, k, d) float32
    target_rows: np.ndarray  # (N, k) int64 catalog rows
    query_index: np.ndarray  # (N,) int64 into `queries`
    reward: np.ndarray  # (N,) float32 composite reward
    terms: dict[str, np.ndarray]  # ground, diversity, alignment: (N,) float32
    subqueries: list[list[str]] | None = None

    def __len__(self) -> int:
        return len(self.query_index)


def save_shard(path: Path, arrays: dict[str, list], lines: list[str], k: int, dim: int) -> None:
    """Write <shard>.jsonl then <shard>.npz (the npz is the completion marker)."""
    empty = {"query_index": (0,), "rows": (0, k), "target": (0, k, dim)}
    data = {name: np.concatenate(parts) if parts else np.zeros(empty.get(name, (0,)))
            for name, parts in arrays.items()}
    data["rows"] = data["rows"].astype(np.int64)
    data["query_index"] = data["query_index"].astype(np.int64)
    data["target"] = data["target"].astype(np.float32)
    path.with_suffix(".jsonl").write_text("".join(line + "\n" for line in lines))
    tmp = path.with_name(path.stem + ".tmp.npz")
    np.savez(tmp, **data)
    tmp.replace(path)


def load_dataset(run_dir: Path, with_text: bool = False) -> SynthesisDataset:
    """Concatenate the finished shards of a synthesis run."""
    run_dir = Path(run_dir)
    queries = json.loads((run_dir / "queries.json").read_text())
    query_emb = np.load(run_dir / "query_emb.npy")  # (Q, d)
    paths = sorted((run_dir / SHARDS).glob("shard-[0-9][0-9][0-9][0-9][0-9].npz"))
    if not paths:
        raise FileNotFoundError(f"{run_dir} has no finished shards: run `r4t synthesize`")
    parts = [dict(np.load(p)) for p in paths]
    cat = {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}
    index = cat["query_index"].astype(np.int64)
    subs = None
    if with_text:
        subs = [json.loads(line)["subqueries"] for p in paths
                for line in p.with_suffix(".jsonl").read_text().splitlines() if line]
    return SynthesisDataset(
        queries=queries, query_emb=query_emb[index].astype(np.float32),
        target_emb=cat["target"].astype(np.float32), target_rows=cat["rows"].astype(np.int64),
        query_index=index, reward=cat["reward"].astype(np.float32),
        terms={t: cat[t].astype(np.float32) for t in ("ground", "diversity", "alignment")},
        subqueries=subs,
    )
