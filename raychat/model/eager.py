"""Running a function eagerly from inside code that torch.compile traces.

A module of its own, imported only while TorchDynamo traces (torch.compiler.is_compiling()), because
torch.compiler.disable imports TorchDynamo, which costs every process seconds, and the CLIs and the
driver, which build and plan models but never compile them, should not pay for it.
"""

from collections.abc import Callable
from typing import Any

import torch


@torch.compiler.disable
def call_eagerly(fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args) outside the graph: the compiled caller takes one graph break here and receives the
    result as an input."""
    return fn(*args)
