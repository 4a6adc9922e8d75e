"""EAGLE-3 draft head (Li et al. 2025), in the layout vLLM's Eagle3LlamaForCausalLM loads.

    g[t]      = fc( cat(a_low[t], a_mid[t], a_high[t]) )           a_L = hidden_states[L], pre-norm
                (draft.fc_norm: each a_L through its own RMSNorm first, vLLM's `fc_norm`)
    h[t]      = layer( input_layernorm(embed(x[t+1])) ; hidden_norm(g[t]) )   attention is 2H wide
    logits[t] = lm_head( norm(h[t]) )                               over the draft vocabulary (Vd)

Drafting one more token feeds the layer its own output h (not passed through fc again), so the head
can run several steps ahead; training unrolls it the same way ("training-time test", objective.py `ttt_forward`).
The decoder layer is a Llama layer for any target (kinds/common/llama_layer.py `llama_layer_config`).
The draft vocabulary is the Vd most frequent trained tokens of the corpus; `d2t[i]` is the offset
from draft id i to its target id (target = i + d2t[i]), `t2d[v]` says whether target id v is in it —
the conventions of EAGLE-3's research code, SpecForge and vLLM. Weight names match vLLM:
`fc.weight`, `layers.0.*` (with `layers.0.hidden_norm`), `norm.weight`, `lm_head.weight` (+ `fc_norm.{i}.weight`).
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers import AutoModel

from specdistill import formats, layout
from specdistill.decoding.linear import plain
from specdistill.errors import SpecdistillError
from specdistill.kinds.common.llama_layer import init_layer_from_target, llama_layer_config, require_same_names
from specdistill.kinds.common.released import check_fits, load_state, read_released
from specdistill.kinds.eagle3.config import DEFAULT_DRAFT_VOCAB
from specdistill.target import read_target_tensors, resolve_aux_layers


def draft_vocab_from_counts(counts: torch.Tensor, draft_vocab_size: int) -> torch.Tensor:
    """The draft vocabulary: ids of the most frequent tokens, sorted ascending (as d2t requires)."""
    size = min(draft_vocab_size, counts.numel())
    ties = -torch.arange(counts.numel(), dtype=torch.double, device=counts.device)  # lower id first among equals
    top = torch.topk(counts.double() + 1e-9 * ties, size).indices
    return top.sort().values


def trained_token_counts(run_dir, vocab_size: int) -> torch.Tensor:
    """How often each token is a trained (loss-masked) token in the cached train split."""
    counts = torch.zeros(vocab_size, dtype=torch.long, device="cpu")  # counted on the host, from the shards
    for shard in formats.shard_paths(layout.cache_dir(run_dir), "train"):
        tensors = formats.read_shard(shard, keys=("input_ids", "loss_mask"))
        ids, mask = tensors["input_ids"].long(), tensors["loss_mask"].bool()
        counts += torch.bincount(ids[mask], minlength=vocab_size)[:vocab_size]
    return counts


def fc_norm_names(num_aux: int) -> list[str]:
    """The fc_norm weights' names, one per aux state in fc's order (vLLM: `model.fc_norm.{i}.weight`)."""
    return [f"fc_norm.{i}.weight" for i in range(num_aux)]


def vocab_maps(draft_ids: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    d2t = (draft_ids - torch.arange(draft_ids.numel(), device=draft_ids.device)).long()
    t2d = torch.zeros(vocab_size, dtype=torch.bool, device=draft_ids.device)
    t2d[draft_ids] = True
    return d2t, t2d


class Eagle3Head(nn.Module):
    def __init__(self, target_config, draft_vocab_size: int, aux_layers: list[int], fc_norm: bool = False):
        super().__init__()
        cfg = llama_layer_config(target_config)  # Llama-style for any target (vLLM: Eagle3LlamaForCausalLM)
        cfg._attn_implementation = "sdpa"  # we pass boolean masks (True = attend)
        cfg.draft_vocab_size = draft_vocab_size
        cfg.eagle_aux_hidden_state_layer_ids = list(aux_layers)
        cfg.norm_before_residual = False  # the residual is the un-normed state (EAGLE / SpecForge order)
        if fc_norm:  # only when on: a default head's draft_config.json stays as it was
            cfg.fc_norm = True
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
        RMSNorm = type(layer.input_layernorm)  # transformers' Llama RMSNorm (float32 inside), as the layer's
        # vLLM's fc_norm: one RMSNorm per aux state (eps rms_norm_eps, weight ones), applied before fc
        self.fc_norm = nn.ModuleList(RMSNorm(hidden, eps=cfg.rms_norm_eps) for _ in aux_layers) if fc_norm else None
        self.norm = RMSNorm(hidden, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, draft_vocab_size, bias=False)
        # buffers start on the host like the layers' weights; the head moves to its device as a whole
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long, device="cpu"))
        self.register_buffer("t2d", torch.ones(vocab, dtype=torch.bool, device="cpu"))
        # Pre-norm residual states spread ~1 to ~1000 per dimension (a few "massive" dimensions); Adam
        # learns fc far faster on unit-scale inputs. fc reads aux * aux_scale; export folds it into fc.
        # With fc_norm it stays ones: a per-dimension scale before an RMSNorm cannot be folded into fc.
        self.register_buffer("aux_scale", torch.ones(len(aux_layers) * hidden, device="cpu"))
        self.embed_tokens: nn.Embedding | None = None

    @property
    def aux_layers(self) -> list[int]:
        return list(self.config.eagle_aux_hidden_state_layer_ids)

    keep_fc_function = False  # set by a warm start: fc's weights already read the states at their old scale

    def set_aux_scale(self, aux_std: torch.Tensor) -> None:
        """aux_std: per-dimension std of the cached aux features [A*H]; fc then sees unit-scale inputs.
        A warm-started head rescales fc so that fc(aux * aux_scale) stays what it computed before."""
        if self.fc_norm is not None:  # the norms bring each aux state to unit RMS; aux_scale stays ones
            return
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

    def project(self, aux_features: torch.Tensor, linear=plain) -> torch.Tensor:
        """linear(module, x): how fc multiplies (the static drafter's packed weights, decoding/linear.py)."""
        x = aux_features.to(self.fc.weight.dtype)
        if self.fc_norm is not None:  # vLLM combine_hidden_states: cat(fc_norm[i](chunk i)), then fc
            chunks = x.chunk(len(self.fc_norm), dim=-1)
            return linear(self.fc, torch.cat([norm(chunk) for norm, chunk in zip(self.fc_norm, chunks)], dim=-1))
        return linear(self.fc, x * self.aux_scale.to(self.fc.weight.dtype))

    def forward(self, input_ids, state, position_ids, past_key_values=None, attention_mask=None):
        """input_ids[:, t] = x[t+1], state = fc output (step 0) or the head's own previous output.

        attention_mask: bool [B, 1, T, S] over all keys (cached + new), True = attend; None = causal
        over the new positions after everything cached. Training unrolls this forward (objective.py `ttt_forward`).
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

    def logits(self, h: torch.Tensor, linear=plain) -> torch.Tensor:
        """Draft-vocabulary logits [.., Vd]; map ids to the target's with `draft_ids`."""
        return linear(self.lm_head, self.norm(h))

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


# ---- build ------------------------------------------------------------------------------------------

def _draft_vocab(recipe, target_config) -> int:
    return min(recipe.draft.draft_vocab_size or DEFAULT_DRAFT_VOCAB, target_config.vocab_size)


def shapes(recipe, target_config) -> Eagle3Head:
    """The head's shapes only, on the meta device (dry runs, memory estimates)."""
    aux = resolve_aux_layers(recipe, target_config.num_hidden_layers)
    with torch.device("meta"):
        return Eagle3Head(target_config, _draft_vocab(recipe, target_config), aux, recipe.draft.fc_norm)


def aux_feature_std(data) -> torch.Tensor:
    """Per-dimension std of the cached aux features of the first 8 sequences [A*H] (deterministic)."""
    return torch.cat([data[i]["hidden_aux"].float().flatten(1) for i in range(min(8, len(data)))]).std(0)


def build(recipe, parts, data=None) -> Eagle3Head:
    """A fresh head (or a warm start from draft.init_from) bound to the target's frozen embedding: its
    draft vocabulary from the cached train split, its readout the target's own, its input scaling
    measured on `data` (the same on every rank and every resume)."""
    config, cfg = parts.config, recipe.draft
    aux = resolve_aux_layers(recipe, config.num_hidden_layers)
    if cfg.init_from:
        vd, released_aux, released_fc_norm = released_shape(cfg.init_from, config)
        # an export lists the ids ascending and once (vLLM's order); the cache may hold them in any order
        if released_aux is not None and list(released_aux) not in (list(aux), sorted(set(aux))):
            raise SpecdistillError(f"draft.init_from {cfg.init_from}: the head reads target layers "
                                   f"{released_aux}, the cache holds {aux}; set cache.aux_layers: {released_aux}")
        if released_fc_norm != cfg.fc_norm:  # fc was trained on normed (or raw) states: it must keep reading them
            raise SpecdistillError(f"draft.init_from {cfg.init_from}: the head has fc_norm: "
                                   f"{str(released_fc_norm).lower()}; set draft.fc_norm: {str(released_fc_norm).lower()}")
        head = Eagle3Head(config, vd, aux, cfg.fc_norm)
        head.config.ttt_steps = cfg.ttt_steps
        warm_start(cfg.init_from, head, config, released_aux)
    else:
        head = Eagle3Head(config, _draft_vocab(recipe, config), aux, cfg.fc_norm)
        head.config.ttt_steps = cfg.ttt_steps
        if cfg.init_layer_from_target and parts.where is not None:
            init_layer_from_target(head.layers[0], parts.where, config)
        counts = trained_token_counts(recipe.run_dir, config.vocab_size)
        head.set_draft_vocab(draft_vocab_from_counts(counts, head.lm_head.weight.shape[0]))
        if parts.lm_head is not None:
            norm = read_target_tensors(parts.where, ["model.norm.weight"]).get("model.norm.weight")
            head.init_readout(parts.lm_head.weight, norm)
    if data is not None:
        head.set_aux_scale(aux_feature_std(data))
    head.lm_head.requires_grad_(not cfg.freeze_lm_head)  # the loop trains what requires grad
    return head.bind_target(parts.embed)


def owns(module) -> bool:
    return isinstance(module, Eagle3Head)


def draft_vocabulary(head) -> torch.Tensor | None:
    """The target ids the draft can propose, where that is fewer than the target's vocabulary."""
    return head.draft_ids


def tiny_head(target_model, draft_ids: list[int]) -> Eagle3Head:
    """A randomly initialised head over the draft vocabulary `draft_ids`, reading the target's first, middle and
    last layers, bound to a (tiny) loaded target, seeded."""
    torch.manual_seed(8)
    layers = target_model.config.num_hidden_layers
    head = Eagle3Head(target_model.config, len(draft_ids), aux_layers=[0, layers // 2, layers])
    head.set_draft_vocab(torch.tensor(draft_ids))
    return head.bind_target(target_model.get_input_embeddings()).eval()


def tiny_draft(target_model, k: int = 3) -> Eagle3Head:
    """The kind's case in the per-kind tests: a tiny head whose draft vocabulary lacks every id 2 mod 4 (of a
    5-token vocabulary: token 2), so a target token it cannot propose is exercised."""
    return tiny_head(target_model, [t for t in range(target_model.config.vocab_size) if t % 4 != 2])


# ---- warm start: a released head (vllm-eagle3 or speculators) read back -----------------------------

def check_d2t(path: Path, d2t: torch.Tensor, vocab: int) -> torch.Tensor:
    """d2t[i] = target id of draft token i minus i; the target ids must be sorted, distinct, in [0, V)."""
    ids = torch.arange(len(d2t), device=d2t.device) + d2t.long()
    if len(ids) and (ids.min() < 0 or ids.max() >= vocab or not bool((ids[1:] > ids[:-1]).all())):
        raise SpecdistillError(f"{path}: d2t does not map draft ids to sorted, distinct target ids in [0, {vocab})")
    return ids

def released_shape(path, target_config) -> tuple[int, list[int] | None, bool]:
    """(draft vocabulary size, aux layer ids or None, fc_norm) of a released EAGLE-3 head, to build a head of
    its shape."""
    config, state = read_released(path)
    check_fits(path, config, target_config, "EAGLE-3 head")
    if config.get("norm_before_residual"):
        raise SpecdistillError(f"draft.init_from {path}: norm_before_residual is true; the heads trained here "
                               f"add the un-normed state as the residual (norm_before_residual: false)")
    vd = config.get("draft_vocab_size") or (state["lm_head.weight"].shape[0] if "lm_head.weight" in state else None)
    aux = config.get("eagle_aux_hidden_state_layer_ids") or (config.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids")
    return int(vd or target_config.vocab_size), (list(aux) if aux else None), bool(config.get("fc_norm"))


def in_cache_order(pieces: list[torch.Tensor], released_aux: list[int], aux: list[int], repeat) -> list[torch.Tensor]:
    """Per-aux-state pieces (fc's column blocks, fc_norm weights) from the released order (ascending, each id
    once: the export's) into the cache's order `aux`; a repeated id's first state gets the released piece, the
    others `repeat(piece)` (zero fc blocks, so fc computes the same)."""
    by_id = dict(zip(released_aux, pieces))
    seen: set[int] = set()
    out = []
    for layer_id in aux:
        out.append(repeat(by_id[layer_id]) if layer_id in seen else by_id[layer_id])
        seen.add(layer_id)
    return out


def warm_start(path, head: Eagle3Head, target_config, released_aux: list[int] | None = None) -> None:
    """Continue training a released EAGLE-3 head (`draft.init_from`); its fc keeps reading raw aux states
    (or, with fc_norm, the normed ones)."""
    config, state = read_released(path)
    if released_aux is not None and list(released_aux) != head.aux_layers and "fc.weight" in state:
        blocks = list(state["fc.weight"].split(target_config.hidden_size, dim=1))
        state["fc.weight"] = torch.cat(in_cache_order(blocks, list(released_aux), head.aux_layers, torch.zeros_like),
                                       dim=1)
        released_norms = fc_norm_names(len(released_aux))
        if head.fc_norm is not None and all(n in state for n in released_norms):
            norms = in_cache_order([state.pop(n) for n in released_norms], list(released_aux), head.aux_layers,
                                   torch.ones_like)  # a repeated state's fc block is zero: its norm is moot
            state.update(zip(fc_norm_names(len(norms)), norms))
    vocab = target_config.vocab_size
    vd = head.lm_head.weight.shape[0]
    d2t = state.pop("d2t", None)
    state.pop("t2d", None)
    if d2t is None:
        if vd != vocab:
            raise SpecdistillError(f"draft.init_from {path}: no d2t but a draft vocabulary of {vd} < {vocab}")
        d2t = torch.zeros(vd, dtype=torch.long, device=head.lm_head.weight.device)
    ids = check_d2t(Path(path), d2t.long(), vocab)
    state.pop("aux_scale", None)
    load_state(path, head, {**state, "d2t": d2t.long(), "t2d": head.t2d, "aux_scale": head.aux_scale}, "EAGLE-3 head")
    head.set_draft_vocab(ids)
    head.keep_fc_function = True  # fc reads raw aux states: set_aux_scale must not change what it computes
