"""The stage-3 denoiser: a conditional set transformer over a block of L item-embedding rows.

Paper (Table 3): VE-SDE diffusion transformer, d=128, hidden/MLP 1024, 6 layers, 16 heads,
L=12 rows, 256 probability-flow steps, CFG 0.1 with condition drop 0.1, 53.9M parameters.
Here: EDM preconditioning (Karras et al. 2022) around a transformer with no positional
encoding (the block is a set, and the network is permutation-equivariant over rows) unless the
rows are `ordered` (below), conditioned on the query embedding and the noise level by
adaLN-Zero (DiT, Peebles & Xie 2023) or, as an option, by one extra conditioning token.
Either way the conditioning vector is also added to every row token. Measured on a proxy
dataset (400 steps, batch 128, same seed): adaLN-Zero reached a lower loss than the token
(train 0.873 vs 0.888; at σ = 0.05/0.3/1: 0.877/0.764/0.780 vs 0.904/0.771/0.788) at equal
wall time, hence the default; without the added vector adaLN-Zero learnt the query far more
slowly (σ = 1: 0.896 vs 0.829 after 250 steps).

Context (`context` = C > 0, the `cpu` default): the rows also cross-attend to the embeddings of
C catalog items, best first, with a learnt rank embedding; without them, the student has to
memorise the catalog's geometry from the query alone (it under-fit its teacher on train
queries: coverage@10 0.144 vs 0.171). `context_source` says which C items:
- "prompt" (the `cpu` default): exactly the items the teacher's prompt names, in its order
  (service.grounding.PromptNeighbourhood: the query's nearest distinct names, its own name
  skipped, each grounded to its item), so the student chooses from the set its teacher chose
  from. Measured against "nearest" (test / val coverage@10, 4 seeds): 0.179 / 0.170 vs
  0.151 / 0.151; on train queries 0.171 against its stage-2 targets' 0.176.
- "nearest": the query's C nearest items. Those share only 14 of 16 items with the prompt's
  list; the query's own item (40% of queries' nearest, never a teacher's line) and items that
  repeat a name took 12–16% of the student's picks.
The keys and values of the context are projected once per evaluation and shared by every
layer. The null condition of CFG drops the cross-attention to the context with the query.

Ordered rows (`ordered`, the `cpu` default, measured to help): each row carries a learnt
position embedding and training sorts every target block by its items' cosine to the query,
best first, so row i learns "the i-th nearest chosen item" and rows stop competing for the
same item. The block is then a sorted list rather than a set (the network is no longer
permutation-equivariant).

Context head (`head="context"`): instead of EDM's c_skip·x + c_out·F, the denoiser's output is
a mixture of the C context embeddings, D = softmax(logits)·context, with logits (B, L, C) from
each row's final hidden state against a projection of the items plus a learnt rank vector
(CDCD's "score interpolation", Dieleman et al. 2022). It trains by cross-entropy on which
context item each target row is; rows whose item is outside the context are left out of the
loss (with `context_source="nearest"`, 4.3% of the default stage-2 rows: the prompt's names
are deduplicated and skip the query's own, so some stand for items beyond the raw top C). For
the other rows the posterior mean E[y | x] that D estimates is such a mixture: the vector head
has to learn to land on the items, the mixture head stays in their convex hull by
construction (at w = 0). Measured worse than the vector head (see the `cpu` preset). Its null
condition drops the query and the cross-attention but still mixes the same items (the head's
vocabulary).
The cross-entropy is unweighted over EDM's log-normal noise levels, unlike CDCD's time warping.

Rows vs slots: with L = k (the default) row i is slot i. With L > k (the paper's 12) training
fills the L − k extra rows with copies of randomly chosen items of the same block, and serving
keeps the k rows that resolve most confidently to distinct items.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class DenoiserConfig:
    dim: int = 128  # item/query embedding size d
    rows: int = 10  # L, rows per generated block
    k: int = 10  # items returned per query
    hidden: int = 128
    mlp: int = 512
    layers: int = 4
    heads: int = 4
    conditioning: str = "adaln"  # "adaln" (adaLN-Zero) or "token" (one conditioning token)
    sigma_min: float = 0.002
    sigma_max: float = 1.0  # VE: ≈ 11× the data's per-coordinate std, enough to swamp it
    sigma_data: float = 1.0 / math.sqrt(128)  # unit-norm rows in d=128: per-coordinate std
    cond_drop: float = 0.1  # condition dropout for classifier-free guidance (paper: 0.1)
    fourier: int = 64  # noise-level Fourier features
    context: int = 0  # C, nearest catalog items the rows cross-attend to; 0 = none
    ordered: bool = False  # rows carry learnt positions; targets sorted by cosine to the query
    head: str = "vector"  # "vector": EDM-preconditioned output; "context": a mixture of the C items
    # which C items: "nearest", the query's C nearest; "prompt", the C items the teacher's
    # prompt names (service.grounding.PromptNeighbourhood)
    context_source: str = "nearest"

    def __post_init__(self) -> None:
        if self.head not in ("vector", "context"):
            raise ValueError(f"head must be 'vector' or 'context', got {self.head!r}")
        if self.context_source not in ("nearest", "prompt"):
            raise ValueError(f"context_source must be 'nearest' or 'prompt', "
                             f"got {self.context_source!r}")
        if self.head == "context" and self.context == 0:
            raise ValueError("head='context' mixes the context items: it needs context > 0")

    def to_dict(self) -> dict[str, Any]:
        """As a dict; a default head and context source are left out, so configs (and the
        hashes a resumed run must match) written before those options existed stay the same."""
        config = asdict(self)
        for name, default in (("head", "vector"), ("context_source", "nearest")):
            if config[name] == default:
                del config[name]
        return config


PRESETS: dict[str, DenoiserConfig] = {
    # Table 3: hidden 1024, MLP 1024, 6 layers, 16 heads, L = 12 → 80.2M params here (37.7M
    # of them adaLN-Zero modulations) vs the paper's 53.9M.
    "paper": DenoiserConfig(hidden=1024, mlp=1024, layers=6, heads=16, rows=12),
    # Sized for 2 CPU cores: 1.48M params, 21.6 MFLOP per query per step (flops_per_step);
    # the 16-item context matches the policy's prompt (PolicyConfig.context). Ordered rows:
    # with the context alone, 7.7 of 10 rows resolved to distinct items (test); ordered, 9.3.
    # Its context is the items the teacher's prompt names (test / val coverage@10 over 4 seeds
    # 0.179 / 0.170, against 0.151 / 0.151 with the query's nearest items). The mixture head
    # (head="context") scored 0.171 / 0.166 with the same context.
    "cpu": DenoiserConfig(hidden=128, mlp=512, layers=4, heads=4, context=16, ordered=True,
                          context_source="prompt"),
    "tiny": DenoiserConfig(hidden=32, mlp=64, layers=2, heads=2, fourier=16),
}


def preset(name: str, **overrides: Any) -> DenoiserConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown denoiser preset {name!r}; available: {sorted(PRESETS)}")
    return replace(PRESETS[name], **overrides)


class Attention(nn.Module):
    """Multi-head self-attention over the rows (no mask, no positions)."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, h = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.heads, h // self.heads)  # (B, N, 3, H, Dh)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each (B, H, N, Dh)
        weights = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(h // self.heads), dim=-1)
        mixed = (weights @ v).transpose(1, 2).reshape(b, n, h)  # (B, N, hidden)
        return self.out(mixed)


# the context's keys and values (B, H, C, Dh) and the keep gate (B, 1, 1) or None (keep all)
Memory = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


class CrossAttention(nn.Module):
    """Rows attend to the context's keys and values, (B, H, C, Dh) each, projected outside."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(hidden, eps=1e-6)
        self.q = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, hidden)
        nn.init.zeros_(self.out.weight)  # starts as the identity, like the adaLN-Zero gates
        nn.init.zeros_(self.out.bias)

    def forward(self, x: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        b, n, h = x.shape
        q = self.q(self.norm(x)).reshape(b, n, self.heads, h // self.heads)  # (B, N, H, Dh)
        q = q.transpose(1, 2)  # (B, H, N, Dh)
        weights = torch.softmax(q @ keys.transpose(-1, -2) / math.sqrt(h // self.heads), dim=-1)
        mixed = (weights @ values).transpose(1, 2).reshape(b, n, h)  # (B, N, hidden)
        return self.out(mixed)


class Block(nn.Module):
    """Pre-LN transformer block; with adaLN-Zero, LN shift/scale and residual gates come from c."""

    def __init__(self, hidden: int, mlp: int, heads: int, adaln: bool, cross: bool) -> None:
        super().__init__()
        self.cross = CrossAttention(hidden, heads) if cross else None
        self.norm1 = nn.LayerNorm(hidden, elementwise_affine=not adaln, eps=1e-6)
        self.norm2 = nn.LayerNorm(hidden, elementwise_affine=not adaln, eps=1e-6)
        self.attn = Attention(hidden, heads)
        self.mlp = nn.Sequential(nn.Linear(hidden, mlp), nn.GELU(approximate="tanh"),
                                 nn.Linear(mlp, hidden))
        self.modulation = nn.Linear(hidden, 6 * hidden) if adaln else None
        if self.modulation is not None:  # adaLN-Zero: every block starts as the identity
            nn.init.zeros_(self.modulation.weight)
            nn.init.zeros_(self.modulation.bias)

    def forward(self, x: torch.Tensor, c: torch.Tensor, memory: Memory | None = None
                ) -> torch.Tensor:
        """memory: the context's keys and values (B, H, C, Dh) and a (B, 1, 1) keep gate."""
        if self.modulation is None:
            x = x + self.attn(self.norm1(x))
            x = self._attend(x, memory)
            return x + self.mlp(self.norm2(x))
        mod = self.modulation(nn.functional.silu(c))[:, None, :]  # (B, 1, 6·hidden)
        shift1, scale1, gate1, shift2, scale2, gate2 = mod.chunk(6, dim=-1)  # each (B, 1, hidden)
        x = x + gate1 * self.attn(self.norm1(x) * (1 + scale1) + shift1)
        x = self._attend(x, memory)
        return x + gate2 * self.mlp(self.norm2(x) * (1 + scale2) + shift2)

    def _attend(self, x: torch.Tensor, memory: Memory | None) -> torch.Tensor:
        if self.cross is None or memory is None:
            return x
        keys, values, gate = memory
        attended = self.cross(x, keys, values)  # (B, N, hidden)
        return x + (attended if gate is None else gate * attended)


class SetDenoiser(nn.Module):
    """F_θ(c_in·x, c_noise, query) → (B, L, d), wrapped by EDM preconditioning in `denoise`;
    with the context head, logits (B, L, C) over the context items."""

    def __init__(self, config: DenoiserConfig) -> None:
        super().__init__()
        if config.hidden % config.heads:
            raise ValueError("hidden must be divisible by heads")
        if config.rows < config.k:
            raise ValueError(f"rows L={config.rows} must be at least k={config.k}")
        self.config = config
        adaln = config.conditioning == "adaln"
        if config.conditioning not in ("adaln", "token"):
            raise ValueError(f"conditioning must be 'adaln' or 'token', got {config.conditioning}")
        h = config.hidden
        self.register_buffer("freqs", torch.exp(torch.linspace(0.0, math.log(1000.0),
                                                               config.fourier // 2)))
        self.noise_mlp = nn.Sequential(nn.Linear(config.fourier, h), nn.SiLU(), nn.Linear(h, h))
        self.query_mlp = nn.Sequential(nn.Linear(config.dim, h), nn.SiLU(), nn.Linear(h, h))
        self.null_query = nn.Parameter(torch.zeros(config.dim))  # the dropped condition
        self.embed = nn.Linear(config.dim, h)
        if config.ordered:
            self.positions = nn.Parameter(0.02 * torch.randn(config.rows, h))  # (L, hidden)
        self.blocks = nn.ModuleList(
            Block(h, config.mlp, config.heads, adaln, config.context > 0)
            for _ in range(config.layers)
        )
        if config.context > 0:  # keys and values of the context, shared by every layer
            self.memory = nn.Linear(config.dim, 2 * h)
            self.rank = nn.Parameter(torch.zeros(config.context, 2 * h))  # neighbour rank
        self.final_norm = nn.LayerNorm(h, elementwise_affine=not adaln, eps=1e-6)
        self.final_mod = nn.Linear(h, 2 * h) if adaln else None
        mixture = config.head == "context"
        if mixture:  # the items the rows choose among, as logit keys
            self.vocab = nn.Linear(config.dim, h)
            self.vocab_rank = nn.Parameter(torch.zeros(config.context, h))  # (C, hidden)
        # zero-initialised: D starts as c_skip·x, or the context's mean with the mixture head
        self.head = nn.Linear(h, h if mixture else config.dim)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)
        if self.final_mod is not None:
            nn.init.zeros_(self.final_mod.weight)
            nn.init.zeros_(self.final_mod.bias)

    def condition(self, c_noise: torch.Tensor, query: torch.Tensor,
                  keep: torch.Tensor | None) -> torch.Tensor:
        """c = MLP(fourier(c_noise)) + MLP(query or null); keep (B,) is 1 to keep the query."""
        angles = c_noise[:, None] * self.freqs[None, :]  # (B, F/2)
        fourier = torch.cat([angles.cos(), angles.sin()], dim=-1)  # (B, F)
        if keep is not None:
            query = keep[:, None] * query + (1 - keep[:, None]) * self.null_query  # (B, d)
        return self.noise_mlp(fourier) + self.query_mlp(query)  # (B, hidden)

    def context_memory(self, context: torch.Tensor | None,
                       keep: torch.Tensor | None) -> Memory | None:
        """Keys, values (B, H, C, Dh) and keep gate (B, 1, 1) from context (B, C, d)."""
        if self.config.context == 0:
            return None
        if context is None or context.shape[1:] != (self.config.context, self.config.dim):
            got = None if context is None else tuple(context.shape)
            raise ValueError(f"context must be (B, {self.config.context}, {self.config.dim}), "
                             f"got {got}")
        b, c, _ = context.shape
        kv = self.memory(context) + self.rank  # (B, C, 2·hidden)
        kv = kv.reshape(b, c, 2, self.config.heads, -1).permute(2, 0, 3, 1, 4)  # (2, B, H, C, Dh)
        return kv[0], kv[1], None if keep is None else keep[:, None, None]  # gate (B, 1, 1)

    def forward(self, x: torch.Tensor, c_noise: torch.Tensor, query: torch.Tensor,
                keep: torch.Tensor | None = None,
                context: torch.Tensor | None = None) -> torch.Tensor:
        """F (B, L, d) with the vector head; logits (B, L, C) over the context with the
        mixture head."""
        out = self.head(self._hidden(x, c_noise, query, keep, context))  # (B, L, d | hidden)
        if self.config.head == "vector":
            return out
        keys = self.vocab(context) + self.vocab_rank  # (B, C, hidden)
        return out @ keys.transpose(1, 2) / math.sqrt(self.config.hidden)  # (B, L, C)

    def _hidden(self, x: torch.Tensor, c_noise: torch.Tensor, query: torch.Tensor,
                keep: torch.Tensor | None, context: torch.Tensor | None) -> torch.Tensor:
        c = self.condition(c_noise, query, keep)  # (B, hidden)
        memory = self.context_memory(context, keep)
        # c also enters every row token: with adaLN-Zero's zero-initialised gates and head,
        # a query reaching the rows only through modulations is learnt very slowly.
        h = self.embed(x) + c[:, None, :]  # (B, L, hidden)
        if self.config.ordered:
            h = h + self.positions  # (B, L, hidden)
        if self.final_mod is None:  # conditioning token prepended to the rows
            h = torch.cat([c[:, None, :], h], dim=1)  # (B, 1 + L, hidden)
        for block in self.blocks:
            h = block(h, c, memory)
        h = self.final_norm(h)
        if self.final_mod is None:
            h = h[:, 1:, :]  # (B, L, hidden): drop the conditioning token
        else:
            shift, scale = self.final_mod(nn.functional.silu(c))[:, None, :].chunk(2, dim=-1)
            h = h * (1 + scale) + shift  # (B, L, hidden)
        return h


def precondition(sigma: torch.Tensor, sigma_data: float) -> tuple[torch.Tensor, ...]:
    """EDM (Karras et al. 2022, Table 1) c_skip, c_out, c_in, c_noise for σ of shape (B,)."""
    total = sigma**2 + sigma_data**2
    c_skip = sigma_data**2 / total
    c_out = sigma * sigma_data / total.sqrt()
    c_in = 1.0 / total.sqrt()
    c_noise = sigma.log() / 4.0
    return c_skip, c_out, c_in, c_noise


def denoise(model: SetDenoiser, x: torch.Tensor, sigma: torch.Tensor, query: torch.Tensor,
            keep: torch.Tensor | None = None,
            context: torch.Tensor | None = None) -> torch.Tensor:
    """D_θ(x; σ, q) = c_skip·x + c_out·F_θ(c_in·x, c_noise, q), or with the context head
    softmax(F_θ(c_in·x, c_noise, q))·context. x (B, L, d), σ (B,)."""
    if model.config.head == "context":
        logits = context_logits(model, x, sigma, query, keep, context)  # (B, L, C)
        return torch.softmax(logits, dim=-1) @ context  # (B, L, C) @ (B, C, d) → (B, L, d)
    c_skip, c_out, c_in, c_noise = precondition(sigma, model.config.sigma_data)
    f = model(c_in[:, None, None] * x, c_noise, query, keep, context)  # (B, L, d)
    return c_skip[:, None, None] * x + c_out[:, None, None] * f


def context_logits(model: SetDenoiser, x: torch.Tensor, sigma: torch.Tensor,
                   query: torch.Tensor, keep: torch.Tensor | None,
                   context: torch.Tensor) -> torch.Tensor:
    """The context head's logits (B, L, C) at noisy rows x (B, L, d), σ (B,): what it trains on."""
    _, _, c_in, c_noise = precondition(sigma, model.config.sigma_data)
    return model(c_in[:, None, None] * x, c_noise, query, keep, context)


def guided_denoise(model: SetDenoiser, x: torch.Tensor, sigma: torch.Tensor,
                   query: torch.Tensor, cfg_weight: float,
                   context: torch.Tensor | None = None) -> torch.Tensor:
    """Classifier-free guidance, D = D_c + w·(D_c − D_u); w = 0 is the plain conditional model."""
    if cfg_weight == 0.0:
        return denoise(model, x, sigma, query, context=context)
    b = x.shape[0]
    keep = torch.cat([torch.ones(b), torch.zeros(b)]).to(x)  # (2B,)
    both_context = None if context is None else torch.cat([context, context])  # (2B, C, d)
    both = denoise(model, torch.cat([x, x]), torch.cat([sigma, sigma]),
                   torch.cat([query, query]), keep, both_context)  # (2B, L, d)
    cond, uncond = both[:b], both[b:]
    return cond + cfg_weight * (cond - uncond)


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def flops_per_step(config: DenoiserConfig, cfg: bool = False) -> int:
    """Multiply-adds ×2 of one denoiser evaluation for one query (×2 again with CFG).

    Row-wise weights run once per row (and per conditioning token); the conditioning MLPs and
    adaLN modulations run once per query; attention adds 4·n²·hidden per layer, and the context
    (C items) a cross-attention per layer plus one key/value projection per evaluation. The
    context head costs per row an h×h projection, C logits and a mixture of C rows of d, and
    per query one projection of the C items to logit keys.
    """
    h, n, c = config.hidden, config.rows + (config.conditioning == "token"), config.context
    layer = 4 * h * h + 2 * h * config.mlp + (2 * h * h if c else 0)
    mixture = config.head == "context"  # head h×h, logits over C, mixture of C rows of d
    head = h * h + c * h + c * config.dim if mixture else h * config.dim
    per_row = config.dim * h + head + config.layers * layer
    per_query = config.fourier * h + h * h + config.dim * h + h * h + c * config.dim * 2 * h
    per_query += c * config.dim * h if mixture else 0  # the items' logit keys
    if config.conditioning == "adaln":
        per_query += config.layers * 6 * h * h + 2 * h * h
    attention = config.layers * 2 * n * (n + c) * h
    flops = 2 * (n * per_row + per_query + attention)
    return flops * (2 if cfg else 1)
