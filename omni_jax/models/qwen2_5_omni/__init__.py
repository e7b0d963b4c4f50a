"""Qwen2.5-Omni: thinker, talker and token2wav (DiT + BigVGAN) modules."""
