"""Qwen3-Omni (MoE thinker, MoE talker with code predictor, causal ConvNet code2wav) modules."""
