"""Medusa-1 heads (Cai et al. 2024), in the layout vLLM's `Medusa` model loads.

    head k:  logits_k[t] = lm_heads[k]( blocks[k]( f[t] ) )      predicts token t+2+k
    block:   x <- x + SiLU(W x), num_hidden_layers times (no bias: vLLM's default `medusa_fc_bias: false`)

`f` is the target's last hidden state after its final norm (the state its LM head reads; cache store
`hidden_last`), so head 0 predicts the token after the one the target's own LM head predicts from the same
state. Every head owns its LM head, initialised from the target's, and its block starts as the identity (W = 0,
as in Medusa): an untrained head k proposes the target's next token again. Weight names are vLLM's
(`blocks.{k}.layers.{l}.weight` [H, H], `lm_heads.{k}.weight` [V, H]), so the export renames nothing.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

from specdistill.errors import SpecdistillError


@dataclass
class MedusaConfig:
    hidden_size: int
    vocab_size: int
    num_heads: int
    num_hidden_layers: int = 1
    head_decay: float = 0.8  # training only: head k's loss weight decay**k

    def to_dict(self) -> dict:
        return asdict(self)


class ResidualBlock(nn.Module):
    def __init__(self, hidden_size: int, num_layers: int):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(hidden_size, hidden_size, bias=False) for _ in range(num_layers)])
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + self.act(layer(x))
        return x


class MedusaHeads(nn.Module):
    def __init__(self, config: MedusaConfig):
        super().__init__()
        self.config = config
        h, v = config.hidden_size, config.vocab_size
        self.blocks = nn.ModuleList([ResidualBlock(h, config.num_hidden_layers) for _ in range(config.num_heads)])
        self.lm_heads = nn.ModuleList([nn.Linear(h, v, bias=False) for _ in range(config.num_heads)])
        for block in self.blocks:  # identity at the start (Medusa's init)
            for layer in block.layers:
                nn.init.zeros_(layer.weight)

    @torch.no_grad()
    def init_lm_heads(self, target_lm_head_weight: torch.Tensor) -> "MedusaHeads":
        """Every head's LM head starts as a copy of the target's [V, H]."""
        for lm_head in self.lm_heads:
            lm_head.weight.copy_(target_lm_head_weight.to(lm_head.weight.dtype))
        return self

    def head_logits(self, features: torch.Tensor, k: int) -> torch.Tensor:
        """Head k over final-norm states [..., H] -> logits [..., V] of the token k+2 positions on."""
        return self.lm_heads[k](self.blocks[k](features))

    def logits(self, features: torch.Tensor, heads: int | None = None) -> torch.Tensor:
        """The first `heads` heads (default all) over states [..., H] -> [..., heads, V]."""
        n = self.config.num_heads if heads is None else min(heads, self.config.num_heads)
        return torch.stack([self.head_logits(features, k) for k in range(n)], dim=-2)

    def own_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().contiguous() for k, v in self.state_dict().items()}

    def load_own_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Exactly the heads' tensors, each of its shape: a missing one would load as garbage."""
        own = self.state_dict()
        missing, extra = sorted(set(own) - set(state)), sorted(set(state) - set(own))
        wrong = [k for k in own if k in state and tuple(state[k].shape) != tuple(own[k].shape)]
        if missing or extra or wrong:
            raise SpecdistillError(f"Medusa heads: missing {missing[:4]}, unexpected {extra[:4]}, "
                                   f"wrong shape {wrong[:4]}")
        self.load_state_dict(state)


def medusa_config(recipe, target_config) -> MedusaConfig:
    d = recipe.draft
    return MedusaConfig(hidden_size=target_config.hidden_size, vocab_size=target_config.vocab_size,
                        num_heads=d.num_heads, num_hidden_layers=d.num_layers, head_decay=d.head_decay)


def shapes(recipe, target_config) -> MedusaHeads:
    """The heads' shapes only, on the meta device (dry runs, memory estimates)."""
    with torch.device("meta"):
        return MedusaHeads(medusa_config(recipe, target_config))


def build(recipe, parts, data=None) -> MedusaHeads:
    """Fresh heads: identity blocks, every LM head a copy of the target's."""
    return MedusaHeads(medusa_config(recipe, parts.config)).init_lm_heads(parts.lm_head.weight)


def owns(module) -> bool:
    return isinstance(module, MedusaHeads)


def draft_vocabulary(head) -> torch.Tensor | None:
    return None  # the target's whole vocabulary


def tiny_heads(target_model, heads: int = 3, layers: int = 1, std: float = 0.1) -> MedusaHeads:
    """Heads for a (tiny) loaded target, seeded, their LM heads the target's, every weight moved by `std` times
    noise (not the identity init): q differs from p, and from head to head."""
    torch.manual_seed(9)
    cfg = target_model.config
    head = MedusaHeads(MedusaConfig(cfg.hidden_size, cfg.vocab_size, heads, layers))
    head.init_lm_heads(target_model.get_output_embeddings().weight)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(std * torch.randn_like(p))
    return head.eval().requires_grad_(False)


def tiny_draft(target_model, k: int = 3) -> MedusaHeads:
    """The kind's case in the per-kind tests: one random head per draft depth (k)."""
    return tiny_heads(target_model, heads=k)
