"""Starting a local Ray for a test module, once more if the first start times out.

On a loaded 2-core machine, Ray's node start-up now and then exceeds Ray's own limit ("The
current node timed out during startup"), and a second start succeeds. Any other failure, and a
second time-out, is raised. The Ray is always a new local one (`address="local"`), never a
cluster that another process on the machine happens to run.
"""

from __future__ import annotations

import warnings
from typing import Any

import ray


def init_ray(**kwargs: Any) -> None:
    kwargs.setdefault("address", "local")
    try:
        ray.init(**kwargs)
    except Exception as e:
        if "timed out" not in str(e):
            raise
        warnings.warn(f"Ray start-up timed out, starting it again: {e}", stacklevel=2)
        ray.shutdown()
        ray.init(**kwargs)
