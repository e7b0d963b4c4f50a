"""Pure Flax NNX model modules and their HF parameter maps; no scheduling here."""
