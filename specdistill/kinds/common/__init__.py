"""What two or more draft kinds share (a kind never imports another kind's package; it imports from here).

  config.py       the loss section every kind extends, the keys EAGLE-style heads share
  llama_layer.py  the Llama-style decoder layer of EAGLE heads, built and initialised from the target's
  heads.py        what EAGLE-style heads share when training and drafting (unroll mask, chain drafter, storage)
  released.py     reading a released head directory (vLLM / speculators layouts) to continue training it
  weights.py      a head's tensors checked against the names and shapes a loader builds (exports, warm starts)
"""
