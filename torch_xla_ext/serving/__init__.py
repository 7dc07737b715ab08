"""A small vLLM-style serving loop for Llama-architecture models on our ops: paged KV cache
(blocks.py), continuous batching with chunked prefill (scheduler.py), ragged batches packed
for the ops (batch.py), the model step (llama.py), where it runs (backends.py: torch_xla or
torchax) and the loop (engine.py)."""

from torch_xla_ext.serving.engine import Engine, StepOutput

__all__ = ["Engine", "StepOutput"]
