"""The stage-3 denoiser D(x; σ, q): EDM preconditioning around a conditional transformer over
a block of L item-embedding rows, with classifier-free guidance; the one module training, the
samplers and the ONNX export call. Conditioning is adaLN-Zero (DiT); rows are a set unless
`ordered`. With a context (C > 0) the rows cross-attend to C catalog items (docs/design.md,
"The student's context"); with item features (`parts`, `mentions`) an MLP reads each item and
D is softmax(logits)·context (CDCD's score interpolation), trained by cross-entropy on which
item each row is, with `mentions` plus a per-item score trained toward the ranker's.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
from torch import nn

from service.errors import BundleError, InputError
from service.fanout.candidates import CANDIDATE_SOURCES, UNRECORDED_SOURCE
from service.fanout.format import PROMPT_RECIPE
from service.ranker.mention_context import MENTION_WIDTH
from service.routes.diffusion import CONTEXT_SOURCES
from training.stage2_synthesis.teachers import RANKED_CONTEXT

STANDALONE_CONTEXT = 48  # its 32 nearest mentions, then its nearest items
# Options of earlier configs whose other values were removed: their surviving value.
REMOVED_OPTIONS: dict[str, str] = {"conditioning": "adaln", "head": "vector"}


@dataclass(frozen=True)
class DenoiserConfig:
    dim: int = 128  # item/query embedding size d
    rows: int = 10  # L, rows per generated block
    k: int = 10  # items returned per query
    hidden: int = 128
    mlp: int = 512
    layers: int = 4
    heads: int = 4
    sigma_min: float = 0.002
    sigma_max: float = 1.0  # VE: large against the data's per-coordinate std, to swamp it
    sigma_data: float = 1.0 / math.sqrt(128)  # unit-norm rows in d=128: per-coordinate std
    cond_drop: float = 0.1  # condition dropout for classifier-free guidance
    fourier: int = 64  # noise-level Fourier features
    context: int = 0  # C, catalog items the rows cross-attend to; 0 = none
    ordered: bool = False  # rows carry learnt positions (TrainConfig.target_order says which)
    # which C items: "nearest", the query's C nearest; "prompt", the C items the teacher's
    # prompt names (service.fanout.grounding.PromptNeighbourhood); "ranked", the ranker's best C
    # (service.ranker.ranker.RankedNeighbourhood), for a student distilled from the ranker;
    # "mentioned", the query's nearest mentions, then its nearest (MentionedNeighbourhood)
    context_source: str = "nearest"
    # where the prompt's names come from (service.fanout.candidates), as the teacher's were
    candidates: str = UNRECORDED_SOURCE
    # the item parts (service.artifacts.parts) whose cosine to the query each context item also
    # carries: (B, C, d + P) context, read through an MLP; () = embeddings alone
    parts: tuple[str, ...] = ()
    # each context item's mention features (service.ranker.mention_context) after the above
    mentions: bool = False

    def __post_init__(self) -> None:
        if self.context_source not in CONTEXT_SOURCES:
            raise InputError(f"context_source must be one of {CONTEXT_SOURCES}, "
                             f"got {self.context_source!r}")
        if self.candidates not in CANDIDATE_SOURCES:
            raise InputError(f"candidates must be one of {CANDIDATE_SOURCES}, "
                             f"got {self.candidates!r}")
        if self.hidden % self.heads:
            raise InputError(f"hidden={self.hidden} must be divisible by heads={self.heads}")
        if self.rows < self.k:
            raise InputError(f"rows L={self.rows} must be at least k={self.k}")
        if self.reads_items and (not self.context
                                 or self.context_source not in ("nearest", "mentioned")):
            raise InputError("parts and mentions describe the query's nearest items: the "
                             "denoiser needs a context (context > 0, context_source "
                             "'nearest' or 'mentioned')")
        if self.context_source == "mentioned" and not self.mentions:
            raise InputError("a 'mentioned' context is read with its mention features "
                             "(mentions=True)")

    @property
    def context_width(self) -> int:
        """Width of one context item: its embedding, its parts' cosines to the query, then its
        mention features."""
        return self.dim + len(self.parts) + (MENTION_WIDTH if self.mentions else 0)

    @property
    def reads_items(self) -> bool:
        """Whether an MLP reads each context item and the rows point at them."""
        return bool(self.parts) or self.mentions

    @property
    def among(self) -> str:
        """What a picking stage-2 teacher chooses among (training.stage2_synthesis.teachers)."""
        return self.context_source if self.context_source in ("nearest", "mentioned") \
            else "ranked"

    def to_dict(self) -> dict[str, Any]:
        """As a dict; the default context source is left out, so configs (and the hashes a
        resumed run must match) written before that option existed stay the same."""
        config = asdict(self)
        if config["context_source"] == "nearest":
            del config["context_source"]
        if config["candidates"] == UNRECORDED_SOURCE:
            del config["candidates"]
        if not config["mentions"]:
            del config["mentions"]
        if not config["parts"]:
            del config["parts"]
        else:
            config["parts"] = list(config["parts"])
        return config

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> DenoiserConfig:
        """The inverse of `to_dict`, also for configs that still name a removed option
        (`conditioning`, `head`) at the one value that remains."""
        config = dict(config)
        for name, kept in REMOVED_OPTIONS.items():
            value = config.pop(name, kept)
            if value != kept:
                raise BundleError(f"{name}={value!r} is no longer supported (only {kept!r}): "
                                  "retrain the denoiser")
        config["parts"] = tuple(config.get("parts", ()))
        return cls(**config)


PRESETS: dict[str, DenoiserConfig] = {
    "paper": DenoiserConfig(hidden=1024, mlp=1024, layers=6, heads=16, rows=12),  # Table 3
    # Sized for 2 CPU cores; the context is the ranker's best RANKED_CONTEXT candidates, among
    # which its teacher chose (training/stage2_synthesis/teachers.py). Two blocks: four cost
    # more and chose no better, half the width chose worse.
    "cpu": DenoiserConfig(hidden=128, mlp=512, layers=2, heads=4, context=RANKED_CONTEXT,
                          ordered=True, context_source="ranked",
                          candidates=PROMPT_RECIPE.candidates),
    "tiny": DenoiserConfig(hidden=32, mlp=64, layers=2, heads=2, fourier=16),
    # no teacher at serve time: the query's nearest mentions, then its nearest items, each
    # read with its mention features (service.ranker.mention_context: where the query's words
    # sit in its text), chosen among by the ranker offline; it measured above the 128 nearest
    # alone, and above their parts' cosines. A quarter of the width chose as well, at a tenth
    # of the FLOPs: its price is reading C items, not writing L rows
    "standalone": DenoiserConfig(hidden=32, mlp=128, layers=2, heads=2,
                                 context=STANDALONE_CONTEXT, ordered=True, mentions=True,
                                 context_source="mentioned"),
}


def preset(name: str, **overrides: Any) -> DenoiserConfig:
    if name not in PRESETS:
        raise InputError(f"unknown denoiser preset {name!r}; available: {sorted(PRESETS)}")
    return replace(PRESETS[name], **overrides)


class Attention(nn.Module):
    """Multi-head self-attention over the rows (no mask, no positions)."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, h = x.shape  # (B, L, hidden)
        qkv = self.qkv(x).reshape(b, n, 3, self.heads, h // self.heads)  # (B, L, 3, H, Dh)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each (B, H, L, Dh)
        weights = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(h // self.heads), dim=-1)
        mixed = (weights @ v).transpose(1, 2).reshape(b, n, h)  # (B, L, hidden)
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
        b, n, h = x.shape  # (B, L, hidden)
        q = self.q(self.norm(x)).reshape(b, n, self.heads, h // self.heads)  # (B, L, H, Dh)
        q = q.transpose(1, 2)  # (B, H, L, Dh)
        weights = torch.softmax(q @ keys.transpose(-1, -2) / math.sqrt(h // self.heads), dim=-1)
        mixed = (weights @ values).transpose(1, 2).reshape(b, n, h)  # (B, L, hidden)
        return self.out(mixed)


class Block(nn.Module):
    """Pre-LN transformer block with adaLN-Zero: LN shift/scale and residual gates come from c."""

    def __init__(self, hidden: int, mlp: int, heads: int, cross: bool) -> None:
        super().__init__()
        self.cross = CrossAttention(hidden, heads) if cross else None
        self.norm1 = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.norm2 = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.attn = Attention(hidden, heads)
        self.mlp = nn.Sequential(nn.Linear(hidden, mlp), nn.GELU(approximate="tanh"),
                                 nn.Linear(mlp, hidden))
        self.modulation = nn.Linear(hidden, 6 * hidden)
        nn.init.zeros_(self.modulation.weight)  # adaLN-Zero: every block starts as the identity
        nn.init.zeros_(self.modulation.bias)

    def forward(self, x: torch.Tensor, c: torch.Tensor, memory: Memory | None = None
                ) -> torch.Tensor:
        """x (B, L, hidden), c (B, hidden); memory: the context's keys, values, keep gate."""
        mod = self.modulation(nn.functional.silu(c))[:, None, :]  # (B, 1, 6·hidden)
        shift1, scale1, gate1, shift2, scale2, gate2 = mod.chunk(6, dim=-1)  # each (B, 1, hidden)
        x = x + gate1 * self.attn(self.norm1(x) * (1 + scale1) + shift1)
        if self.cross is not None and memory is not None:
            keys, values, keep = memory
            attended = self.cross(x, keys, values)  # (B, L, hidden)
            x = x + (attended if keep is None else keep * attended)
        return x + gate2 * self.mlp(self.norm2(x) * (1 + scale2) + shift2)  # (B, L, hidden)


class Denoiser(nn.Module):
    """D_θ(x; σ, q) = c_skip·x + c_out·F_θ(c_in·x, c_noise, q): EDM preconditioning around the
    set transformer F_θ (`network`), and classifier-free guidance (`guided`)."""

    def __init__(self, config: DenoiserConfig) -> None:
        super().__init__()
        self.config = config
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
            Block(h, config.mlp, config.heads, config.context > 0) for _ in range(config.layers)
        )
        if config.reads_items:  # an MLP per context item: what matches is not linear
            deeper = [nn.Linear(h, h), nn.GELU(approximate="tanh")] if config.mentions else []
            self.item = nn.Sequential(nn.Linear(config.context_width, h),
                                      nn.GELU(approximate="tanh"), *deeper)
            self.pointer = nn.Linear(h, h)  # the items' keys for the rows' logits
        if config.mentions:
            self.score = nn.Linear(h, 1)  # each item's relevance, added to every row's logits
        if config.context > 0:  # keys and values of the context, shared by every layer
            self.memory = nn.Linear(h if config.reads_items else config.dim, 2 * h)
            self.rank = nn.Parameter(torch.zeros(config.context, 2 * h))  # (C, 2·hidden)
        self.final_norm = nn.LayerNorm(h, elementwise_affine=False, eps=1e-6)
        self.final_mod = nn.Linear(h, 2 * h)
        self.head = nn.Linear(h, config.dim)
        for layer in (self.head, self.final_mod):  # zero-initialised: D starts as c_skip·x
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def preconditioning(self, sigma: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """EDM (Karras et al. 2022, Table 1) c_skip, c_out, c_in, c_noise, each (B,), for σ (B,)."""
        sigma_data = self.config.sigma_data
        total = sigma**2 + sigma_data**2
        c_skip = sigma_data**2 / total
        c_out = sigma * sigma_data / total.sqrt()
        c_in = 1.0 / total.sqrt()
        c_noise = sigma.log() / 4.0
        return c_skip, c_out, c_in, c_noise

    def forward(self, x: torch.Tensor, sigma: torch.Tensor, query: torch.Tensor,
                keep: torch.Tensor | None = None,
                context: torch.Tensor | None = None) -> torch.Tensor:
        """D (B, L, d) at noisy rows x (B, L, d), σ (B,), query (B, d), context (B, C, d) when
        the model has one; keep (B,) is 1 to keep the condition, 0 for CFG's null one."""
        if self.config.reads_items and context is not None:  # a mixture of the context items
            weights = torch.softmax(self.context_logits(x, sigma, query, keep, context), -1)
            return weights @ context[..., : self.config.dim]  # (B, L, C) @ (B, C, d)
        c_skip, c_out, c_in, c_noise = self.preconditioning(sigma)
        f = self.head(self.network(c_in[:, None, None] * x, c_noise, query, keep, context))
        return c_skip[:, None, None] * x + c_out[:, None, None] * f  # (B, L, d)

    def context_logits(self, x: torch.Tensor, sigma: torch.Tensor, query: torch.Tensor,
                       keep: torch.Tensor | None, context: torch.Tensor | None,
                       items: torch.Tensor | None = None) -> torch.Tensor:
        """(B, L, C): which of the C context items each row is (trained by cross-entropy);
        `items`: the context already read per item (B, C, h), as an export computes it."""
        _, _, c_in, c_noise = self.preconditioning(sigma)
        if items is None:
            items = self.item(context)  # (B, C, h): read once, for the memory and the keys
        h = self.network(c_in[:, None, None] * x, c_noise, query, keep, context, items)
        keys = self.pointer(items) + self.rank[:, : self.config.hidden]  # (B, C, h)
        logits = h @ keys.transpose(1, 2) / math.sqrt(self.config.hidden)  # (B, L, C)
        if self.config.mentions:
            logits = logits + self.score(items).transpose(1, 2)  # (B, 1, C) to every row
        return logits

    def item_scores(self, context: torch.Tensor) -> torch.Tensor:
        """(B, C) each context item's relevance (the part of the logits every row shares)."""
        return self.score(self.item(context))[..., 0]

    def guided(self, x: torch.Tensor, sigma: torch.Tensor, query: torch.Tensor,
               cfg_weight: float, context: torch.Tensor | None = None) -> torch.Tensor:
        """Classifier-free guidance, D = D_c + w·(D_c − D_u), with D_c and D_u from one batch
        of 2B; w = 0 is the plain conditional model (one pass)."""
        if cfg_weight == 0.0:
            return self(x, sigma, query, context=context)
        b = x.shape[0]
        keep = torch.cat([torch.ones(b), torch.zeros(b)]).to(x)  # (2B,)
        both_context = None if context is None else torch.cat([context, context])  # (2B, C, d)
        both = self(torch.cat([x, x]), torch.cat([sigma, sigma]), torch.cat([query, query]),
                    keep, both_context)  # (2B, L, d)
        cond, uncond = both[:b], both[b:]
        return cond + cfg_weight * (cond - uncond)

    def guided_weights(self, x: torch.Tensor, sigma: torch.Tensor, query: torch.Tensor,
                       cfg_weight: float, context: torch.Tensor | None = None,
                       items: torch.Tensor | None = None) -> torch.Tensor:
        """(B, L, C) the weights of a mixture head's `guided` D over its context items: D is
        weights @ context embeddings (guidance is linear in them), so they say which item
        each row points at. `items`: the context read per item, in place of `context`."""
        if cfg_weight == 0.0:
            return torch.softmax(self.context_logits(x, sigma, query, None, context, items), -1)
        b = x.shape[0]
        keep = torch.cat([torch.ones(b), torch.zeros(b)]).to(x)  # (2B,)
        logits = self.context_logits(torch.cat([x, x]), torch.cat([sigma, sigma]),
                                     torch.cat([query, query]), keep,
                                     None if context is None else torch.cat([context, context]),
                                     None if items is None else torch.cat([items, items]))
        both = torch.softmax(logits, -1)
        cond, uncond = both[:b], both[b:]
        return cond + cfg_weight * (cond - uncond)

    def network(self, x: torch.Tensor, c_noise: torch.Tensor, query: torch.Tensor,
                keep: torch.Tensor | None = None, context: torch.Tensor | None = None,
                items: torch.Tensor | None = None) -> torch.Tensor:
        """The last hidden rows (B, L, hidden) of F_θ, for the scaled rows c_in·x (B, L, d) and
        c_noise (B,); a head reads them out. items: the context read per item, when the
        caller has it."""
        c = self.condition(c_noise, query, keep)  # (B, hidden)
        memory = self.context_memory(context, keep, items)
        # c enters every row token too: through the zero-initialised modulations alone the
        # query is learnt slowly
        h = self.embed(x) + c[:, None, :]  # (B, L, hidden)
        if self.config.ordered:
            h = h + self.positions  # (B, L, hidden)
        for block in self.blocks:
            h = block(h, c, memory)  # (B, L, hidden)
        h = self.final_norm(h)
        shift, scale = self.final_mod(nn.functional.silu(c))[:, None, :].chunk(2, dim=-1)
        return h * (1 + scale) + shift  # (B, L, hidden)

    def condition(self, c_noise: torch.Tensor, query: torch.Tensor,
                  keep: torch.Tensor | None) -> torch.Tensor:
        """c (B, hidden) = MLP(fourier(c_noise)) + MLP(query, or the null query where keep is 0)."""
        angles = c_noise[:, None] * self.freqs[None, :]  # (B, F/2)
        fourier = torch.cat([angles.cos(), angles.sin()], dim=-1)  # (B, F)
        if keep is not None:
            query = keep[:, None] * query + (1 - keep[:, None]) * self.null_query  # (B, d)
        return self.noise_mlp(fourier) + self.query_mlp(query)  # (B, hidden)

    def context_memory(self, context: torch.Tensor | None, keep: torch.Tensor | None,
                       items: torch.Tensor | None = None) -> Memory | None:
        """Keys, values (B, H, C, Dh) and keep gate (B, 1, 1) from context (B, C, d [+ P])."""
        if self.config.context == 0:
            return None
        if items is None:
            width = self.config.context_width
            if context is None or context.shape[1:] != (self.config.context, width):
                got = None if context is None else tuple(context.shape)
                raise ValueError(f"context must be (B, {self.config.context}, {width}), "
                                 f"got {got}")
            items = self.item(context) if self.config.reads_items else context  # (B, C, h | d)
        b, c, _ = items.shape
        kv = self.memory(items) + self.rank  # (B, C, 2·hidden)
        kv = kv.reshape(b, c, 2, self.config.heads, -1).permute(2, 0, 3, 1, 4)  # (2, B, H, C, Dh)
        return kv[0], kv[1], None if keep is None else keep[:, None, None]  # gate (B, 1, 1)


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def flops_per_step(config: DenoiserConfig, cfg: bool = False) -> int:
    """Multiply-adds ×2 of one denoiser evaluation for one query (×2 again with CFG).

    Row-wise weights run once per row; the conditioning MLPs and adaLN modulations once per
    query; attention adds 4·L²·hidden per layer, and the context (C items) a cross-attention
    per layer plus one key/value projection per evaluation.
    """
    h, n, c = config.hidden, config.rows, config.context
    layer = 4 * h * h + 2 * h * config.mlp + (2 * h * h if c else 0)
    per_row = config.dim * h + h * config.dim + config.layers * layer
    memory = config.context_width * h + 3 * h * h if config.reads_items else config.dim * 2 * h
    memory += (h * h + h) if config.mentions else 0  # the item MLP's second layer, its score
    per_query = config.fourier * h + h * h + config.dim * h + h * h + c * memory
    per_query += config.layers * 6 * h * h + 2 * h * h  # adaLN-Zero modulations
    attention = config.layers * 2 * n * (n + c) * h
    flops = 2 * (n * per_row + per_query + attention)
    return flops * (2 if cfg else 1)
