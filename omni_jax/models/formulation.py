"""Choosing among formulations of one computation by platform, with an environment override.

Some computations are written two ways because XLA lowers them well on one platform and badly on
another (MoE experts, SnakeBeta's ``sin^2``): each names its environment variable and forms here,
and the platform's default.
"""

from __future__ import annotations

import os


def formulation(switch: str, forms: tuple[str, ...], default: str) -> str:
    """The form the environment variable ``switch`` names among ``forms``, else ``default`` (the
    variable unset, empty or ``auto``); ``ValueError`` naming the variable on any other value. Read when
    a computation is traced, so a process may change it between traces."""
    asked = os.environ.get(switch) or "auto"  # set but empty: unset
    if asked == "auto":
        return default
    if asked not in forms:
        raise ValueError(f"{switch}={asked!r}: expected {', '.join(forms)} or auto")
    return asked
