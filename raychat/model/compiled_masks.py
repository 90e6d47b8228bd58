"""`layer_masks` for code being compiled: the same cached lookup, kept out of the graph.

A module of its own because torch.compiler.disable imports TorchDynamo (1.6 s per process), which
the CLIs and the driver never need; raychat.model.attention.layer_masks imports this
only while torch.compile traces, when TorchDynamo is already loaded.
"""

import torch

from raychat.model.attention import build_layer_masks

layer_masks_outside_graph = torch.compiler.disable(build_layer_masks)
