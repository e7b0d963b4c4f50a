"""Native kernels for what XLA does not emit well: C++ sources built on first use, per machine."""
