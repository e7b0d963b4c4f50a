"""XLA-profiled benchmarks, each run side by side with the PyTorch reference.

transformers 5.25 and later swap layers of the models it loads for kernels downloaded from the
hub unless ``USE_HUB_KERNELS`` says no; the reference is transformers' own PyTorch modules, and
the machines these suites run on reach no hub, so the package turns that off unless the caller
set it (each JSON records the value: ``backends``).
"""

import os

os.environ.setdefault("USE_HUB_KERNELS", "0")
