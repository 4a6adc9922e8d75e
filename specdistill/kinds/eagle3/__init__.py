"""`draft.kind: eagle3` — an EAGLE-3 head (`model.py` `Eagle3Head`), everything about it in this package.

  config     the recipe's draft and loss sections, the constants (torch-free)
  model      the head; cache: hidden_aux (the input of the target layers `target.resolve_aux_layers`
             picks) and hidden_last; its draft vocabulary (the Vd most frequent trained tokens)
  objective  training-time test: the head unrolled `ttt_steps` times on its own states (`ttt_forward`),
             step s weighted ttt_decay**s; q against the target's p restricted to the draft vocabulary;
             metrics: the first drafted token against the target's FULL distribution, acceptance per depth
  drafter    fused aux states in, draft-vocabulary tokens out (mapped to target ids); eager and static
  formats    checkpoint; export vllm-eagle3 (vLLM's Eagle3LlamaForCausalLM) and speculators
"""
