"""omni_jax: a JAX/Flax inference engine for multi-stage omni models."""
