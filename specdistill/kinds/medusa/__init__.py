"""`draft.kind: medusa` — Medusa-1 heads (Cai et al. 2024, `model.py` `MedusaHeads`), everything about them in
this package.

  config     the recipe's draft section (num_heads, num_layers, head_decay) and loss section, the constants
             (torch-free)
  model      K heads, each residual blocks over the target's last hidden state then its own LM head (started
             from the target's); head k predicts token t+2+k; cache: hidden_last (the final-norm state the
             target's LM head reads): the heads' input and, through the target's LM head at later positions,
             their target distributions
  objective  the recipe's distribution loss per head against the target's p at t+1+k, weighted head_decay**k;
             offline metrics per head (top1_at, alpha_at, simulated_tau)
  drafter    a chain (one token per head from one state) or Medusa's tree of top-k per head
  formats    checkpoint; export vllm-medusa (vLLM's `Medusa`, "method": "medusa")
"""
