"""Stage graphs (one YAML per architecture) and the processors between stages."""
