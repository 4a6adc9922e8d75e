"""`draft.kind: draft_lm` — a small causal LM drafter: the target's architecture and vocabulary, fewer or
smaller layers; everything about it in this package.

  config     the recipe's draft and loss sections, the constants (torch-free)
  model      built from the target's embedding (and its first layers when `copy_target_layers` and the
             shapes fit), or from `init_from` (an existing small model with the same vocabulary); optional
             LoRA; cache: topk (the target's top-k log-probs)
  objective  the distribution loss at every trained position (logits at j predict token j+1)
  drafter    its own KV cache, K tokens autoregressively
  formats    checkpoint (a plain causal LM, LoRA merged); export hf (vLLM's `draft_model` method)
"""

ASKED_LAST = True  # its `owns` claims any module: `kind_of` asks every other kind first
