"""Where a step runs: the same torch model code (llama.forward) compiled by torch_xla's dynamo
backend or as one jax.jit executable (torchax traces it once per shape). Each backend puts the
weights and caches on its device, launches a step on a packed host buffer without waiting for
it (`run`), and reads a launched step's outputs back as NumPy arrays (`fetch`), so that the
engine can pack and launch the next step while one runs. The step's sampled tokens stay on the
device as the next step's `previous_tokens`.

  torch_xla  the step is torch.compile(backend="openxla") of llama.forward, once per step
             layout: dynamo traces the model once and each later call runs the cached XLA graph,
             where lazy tensors would record every op of every layer again at every step (24 of
             a 28 ms step for the 1B model on an H100). The caches, written in place, are
             marked as buffer donors, so the graph writes them in place (input/output
             aliasing), not into copies. torch_xla waits for the step before it launches the
             next (its device lock), so what overlaps the running step is the host's
             scheduling and packing of the next one. Split over several devices
             (tensor_parallel_size), it runs under torch_xla SPMD, and the step returns its
             caches as new tensors (spmd.sharded's functional form) in the donated buffers.
  torchax    the step is a jax.jit function of plain JAX arrays, compiled once per shape, the
             caches donated (donate_argnums) and the executable called directly: torchax's
             tensors exist only while the step is traced, so a call converts nothing. On the
             GPU, XLA GPU runs our CUDA handlers.
"""

import contextlib
import functools
import os
import types

import numpy as np
import torch

from torch_xla_ext.errors import TorchXlaExtError
from torch_xla_ext.serving import llama
from torch_xla_ext.step import STEP_FAILED, failures_reported


def _map(fn, tree, *others):
    """fn(leaf, *the leaves at the same place in `others`) over the nested dicts and lists of
    `tree` (None leaves stay None)."""
    if isinstance(tree, dict):
        return {k: _map(fn, v, *(o[k] for o in others)) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_map(fn, *leaves) for leaves in zip(tree, *others))
    return None if tree is None else fn(tree, *others)


def _compiled(fn):
    """torch.compile(fn) through torch_xla's dynamo backend, on a code object of its own:
    dynamo counts recompilations per code object (8 at most with fullgraph), and each layout
    is a graph of its own."""
    fn = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__,
                            fn.__closure__)
    return torch.compile(fn, backend="openxla", fullgraph=True, dynamic=False)


def _donated(caches):
    """Inside a compiled step: the caches, written in place, donated to the graph (input/output
    aliasing) instead of copied."""
    for cache in caches:
        torch.ops.xla.dynamo_set_buffer_donor_(cache, True)


# How each weight of a layer splits over the tensor parallel devices (mesh axis "tp", both
# backends): the q/k/v and gate/up projections by output rows (llama.weights_from_hf groups
# them shard by shard), o and down by input columns (their products are summed over the
# devices: XLA's all-reduce); the rest is replicated. The caches split over kv heads
# (dimension 2).
_LAYER_SPLITS = {"qkv": ("tp",), "qkv_bias": ("tp",), "gate_up": ("tp",),
                 "gate_up_bias": ("tp",), "o": (None, "tp"), "down": (None, "tp")}
_CACHE_SPLIT = (None, None, "tp", None)
# The head splits by vocabulary rows: each device reads its share of it, and XLA's argmax over
# the split logits gathers only each device's best (value, index) per sequence. A tied head is
# the embedding, which then splits too (its row gather becomes one all-reduce of the step's
# [tokens, hidden]); an untied embedding stays whole (a step reads only its tokens' rows).
_VOCAB_SPLIT = ("tp",)


def _weight_splits(weights, tensor_parallel_size):
    """How each of `weights` (weights_from_hf's dict) splits over a mesh of
    tensor_parallel_size devices: a tree like it of partition specs (mesh axes per dimension,
    trailing ones replicated)."""
    head = "lm_head" if "lm_head" in weights else "embed"
    vocab_splits = tensor_parallel_size > 1 and weights[head].shape[0] % tensor_parallel_size == 0
    return {name: [{w: _LAYER_SPLITS.get(w, ()) for w in layer} for layer in weights["layers"]]
            if name == "layers" else _VOCAB_SPLIT if name == head and vocab_splits else ()
            for name in weights}


def add_rms_norm():
    """LayerOps.add_rms_norm of both backends: XLA's add and norm fusions, unless
    XLA_EXT_SERVING_ADD_RMS_NORM=1 asks for our add_rms_norm. With it the 1B decode step on the
    H200 was slower: 1.26 against 1.21 ms at B=1, 1.52 against 1.45 at B=16 (runs of 8; its
    kernel took 3.7-4.5 µs where XLA's add and norm took 2.9, and XLA's o and down GEMMs then
    ended in a split-K reduction of their own, 1.4 µs, that the add had absorbed;
    tools/device/run.sh layer_ops, docs/performance.md)."""
    value = os.environ.get("XLA_EXT_SERVING_ADD_RMS_NORM", "0")
    if value not in ("0", "1"):
        raise TorchXlaExtError(f"XLA_EXT_SERVING_ADD_RMS_NORM: expected 0 or 1, got {value!r}")
    return torch.ops.xla_ext.add_rms_norm if value == "1" else None


def small_batch_tokens():
    """LayerOps.small_batch_tokens of both backends: XLA_EXT_SERVING_SMALL_BATCH_TOKENS, by
    default 0, so that XLA's dots run every linear layer. With our small_batch_linear on the
    1B model's decode steps on the H200 (16 tokens, the smallest token bucket), the step was
    slower: 1.61 against 1.18 ms at B=1, 1.87 against 1.42 at B=16 (runs of 8; a layer's four
    products and their epilogues 72 µs against XLA's 45; tools/device/run.sh layer_ops,
    docs/performance.md)."""
    value = os.environ.get("XLA_EXT_SERVING_SMALL_BATCH_TOKENS", "")
    try:
        return int(value) if value else 0
    except ValueError:
        raise TorchXlaExtError(f"XLA_EXT_SERVING_SMALL_BATCH_TOKENS: expected an integer, got "
                               f"{value!r}") from None


class TorchXlaBackend:
    """torch_xla's device; with tensor_parallel_size N > 1, torch_xla SPMD (switched on for
    the whole process: xr.use_spmd) over a mesh of every device torch_xla sees (an SPMD mesh
    spans them all), axes ("replica", "tp"): the model split over N devices as the torchax
    backend splits it (_weight_splits, caches by kv heads), and replicated over the
    devices / N groups of N when there are more devices. Our ops run on each device's heads
    (spmd.sharded, inside the compiled step); XLA's partitioner adds the all-reduces."""
    name = "torch_xla"

    def __init__(self, tensor_parallel_size=1):
        import torch_xla

        import torch_xla_ext  # noqa: F401  (registers our ops and kernels)

        self.tensor_parallel_size = tensor_parallel_size
        self.mesh = None if tensor_parallel_size == 1 else self._mesh(tensor_parallel_size)
        self.device = torch_xla.device()
        # Our ops on whole tensors, the K/V written in place by kv_cache_update after the
        # rotation in torch: with rotary_kv_cache_update, which returns the new cache, a step
        # that failed on the device (a bad slot) ran again at the sync that made new caches,
        # in one of six runs of tests/serving/step_failure_test.py on a loaded CPU, and failed
        # the engine's recovery; written in place, none of eight.
        self._ops = llama.LayerOps(llama.write_kv_in_place,
                                   torch.ops.xla_ext.ragged_paged_attention,
                                   add_rms_norm=add_rms_norm(),
                                   small_batch_tokens=small_batch_tokens())
        if self.mesh is not None:
            from torch_xla_ext import spmd

            self._ops = llama.LayerOps(
                write_kv=spmd.sharded("kv_cache_update", self.mesh, heads="tp",
                                      functional=True),
                attend=spmd.sharded("ragged_paged_attention", self.mesh, heads="tp"))
        self._steps = {}  # (shape, layout, with_logits) -> the compiled step

    @staticmethod
    def _mesh(tensor_parallel_size):
        import numpy as np
        import torch_xla
        import torch_xla.distributed.spmd as xs
        import torch_xla.runtime as xr

        count = xr.global_runtime_device_count()
        if not 1 <= tensor_parallel_size <= count or count % tensor_parallel_size:
            raise TorchXlaExtError(
                f"Engine: argument 'tensor_parallel_size': expected a divisor of the {count} "
                f"{xr.device_type()} devices torch_xla sees (a torch_xla SPMD mesh spans them "
                f"all; the model is replicated over the groups), got {tensor_parallel_size}")
        if not xr.is_spmd():
            if torch_xla._XLAC._xla_get_spmd_config_is_locked():
                # Switching SPMD on now would re-place the live tensors on the SPMD device,
                # which fails in torch_xla 2.9 (a crash, or a tensor "in flight").
                raise TorchXlaExtError(
                    f"Engine: argument 'tensor_parallel_size' = {tensor_parallel_size} needs "
                    "torch_xla SPMD, which is switched on for the whole process, and this "
                    "process has used its torch_xla device without it: call "
                    "torch_xla.runtime.use_spmd() at its start, before any XLA tensor exists")
            xr.use_spmd()
        return xs.Mesh(np.arange(count), (count // tensor_parallel_size, tensor_parallel_size),
                       ("replica", "tp"))

    def _split(self, tensor, spec):
        """`tensor` marked split over the mesh as `spec` (axes of its leading dimensions)."""
        import torch_xla.distributed.spmd as xs

        spec = tuple(spec) + (None,) * (tensor.dim() - len(spec))
        xs.mark_sharding(tensor, self.mesh, spec)
        return tensor

    def put(self, weights):
        """The weights on the device, split over the mesh (_weight_splits) where there is one,
        materialised before the first step."""
        import torch_xla_ext

        splits = _weight_splits(weights, self.tensor_parallel_size)
        weights = _map(lambda t: t.to(self.device), weights)
        if self.mesh is not None:
            weights = _map(self._split, weights, splits)
        torch_xla_ext.sync()
        return weights

    def new_caches(self, shapes, dtype):
        """Zeroed caches on the device, split by kv heads on the mesh, materialised."""
        import torch_xla_ext

        caches = [torch.zeros(s, dtype=dtype, device=self.device) for s in shapes]
        if self.mesh is not None:
            caches = [self._split(cache, _CACHE_SPLIT) for cache in caches]
        torch_xla_ext.sync()
        return caches

    def tokens(self, count):
        """`count` int32 zeros on the device: previous_tokens where no step came before. Sent
        as data, as a step's own tokens are, so that the first step's graph is the next ones'."""
        return torch.zeros(count, dtype=torch.int32).to(self.device)

    def run(self, shape, layout, with_logits, weights, caches, packed, previous_tokens):
        """Launches a step; returns (its outputs on the device, the caches it writes)."""
        packed = torch.from_numpy(packed).to(self.device)
        with failures_reported():
            return self._step(shape, layout, with_logits)(weights, caches, packed,
                                                          previous_tokens)

    def _step(self, shape, layout, with_logits):
        key = (shape, layout, with_logits)
        if key not in self._steps:
            def step(weights, caches, packed, previous_tokens):
                _donated(caches)
                return llama.forward(shape, layout, with_logits, weights, caches, packed,
                                     previous_tokens, self._ops)

            self._steps[key] = _compiled(step)
        return self._steps[key]

    def run_decodes(self, shape, layout, page_size, num_steps, weights, caches, packed,
                    steps_left, previous_tokens):
        """Launches a run of num_steps decode steps, the first on `packed`, each later one on
        the batch the step before computes (llama.next_decode_batch; steps_left: int32
        [max_num_seqs], each row's steps); returns ((token ids [num_steps, max_num_seqs], the
        last step's), the caches). One compiled graph per step, launched num_steps times
        (torch_xla's dynamo bridge keeps no loop on the device), but the host neither
        schedules nor packs between the steps."""
        step = self._decode_step(shape, layout, page_size)
        packed = torch.from_numpy(packed).to(self.device)
        steps_left = torch.from_numpy(steps_left).to(self.device)
        tokens = []
        with failures_reported():
            for _ in range(num_steps):
                (token_ids,), packed, steps_left, caches = step(weights, caches, packed,
                                                                steps_left, previous_tokens)
                tokens.append(token_ids)
                previous_tokens = token_ids
            return (torch.stack(tokens), previous_tokens), caches

    def _decode_step(self, shape, layout, page_size):
        key = ("decode", shape, layout, page_size)
        if key not in self._steps:
            def step(weights, caches, packed, steps_left, previous_tokens):
                _donated(caches)
                outputs, caches = llama.forward(shape, layout, False, weights, caches, packed,
                                                previous_tokens, self._ops)
                return (outputs, *llama.next_decode_batch(layout, page_size, packed, steps_left),
                        caches)

            self._steps[key] = _compiled(step)
        return self._steps[key]

    def fetch(self, outputs):
        with failures_reported():
            return [o.cpu().numpy() for o in outputs]


class TorchaxBackend:
    name = "torchax"

    def __init__(self, tensor_parallel_size=1):
        import jax

        import torch_xla_ext.torchax_ops  # noqa: F401  (before torchax's environment exists)
        import torchax

        devices = jax.devices()
        if not 1 <= tensor_parallel_size <= len(devices):
            raise TorchXlaExtError(f"Engine: argument 'tensor_parallel_size': expected 1 ... "
                                   f"{len(devices)} (the {devices[0].platform} devices JAX "
                                   f"sees), got {tensor_parallel_size}")
        self.mesh = jax.sharding.Mesh(devices[:tensor_parallel_size], ("tp",))
        self.env = torchax.default_env()
        self._ops = llama.LayerOps(llama.write_kv_in_place,
                                   torch.ops.xla_ext.ragged_paged_attention,
                                   torch.ops.xla_ext.rotary_kv_cache_update,
                                   add_rms_norm(), small_batch_tokens())
        self._steps = {}  # (shape, layout, with_logits) -> the jitted step

    @property
    def device(self):
        return self.mesh.devices.flat[0]

    def _placed(self, array, split=()):
        import jax
        from jax.sharding import NamedSharding, PartitionSpec

        return jax.device_put(array, NamedSharding(self.mesh, PartitionSpec(*split)))

    def put(self, weights):
        """The weights as JAX arrays on the mesh (a pytree of them), split for tensor
        parallelism (_weight_splits) where the mesh has several devices."""
        weights = _map(lambda t: t.cpu(), weights)  # outside the environment: torch's own .cpu()
        with self.env:
            weights = _map(lambda t: t.to("jax").jax(), weights)
        return _map(self._placed, weights, _weight_splits(weights, self.mesh.size))

    def new_caches(self, shapes, dtype):
        """Zeroed caches on the mesh, split by kv heads (_CACHE_SPLIT)."""
        with self.env:
            return [self._placed(torch.zeros(s, dtype=dtype, device="jax").jax(), _CACHE_SPLIT)
                    for s in shapes]

    def tokens(self, count):
        """`count` int32 zeros replicated on the mesh, as a step's own tokens come out (the
        first step's graph is the next ones')."""
        import jax.numpy as jnp

        return self._placed(jnp.zeros(count, jnp.int32))

    def _step(self, shape, layout, with_logits):
        key = (shape, layout, with_logits)
        if key not in self._steps:
            import jax
            import torchax.interop

            on_jax_arrays = torchax.interop.jax_view(
                functools.partial(llama.forward, shape, layout, with_logits, ops=self._ops))
            env = self.env

            def step(weights, caches, packed, previous_tokens):
                with env:  # only while tracing: the compiled step is plain XLA
                    return on_jax_arrays(weights, caches, packed, previous_tokens)

            self._steps[key] = jax.jit(step, donate_argnums=(1,))
        return self._steps[key]

    def run(self, shape, layout, with_logits, weights, caches, packed, previous_tokens):
        with _step_failures():
            outputs, caches = self._step(shape, layout, with_logits)(weights, caches, packed,
                                                                     previous_tokens)
            for output in outputs:  # on its way to the host while the next step is packed
                output.copy_to_host_async()
        return outputs, caches

    def run_decodes(self, shape, layout, page_size, num_steps, weights, caches, packed,
                    steps_left, previous_tokens):
        """As TorchXlaBackend.run_decodes, in one launch: the steps are a loop in the
        executable. Its trip count is a constant, which XLA GPU runs without reading a loop
        condition back to the host at every step (with a count given as data, the launch
        waited for every step: 17.7 ms for 8 steps of the 1B model at B=1 on the H100)."""
        with _step_failures():
            (tokens, last), caches = self._decodes(shape, layout, page_size, num_steps)(
                weights, caches, packed, steps_left, previous_tokens)
            tokens.copy_to_host_async()
        return (tokens, last), caches

    def _decodes(self, shape, layout, page_size, num_steps):
        key = ("decodes", shape, layout, page_size, num_steps)
        if key not in self._steps:
            import jax
            import jax.numpy as jnp
            import torchax.interop

            forward = torchax.interop.jax_view(
                functools.partial(llama.forward, shape, layout, False, ops=self._ops))
            next_batch = torchax.interop.jax_view(
                functools.partial(llama.next_decode_batch, layout, page_size))
            env = self.env

            def decodes(weights, caches, packed, steps_left, previous_tokens):
                def step(i, carry):
                    caches, packed, steps_left, previous_tokens, tokens = carry
                    (token_ids,), caches = forward(weights, caches, packed, previous_tokens)
                    packed, steps_left = next_batch(packed, steps_left)
                    return caches, packed, steps_left, token_ids, tokens.at[i].set(token_ids)

                tokens = jnp.zeros((num_steps, layout.max_num_seqs), jnp.int32)
                with env:
                    caches, _, _, last, tokens = jax.lax.fori_loop(
                        0, num_steps, step, (caches, packed, steps_left, previous_tokens, tokens))
                return (tokens, last), caches

            self._steps[key] = jax.jit(decodes, donate_argnums=(1,))
        return self._steps[key]

    def fetch(self, outputs):
        with _step_failures():
            return [np.asarray(o) for o in outputs]


@contextlib.contextmanager
def _step_failures():
    """JAX's runtime errors (a step that failed on the device, or one launched on its
    results) as TorchXlaExtError, worded as torch_xla's (step.STEP_FAILED)."""
    import jax

    try:
        yield
    except jax.errors.JaxRuntimeError as e:
        raise TorchXlaExtError(f"{STEP_FAILED}{e}") from e


BACKENDS = {"torch_xla": TorchXlaBackend, "torchax": TorchaxBackend}
