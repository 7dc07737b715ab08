"""Where a step runs: the same torch model code (llama.forward) on torch_xla's lazy tensors or
as a torchax jax.jit function. Each backend puts the weights and caches on its device, runs a
step on a packed host buffer, and hands back the step's outputs as NumPy arrays.

  torch_xla  lazy tensors: the step's ops are recorded, then torch_xla_ext.sync() compiles (once
             per shape) and runs them as one XLA graph; the caches, written in place, are
             donated to the graph (input/output aliasing), not copied.
  torchax    the step is a jax.jit function (torchax.interop.jax_jit) compiled once per shape,
             the caches donated (donate_argnums); on the GPU, XLA GPU runs our CUDA handlers.
"""

import numpy as np
import torch

from torch_xla_ext.serving import llama


def _map(fn, tree):
    if isinstance(tree, dict):
        return {k: _map(fn, v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_map(fn, v) for v in tree)
    return None if tree is None else fn(tree)


class TorchXlaBackend:
    name = "torch_xla"

    def __init__(self):
        import torch_xla

        import torch_xla_ext  # noqa: F401  (registers our ops and kernels)

        self.device = torch_xla.device()

    def put(self, weights, cache_shapes, cache_dtype):
        """(weights, caches) on the device, materialised before the first step."""
        import torch_xla_ext

        weights = _map(lambda t: t.to(self.device), weights)
        caches = [torch.zeros(s, dtype=cache_dtype, device=self.device) for s in cache_shapes]
        torch_xla_ext.sync()
        return weights, caches

    def run(self, shape, layout, with_logits, weights, caches, packed):
        import torch_xla_ext

        packed = torch.from_numpy(packed).to(self.device)
        outputs, caches = llama.forward(shape, layout, with_logits, weights, caches, packed)
        # Runs the step's graph (its writes included) before anything is read back: a read
        # first would run the writes in a graph of their own, copying the caches.
        torch_xla_ext.sync()
        return [o.cpu().numpy() for o in outputs], caches


class TorchaxBackend:
    name = "torchax"

    def __init__(self):
        import torch_xla_ext.torchax_ops  # noqa: F401  (before torchax's environment exists)
        import torchax
        import torchax.interop

        self.env = torchax.default_env()
        self._step = torchax.interop.jax_jit(
            llama.forward, kwargs_for_jax_jit={"static_argnums": (0, 1, 2),
                                               "donate_argnums": (4,)})

    @property
    def device(self):
        import jax

        return jax.devices()[0]

    def put(self, weights, cache_shapes, cache_dtype):
        weights = _map(lambda t: t.cpu(), weights)  # outside the environment: torch's own .cpu()
        with self.env:
            weights = _map(lambda t: t.to("jax"), weights)
            caches = [torch.zeros(s, dtype=cache_dtype, device="jax") for s in cache_shapes]
        return weights, caches

    def run(self, shape, layout, with_logits, weights, caches, packed):
        packed = torch.from_numpy(packed)  # made outside the environment: a CPU tensor
        with self.env:
            outputs, caches = self._step(shape, layout, with_logits, weights, caches,
                                         packed.to("jax"))
            return [np.asarray(o.jax()) for o in outputs], caches


BACKENDS = {"torch_xla": TorchXlaBackend, "torchax": TorchaxBackend}
