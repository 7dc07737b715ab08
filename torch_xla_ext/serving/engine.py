"""The serving loop: requests in, one model step per `step()`, tokens out.

    engine = Engine(hf_llama_model, backend="torch_xla", max_num_seqs=8,
                    max_num_batched_tokens=256)
    engine.add_request([1, 2, 3], max_new_tokens=16)      # at any step
    while engine.has_unfinished():
        out = engine.step()                                # out.new_tokens: {seq_id: token}

A step: the scheduler picks this step's chunks (scheduler.py), the host packs them into one int32
buffer padded to a token bucket (batch.py), the backend launches the model step on it as one XLA
graph (backends.py, llama.py), and the sampled tokens go back to the scheduler, which finishes
sequences and frees their pages.

Async scheduling (the default): each `step()` schedules, packs and launches the next step
before it waits for the one it reports, so the host's work runs while the device computes. The
next step takes the running step's sampled tokens on the device (placeholders in its batch,
filled in the graph: scheduler.py), and they reach the host one step later, off the critical
path. A sequence that ends on its EOS token, or is aborted, while a step for it is already in
flight has that step's token dropped; one whose max_new_tokens-th token is in flight is not
scheduled again. `async_scheduling=False` launches a step and waits for it in the same call.
Either way each `step()` reports one step, in order, and the tokens are the same.

Runs of decode steps (max_decode_steps = K > 1): when every running sequence only decodes, no
request waits, and some sequence has K tokens or more left to generate, K steps launch as one.
The device computes each step's batch from the one before (llama.next_decode_batch) and feeds
it the tokens it sampled; a sequence with fewer tokens left stops writing after its last and
its row idles. The host schedules the run's steps at once and reads their tokens back
together. Nothing but an EOS token or an abort can end a sequence within the run, and those
drop the tokens after them as they do for steps in flight, so the tokens are those of single
steps. A request added meanwhile waits for the run to end (at most K - 1 steps later than
otherwise).

Compiles: one per token bucket a step uses (buckets: batch.token_buckets, e.g. 16, 32, 64, 128,
256 for max_num_batched_tokens=256), whatever the requests, since max_num_seqs and
pages_per_seq are fixed; with runs of decode steps, one more per bucket a run uses.
"""

import collections
import dataclasses
import time
from typing import Optional

import numpy as np

from torch_xla_ext.errors import TorchXlaExtError
from torch_xla_ext.serving import backends, batch, llama
from torch_xla_ext.serving.blocks import BlockAllocator
from torch_xla_ext.serving.scheduler import Scheduler, Sequence
from torch_xla_ext.step import STEP_FAILED


@dataclasses.dataclass
class StepOutput:
    step: int  # 0 for the first step
    num_seqs: int
    num_tokens: int  # tokens run (prefill chunks and decodes), before padding
    num_prefill_tokens: int
    bucket: int  # the padded token count the step ran at
    first_use_of_bucket: bool  # the step compiled (or loaded) its graph (a single step's, or
    # that of a run of decode steps)
    seconds: float  # wall time of the step() call that reported it
    new_tokens: dict  # seq_id -> the token generated for it in this step
    finished: dict  # seq_id -> all its generated tokens, for those that finished
    logits: Optional[dict] = None  # seq_id -> float32 logits of the new token (with_logits)
    failed: dict = dataclasses.field(default_factory=dict)  # seq_id -> the error that ended it


def _is_token_id(value, vocab_size):
    return (isinstance(value, (int, np.integer)) and not isinstance(value, bool)
            and 0 <= value < vocab_size)


@dataclasses.dataclass
class _Launched:
    """Steps launched on the device as one (a single step, or a run of decode steps), their
    results not yet read back."""
    step: int  # the first one's number
    steps: list  # each step's chunks
    bucket: int
    first_use_of_bucket: bool
    outputs: list  # the backend's device arrays: token ids (+ logits) ([steps, seqs] for a run)
    # The caches it was given (donated: they are its outputs now), dropped once it is read
    # back: releasing an array donated to a step still running waits for that step (seen on
    # XLA CPU: 0.2 s per launch), which would serialise the launch with the step before.
    donated: list


class Engine:
    def __init__(self, model, *, backend="torch_xla", dtype=None, page_size=16, num_pages=None,
                 max_num_seqs=8, max_num_batched_tokens=256, max_model_len=None,
                 smallest_bucket=16, with_logits=False, async_scheduling=True,
                 max_decode_steps=1, tensor_parallel_size=1):
        """`model`: a transformers LlamaForCausalLM (its weights are copied to the device in
        `dtype`, default the model's). num_pages: default enough for max_num_seqs sequences of
        max_model_len tokens (default config.max_position_embeddings). with_logits: also
        return each new token's logits (StepOutput.logits), for comparisons. async_scheduling:
        launch the next step before waiting for the current one (module docstring).
        max_decode_steps: this many decode steps in one launch when only decodes run (module
        docstring); 1 launches every step alone. tensor_parallel_size: the devices the model
        is split over (vLLM's name): heads and MLP rows per device, caches by kv heads, an
        all-reduce after attention and after the MLP of each layer; torchax uses the first N
        devices, torch_xla switches SPMD on for the process and replicates the split model
        over every group of N devices it sees (backends.TorchXlaBackend)."""
        if backend not in backends.BACKENDS:
            raise TorchXlaExtError(f"Engine: argument 'backend': expected one of "
                                   f"{sorted(backends.BACKENDS)}, got {backend!r}")
        max_model_len = max_model_len or model.config.max_position_embeddings
        if isinstance(tensor_parallel_size, bool) or not isinstance(tensor_parallel_size, int):
            raise TorchXlaExtError(f"Engine: argument 'tensor_parallel_size': expected a "
                                   f"positive integer, got {tensor_parallel_size!r}")
        self.backend = backends.BACKENDS[backend](tensor_parallel_size)
        self.shape, host_weights = llama.weights_from_hf(model, dtype, max_model_len,
                                                         tensor_parallel_size)
        self.page_size = page_size
        pages_per_seq = -(-max_model_len // page_size)
        self.num_pages = num_pages or max_num_seqs * pages_per_seq
        self.max_num_seqs = max_num_seqs
        self.pages_per_seq = pages_per_seq
        self.buckets = batch.token_buckets(max_num_batched_tokens, smallest_bucket)
        self.with_logits = with_logits
        self.async_scheduling = bool(async_scheduling)
        if isinstance(max_decode_steps, bool) or not isinstance(max_decode_steps, int) or \
                max_decode_steps < 1:
            raise TorchXlaExtError(f"Engine: argument 'max_decode_steps': expected a positive "
                                   f"integer, got {max_decode_steps!r}")
        self.max_decode_steps = max_decode_steps
        self.allocator = BlockAllocator(self.num_pages, page_size)
        self.scheduler = Scheduler(self.allocator, max_num_seqs, max_num_batched_tokens,
                                   max_model_len)
        self.host_batch = batch.HostBatch(self.buckets, max_num_seqs, pages_per_seq)
        self._cache_shapes = [(self.num_pages, page_size, 2 * self.shape.num_kv_heads,
                               self.shape.head_dim)] * self.shape.num_layers
        self._cache_dtype = host_weights["embed"].dtype
        self.weights = self.backend.put(host_weights)
        self.caches = self.backend.new_caches(self._cache_shapes, self._cache_dtype)
        self._previous_tokens = self.backend.tokens(max_num_seqs)
        self._in_flight = None  # launched steps whose results are not read yet
        # Read-back steps not reported yet: (their launch, index in it, chunks, token ids,
        # logits or None).
        self._unreported = collections.deque()
        self.buckets_used = set()
        self._graphs_used = set()  # (bucket, a run of decode steps)
        self._steps = 0
        self._launches = 0
        self._next_id = 0

    def add_request(self, prompt, max_new_tokens, eos_token_id=None):
        """Queues a request (prompt: token ids); returns its sequence id. A request it refuses
        (the error names the argument) changes nothing."""
        vocab = f"[0, vocab_size = {self.shape.vocab_size})"
        prompt = list(prompt)
        for i, token in enumerate(prompt):
            if not _is_token_id(token, self.shape.vocab_size):
                raise TorchXlaExtError(f"add_request: argument 'prompt': expected integer token "
                                       f"ids in {vocab}, got prompt[{i}] = {token!r}")
        if eos_token_id is not None and not _is_token_id(eos_token_id, self.shape.vocab_size):
            raise TorchXlaExtError(f"add_request: argument 'eos_token_id': expected None or an "
                                   f"integer token id in {vocab}, got {eos_token_id!r}")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)):
            raise TorchXlaExtError(f"add_request: argument 'max_new_tokens': expected a positive "
                                   f"integer, got {max_new_tokens!r}")
        seq = Sequence(self._next_id, [int(t) for t in prompt], int(max_new_tokens),
                       None if eos_token_id is None else int(eos_token_id))
        self.scheduler.add(seq)
        self._next_id += 1
        return seq.seq_id

    def abort_request(self, seq_id):
        """Ends a request now: its pages go back to the pool and no token of it is reported
        from now on (a step in flight that computes one drops it). Returns True if it was
        waiting or running, False if it had already finished or been aborted."""
        if not isinstance(seq_id, int) or not 0 <= seq_id < self._next_id:
            raise TorchXlaExtError(f"abort_request: argument 'seq_id': expected the id of a "
                                   f"request added to this engine (0 ... {self._next_id - 1}), "
                                   f"got {seq_id!r}")
        return self.scheduler.abort(seq_id) is not None

    def has_unfinished(self):
        return (self.scheduler.has_unfinished() or self._in_flight is not None
                or bool(self._unreported))

    @property
    def num_steps(self):
        """Steps so far, counting those generate() waited through for arrivals."""
        return self._steps

    def _launch(self):
        """Schedules, packs and launches a step, or a run of decode steps; None when nothing
        is left to schedule."""
        run = (self.max_decode_steps > 1 and not self.with_logits
               and self.scheduler.runs_decodes(self.max_decode_steps))
        if run:
            steps, row_steps = self.scheduler.schedule_decodes(self.max_decode_steps)
        else:
            steps = [self.scheduler.schedule()]
        chunks = steps[0]
        if not chunks:
            return None
        bucket = batch.pick_bucket(self.buckets, sum(c.num_tokens for c in chunks))
        # Packed after every step of a run is scheduled: the block tables hold all their pages.
        # A run's steps are decode steps only, and attend as such (max_q_len 1). A single step
        # of decodes does not: that would be one more graph per bucket to compile, and its
        # gain on the GPU was not measured.
        layout, packed = self.host_batch.pack(
            chunks, [self.allocator.table(c.seq.seq_id) for c in chunks], bucket,
            self.page_size, self.num_pages, decodes_only=run)
        donated = self.caches
        if run:
            steps_left = np.zeros(self.max_num_seqs, np.int32)
            steps_left[:len(row_steps)] = row_steps
            (tokens, last), self.caches = self.backend.run_decodes(
                self.shape, layout, self.page_size, len(steps), self.weights, donated, packed,
                steps_left, self._previous_tokens)
            outputs = [tokens]
            self._previous_tokens = last
        else:
            outputs, self.caches = self.backend.run(self.shape, layout, self.with_logits,
                                                    self.weights, donated, packed,
                                                    self._previous_tokens)
            self._previous_tokens = outputs[0]
        graph = (bucket, run)
        launched = _Launched(self._launches, steps, bucket, graph not in self._graphs_used,
                             outputs, donated)
        self.buckets_used.add(bucket)
        self._graphs_used.add(graph)
        self._launches += len(steps)
        return launched

    def _read_back(self):
        """Waits for the oldest launch (with async scheduling, after launching the next) and
        queues its steps' results for reporting."""
        if self._in_flight is None:
            self._in_flight = self._launch()
            if self._in_flight is None:
                raise TorchXlaExtError("Engine.step: nothing to run; add a request first")
        done = self._in_flight
        self._in_flight = self._launch() if self.async_scheduling else None
        outputs = self.backend.fetch(done.outputs)
        tokens = outputs[0].reshape(-1, self.max_num_seqs)
        for i, chunks in enumerate(done.steps):
            self._unreported.append((done, i, chunks, tokens[i],
                                     outputs[1] if self.with_logits else None))

    def _fail_running(self, error):
        """After a step failed on the device: every running sequence ends with the error (the
        caches it wrote, donated to the step, are gone, and so is the K/V of every sequence in
        them), the steps launched after it are dropped, and the engine starts again on new
        caches. Waiting requests are untouched. Returns the StepOutput that reports it."""
        failed = list(self.scheduler.running)
        for seq in failed:
            self.scheduler.abort(seq.seq_id, reason="error")
        self._in_flight = None
        self.caches = self.backend.new_caches(self._cache_shapes, self._cache_dtype)
        self._previous_tokens = self.backend.tokens(self.max_num_seqs)
        message = str(error)
        out = StepOutput(step=self._launches, num_seqs=len(failed), num_tokens=0,
                         num_prefill_tokens=0, bucket=0, first_use_of_bucket=False,
                         seconds=0.0, new_tokens={}, finished={},
                         failed={seq.seq_id: message for seq in failed})
        self._steps += 1
        return out

    def step(self):
        """Runs one step; returns what it did (StepOutput). With async scheduling, the step
        after it is launched first; of a run of decode steps, the first step() waits for all
        and the others report what is already read back. A step that fails on the device
        (an XLA runtime error: a kernel's handler refusing its data) ends every running
        request with that error (StepOutput.failed) and the engine goes on with the rest."""
        start = time.perf_counter()
        if not self._unreported:
            try:
                self._read_back()
            except TorchXlaExtError as error:
                if not str(error).startswith(STEP_FAILED):
                    raise
                out = self._fail_running(error)
                out.seconds = time.perf_counter() - start
                return out
        done, index, chunks, token_ids, logits = self._unreported.popleft()
        sampled = [(c.seq.seq_id, c.row) for c in chunks if c.takes_token]
        finished = self.scheduler.update(chunks, token_ids)
        out = StepOutput(
            step=done.step + index, num_seqs=len(chunks),
            num_tokens=sum(c.num_tokens for c in chunks),
            num_prefill_tokens=sum(c.num_tokens for c in chunks
                                   if c.start < len(c.seq.prompt)),
            bucket=done.bucket, first_use_of_bucket=done.first_use_of_bucket and index == 0,
            seconds=time.perf_counter() - start,
            new_tokens={seq_id: int(token_ids[i]) for seq_id, i in sampled},
            finished={s.seq_id: list(s.output) for s in finished},
            logits={seq_id: logits[i] for seq_id, i in sampled} if logits is not None
            else None)
        self._steps += 1
        return out

    def generate(self, prompts, max_new_tokens, arrival_steps=None, eos_token_id=None,
                 on_step=None):
        """Runs prompts[i] (token ids), added at step arrival_steps[i] (default: all at once),
        to completion. Returns the generated tokens of each prompt, in order; on_step(out) is
        called after every step."""
        arrival_steps = arrival_steps or [0] * len(prompts)
        if len(arrival_steps) != len(prompts):
            raise TorchXlaExtError(f"generate: argument 'arrival_steps': expected one step per "
                                   f"prompt ({len(prompts)}), got {len(arrival_steps)}")
        order = list(np.argsort(arrival_steps, kind="stable"))
        ids, outputs, failed = {}, {}, {}
        first_step = self._steps
        while order or self.has_unfinished():
            while order and arrival_steps[order[0]] <= self._steps - first_step:
                i = int(order.pop(0))
                ids[self.add_request(prompts[i], max_new_tokens, eos_token_id)] = i
            if not self.has_unfinished():  # nothing has arrived yet: an idle step
                self._steps += 1
                continue
            out = self.step()
            for seq_id, token in out.new_tokens.items():
                if seq_id in ids:  # not a request added outside this call
                    outputs.setdefault(ids[seq_id], []).append(token)
            failed.update({ids[i]: error for i, error in out.failed.items() if i in ids})
            if on_step:
                on_step(out)
        if failed:
            first = min(failed)
            raise TorchXlaExtError(f"generate: prompts {sorted(failed)} failed in a step on the "
                                   f"device (the others ran to their end): {failed[first]}")
        return [outputs[i] for i in range(len(prompts))]
