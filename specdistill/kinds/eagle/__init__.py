"""`draft.kind: eagle` — an EAGLE-1 head (`model.py` `EagleHead`), everything about it in this package.

  config     the recipe's draft and loss sections, the constants (torch-free)
  model      the head, built fresh or warm-started from a released head; cache: hidden_last (the
             final-norm state the target's LM head reads)
  objective  input (x[t+1], f[t]) -> f_hat[t+1]; Smooth-L1 on features + w * the distribution loss of
             lm_head(f_hat) against lm_head(f) (full vocabulary), with EAGLE's uniform feature noise;
             metrics: first-draft offline metrics + acceptance per draft depth on the head's own features
  drafter    position t reads (token t+1, f[t]); drafts on its own predicted features
  formats    checkpoint; export vllm-eagle (vLLM's EagleLlamaForCausalLM)
"""
