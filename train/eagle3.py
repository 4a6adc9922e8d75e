"""EAGLE-3 draft head (Li et al. 2025), in the layout vLLM's Eagle3LlamaForCausalLM loads.

    g[t]      = fc( cat(a_low[t], a_mid[t], a_high[t]) )           a_L = hidden_states[L], pre-norm
    h[t]      = layer( input_layernorm(embed(x[t+1])) ; hidden_norm(g[t]) )   attention is 2H wide
    logits[t] = lm_head( norm(h[t]) )                               over the draft vocabulary (Vd)

Drafting one more token feeds the layer its own output h (not passed through fc again), so the head
can run several steps ahead; training unrolls it the same way ("training-time test", `ttt_forward`).
The decoder layer is a Llama layer for any target (train/eagle.py `llama_layer_config`).
The draft vocabulary is the Vd most frequent trained tokens of the corpus; `d2t[i]` is the offset
from draft id i to its target id (target = i + d2t[i]), `t2d[v]` says whether target id v is in it —
the conventions of EAGLE-3's research code, SpecForge and vLLM. Weight names match vLLM:
`fc.weight`, `layers.0.*` (with `layers.0.hidden_norm`), `norm.weight`, `lm_head.weight`.
"""
from __future__ import annotations

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoModel, DynamicCache

from specdistill import layout
from specdistill.errors import SpecdistillError
from specdistill.train.eagle import llama_layer_config, require_same_names


def default_aux_layers(num_layers: int) -> list[int]:
    """vLLM's default ids (2, N//2, N-3): hidden_states indices, i.e. the input of that layer (clamped to
    0..N for targets of fewer than 3 layers)."""
    return [min(max(i, 0), num_layers) for i in (2, num_layers // 2, num_layers - 3)]


def resolve_aux_layers(recipe, num_layers: int) -> list[int]:
    """The target layers an EAGLE-3 head reads: cache.aux_layers, else the default. The one place that
    decides it, for the cache stage and the head alike."""
    layers = recipe.cache.aux_layers if recipe.cache.aux_layers is not None else default_aux_layers(num_layers)
    bad = [i for i in layers if not 0 <= i <= num_layers]
    if bad:
        raise SpecdistillError(f"recipe {recipe.source}: cache.aux_layers {bad} out of range: hidden_states "
                               f"indices run 0..{num_layers} for a target with {num_layers} layers")
    return list(layers)


def draft_vocab_from_counts(counts: torch.Tensor, draft_vocab_size: int) -> torch.Tensor:
    """The draft vocabulary: ids of the most frequent tokens, sorted ascending (as d2t requires)."""
    size = min(draft_vocab_size, counts.numel())
    ties = -torch.arange(counts.numel(), dtype=torch.double, device=counts.device)  # lower id first among equals
    top = torch.topk(counts.double() + 1e-9 * ties, size).indices
    return top.sort().values


def trained_token_counts(run_dir, vocab_size: int) -> torch.Tensor:
    """How often each token is a trained (loss-masked) token in the cached train split."""
    counts = torch.zeros(vocab_size, dtype=torch.long, device="cpu")  # counted on the host, from the shards
    shards = sorted((layout.cache_dir(run_dir) / "train").glob("shard-*.safetensors"))
    for shard in shards:
        with safe_open(str(shard), "pt") as f:
            ids, mask = f.get_tensor("input_ids").long(), f.get_tensor("loss_mask").bool()
        counts += torch.bincount(ids[mask], minlength=vocab_size)[:vocab_size]
    return counts


def vocab_maps(draft_ids: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    d2t = (draft_ids - torch.arange(draft_ids.numel(), device=draft_ids.device)).long()
    t2d = torch.zeros(vocab_size, dtype=torch.bool, device=draft_ids.device)
    t2d[draft_ids] = True
    return d2t, t2d


class Eagle3Head(nn.Module):
    def __init__(self, target_config, draft_vocab_size: int, aux_layers: list[int]):
        super().__init__()
        cfg = llama_layer_config(target_config)  # Llama-style for any target (vLLM: Eagle3LlamaForCausalLM)
        cfg._attn_implementation = "sdpa"  # we pass boolean masks (True = attend)
        cfg.draft_vocab_size = draft_vocab_size
        cfg.eagle_aux_hidden_state_layer_ids = list(aux_layers)
        cfg.norm_before_residual = False  # the residual is the un-normed state (EAGLE / SpecForge order)
        self.config = cfg
        hidden, vocab = cfg.hidden_size, cfg.vocab_size
        body = AutoModel.from_config(cfg)
        layer = body.layers[0]
        attn = layer.self_attn
        for name in ("q_proj", "k_proj", "v_proj"):  # attention reads [embedding ; state]: 2H wide
            old = getattr(attn, name)
            setattr(attn, name, nn.Linear(2 * hidden, old.out_features, bias=old.bias is not None))
        layer.hidden_norm = type(layer.input_layernorm)(hidden, eps=cfg.rms_norm_eps)
        self.layers = nn.ModuleList([layer])
        self.rotary_emb = body.rotary_emb
        self.fc = nn.Linear(len(aux_layers) * hidden, hidden, bias=False)
        self.norm = type(layer.input_layernorm)(hidden, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, draft_vocab_size, bias=False)
        # buffers start on the host like the layers' weights; the head moves to its device as a whole
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long, device="cpu"))
        self.register_buffer("t2d", torch.ones(vocab, dtype=torch.bool, device="cpu"))
        # Pre-norm residual states spread ~1 to ~1000 per dimension (a few "massive" dimensions); Adam
        # learns fc far faster on unit-scale inputs. fc reads aux * aux_scale; export folds it into fc.
        self.register_buffer("aux_scale", torch.ones(len(aux_layers) * hidden, device="cpu"))
        self.embed_tokens: nn.Embedding | None = None

    @property
    def aux_layers(self) -> list[int]:
        return list(self.config.eagle_aux_hidden_state_layer_ids)

    keep_fc_function = False  # set by a warm start: fc's weights already read the states at their old scale

    def set_aux_scale(self, aux_std: torch.Tensor) -> None:
        """aux_std: per-dimension std of the cached aux features [A*H]; fc then sees unit-scale inputs.
        A warm-started head rescales fc so that fc(aux * aux_scale) stays what it computed before."""
        new = 1.0 / aux_std.clamp_min(1e-3)
        if self.keep_fc_function:
            with torch.no_grad():
                ratio = (self.aux_scale.float() / new.float().to(self.aux_scale.device))[None, :]
                self.fc.weight.copy_((self.fc.weight.float() * ratio).to(self.fc.weight.dtype))
        self.aux_scale.copy_(new)

    def set_draft_vocab(self, draft_ids: torch.Tensor) -> None:
        d2t, t2d = vocab_maps(draft_ids, self.config.vocab_size)
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    @torch.no_grad()
    def init_readout(self, target_lm_head: torch.Tensor, target_norm: torch.Tensor | None) -> None:
        """Start the readout as the target's own (its LM head rows of the draft vocabulary, its final norm):
        the head then only has to learn to produce target-like final states, not a vocabulary from scratch."""
        self.lm_head.weight.copy_(target_lm_head[self.draft_ids.to(target_lm_head.device)])
        if target_norm is not None:
            self.norm.weight.copy_(target_norm)

    @property
    def draft_ids(self) -> torch.Tensor:
        """Target id of each draft id."""
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    def bind_target(self, embed_tokens: nn.Embedding, lm_head: nn.Linear | None = None) -> "Eagle3Head":
        """Share the target's frozen embedding (not registered as an own parameter)."""
        object.__setattr__(self, "embed_tokens", embed_tokens)
        return self

    # ---- pieces the engine and the training loop share --------------------------------------------

    @staticmethod
    def target_features(hidden_states, aux_layers) -> torch.Tensor:
        """What the head reads from one target forward: the aux states side by side [.., A*H]."""
        return torch.cat([hidden_states[i] for i in aux_layers], dim=-1)

    def project(self, aux_features: torch.Tensor) -> torch.Tensor:
        return self.fc(aux_features.to(self.fc.weight.dtype) * self.aux_scale.to(self.fc.weight.dtype))

    def forward(self, input_ids, state, position_ids, past_key_values=None, attention_mask=None):
        """input_ids[:, t] = x[t+1], state = fc output (step 0) or the head's own previous output.

        attention_mask: bool [B, 1, T, S] over all keys (cached + new), True = attend; None = causal
        over the new positions after everything cached. Training unrolls this forward (`ttt_forward`).
        """
        with torch.no_grad():
            emb = self.embed_tokens(input_ids).to(state.dtype)
        layer = self.layers[0]
        if attention_mask is None:
            attention_mask = causal_after_cache(input_ids.shape[1], past_key_values, state.device)
        residual = state
        x = torch.cat([layer.input_layernorm(emb), layer.hidden_norm(state)], dim=-1)
        pe = self.rotary_emb(state, position_ids)
        attn, _ = layer.self_attn(hidden_states=x, position_embeddings=pe, attention_mask=attention_mask,
                                  past_key_values=past_key_values)
        h = residual + attn
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [.., Vd]; map ids to the target's with `draft_ids`."""
        return self.lm_head(self.norm(h))

    def own_state_dict(self) -> dict[str, torch.Tensor]:
        state = {k: v for k, v in self.state_dict().items() if not k.startswith("rotary_emb.")}
        return {k: v.detach().contiguous() for k, v in state.items()}

    def load_own_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        require_same_names(set(self.own_state_dict()), state, "EAGLE-3 head")
        self.load_state_dict(state, strict=False)


def causal_after_cache(new: int, cache, device) -> torch.Tensor:
    cached = cache.get_seq_length() if cache is not None else 0
    q = torch.arange(new, device=device)[:, None] + cached
    k = torch.arange(cached + new, device=device)[None, :]
    return (k <= q)[None, None]


def ttt_mask(length: int, step: int, key_padding: torch.Tensor) -> torch.Tensor:
    """Attention of unroll step `step` over the keys of steps 0..step, as the head sees them when drafting.

    Query t at step s stands for the token drafted s positions after t. When drafting, the head's cache
    holds real-feature entries for positions <= t (step 0, causal) and its own entries for depths 1..s of
    the same chain (steps 1..s, position t only: the diagonal).
    """
    t = torch.arange(length, device=key_padding.device)
    blocks = [t[None, :] <= t[:, None]] + [torch.eye(length, dtype=torch.bool, device=key_padding.device)] * step
    mask = torch.cat(blocks, dim=1)[None, None]  # [1, 1, T, (s+1)T]
    keys_ok = key_padding.bool().repeat(1, step + 1)[:, None, None, :]
    return mask & keys_ok


def ttt_forward(head: Eagle3Head, input_ids, aux_features, attention_mask, steps: int, noise: float = 0.0,
                generator=None, keep: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Unroll the head `steps` times over a batch (training-time test).

    Step s at position t reads token x[t+1+s] and predicts token x[t+2+s]; returns the draft-vocab logits
    of each step, [B, T, Vd]; positions whose inputs fall past the sequence are the caller's to mask.
    keep: one bool [B, T] per step; only those positions get logits, [n_s, Vd] (the LM head is about
    half a step's cost, and prompt tokens are not trained).
    """
    B, T = input_ids.shape
    cache = DynamicCache(config=head.config)
    state = head.project(aux_features)
    if noise > 0:  # EAGLE's feature noise, on the fused state
        u = torch.rand(state.shape, generator=generator, dtype=torch.float32, device=generator.device)
        u = u.to(state.device, state.dtype)  # drawn on the generator's device: the rank's, in training
        state = state + (2 * u - 1) * noise * state.detach().std()
    outs = []
    base = torch.arange(T, device=input_ids.device).expand(B, -1)
    for s in range(steps):
        ids = torch.zeros_like(input_ids)
        ids[:, :T - 1 - s] = input_ids[:, 1 + s:]
        mask = ttt_mask(T, s, attention_mask)
        state = head(ids, state, base + s, past_key_values=cache, attention_mask=mask)
        outs.append(head.logits(state if keep is None else state[keep[s]]))
    return outs
