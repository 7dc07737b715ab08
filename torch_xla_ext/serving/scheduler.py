"""Continuous batching with chunked prefill: which sequences run in a step, and how many of their
tokens, under a per-step token budget.

Each step, the running sequences come first, in the order they were admitted: a decoding one
takes 1 token, one still in its prompt takes what is left of it, cut to the budget that remains
(a chunk). Then waiting requests are admitted in arrival order while the budget, max_num_seqs
and the cache's pages allow; a long prompt is cut to the budget left and continues in the next
steps. A step's sampled token counts only for a sequence whose chunk reached its last known
token (the end of its prompt, or its last generated token).

Steps may run ahead of their results (the engine's async scheduling): `schedule()` counts a
chunk's tokens as computed and its sampled token as pending as soon as the chunk is scheduled,
so the next step can be scheduled before this one's tokens are read back. A pending token is
written into the next step's token ids as -1 - r, r being its row in the sampled tokens of the
step that produces it; that step hands its sampled tokens to the next on the device, which
resolves the placeholder there (llama.forward). A sequence whose last token (max_new_tokens) is
pending is not scheduled again; one that ends on its EOS token, or is aborted, while a later
step for it is in flight has that step's token dropped (`update`).

Pages: a sequence is admitted only when the pages for its longest possible length (prompt +
max_new_tokens - 1 tokens in the cache: the last generated token is never fed back) are free
beside those the running sequences may still take. Pages are then taken as tokens arrive, so a
running sequence never waits for pages and nothing is ever preempted; a finished sequence's
pages go back to the pool at once.
"""

import collections
import dataclasses
from typing import Optional

from torch_xla_ext.errors import TorchXlaExtError


@dataclasses.dataclass
class Sequence:
    seq_id: int
    prompt: list
    max_new_tokens: int
    eos_token_id: Optional[int] = None
    output: list = dataclasses.field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are in the cache, or written by a scheduled step
    # Rows of the sampled tokens of scheduled steps not yet read back that hold this
    # sequence's next tokens, oldest first.
    pending_rows: collections.deque = dataclasses.field(default_factory=collections.deque)
    finish_reason: Optional[str] = None  # "length", "eos", "abort" or "error"

    @property
    def num_tokens(self):
        """Tokens so far: the prompt, the generated ones and those still pending."""
        return len(self.prompt) + len(self.output) + len(self.pending_rows)

    @property
    def last_token_pending(self):
        """Its max_new_tokens-th token is sampled by a step in flight: nothing more to run."""
        return len(self.output) + len(self.pending_rows) >= self.max_new_tokens

    def tokens(self, start, end):
        """Tokens start ... end - 1 of the prompt followed by the generated ones, a pending
        token as its placeholder -1 - row."""
        known = len(self.prompt) + len(self.output)
        head = self.prompt[start:end] if start < len(self.prompt) else []
        head += self.output[max(start - len(self.prompt), 0):max(end - len(self.prompt), 0)]
        return head + [-1 - self.pending_rows[i - known] for i in range(max(start, known), end)]

    @property
    def max_cached_tokens(self):
        """The most tokens this sequence ever holds in the cache."""
        return len(self.prompt) + self.max_new_tokens - 1


@dataclasses.dataclass(frozen=True)
class Chunk:
    """num_tokens tokens of `seq`, from position start, run in this step: token_ids (a pending
    one as its placeholder). `samples`: the chunk reaches the sequence's last token, so the
    step's token for it is the next one, in row `row` of the step's sampled tokens."""
    seq: Sequence
    start: int
    num_tokens: int
    samples: bool
    token_ids: list
    row: int

    @property
    def takes_token(self):
        """Whether its step's token is the sequence's next one: the chunk samples and the
        sequence has not finished or been aborted since (`Scheduler.update` drops it else;
        asked before the update, this says which tokens it will report)."""
        return self.samples and not self.seq.finish_reason


def _chunk(seq, num_tokens, row):
    start = seq.num_computed
    return Chunk(seq, start, num_tokens, start + num_tokens == seq.num_tokens,
                 seq.tokens(start, start + num_tokens), row)


def _tokens_left(seq):
    """Tokens the sequence may still sample beyond those it has or has pending."""
    return seq.max_new_tokens - len(seq.output) - len(seq.pending_rows)


class Scheduler:
    def __init__(self, allocator, max_num_seqs, max_num_batched_tokens, max_model_len):
        for name, value in (("max_num_seqs", max_num_seqs),
                            ("max_num_batched_tokens", max_num_batched_tokens),
                            ("max_model_len", max_model_len)):
            if not isinstance(value, int) or value < 1:
                raise TorchXlaExtError(f"Scheduler: argument '{name}': expected a positive "
                                       f"integer, got {value!r}")
        self.allocator = allocator
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting = collections.deque()
        self.running = []

    def add(self, seq):
        """Queues a new sequence; refuses one that could never run."""
        if not seq.prompt:
            raise TorchXlaExtError(f"request {seq.seq_id!r}: argument 'prompt': expected at "
                                   "least one token, got none")
        if not isinstance(seq.max_new_tokens, int) or seq.max_new_tokens < 1:
            raise TorchXlaExtError(f"request {seq.seq_id!r}: argument 'max_new_tokens': expected "
                                   f"a positive integer, got {seq.max_new_tokens!r}")
        length = len(seq.prompt) + seq.max_new_tokens
        if length - 1 > self.max_model_len:
            raise TorchXlaExtError(
                f"request {seq.seq_id!r}: prompt ({len(seq.prompt)} tokens) + max_new_tokens "
                f"({seq.max_new_tokens}) - 1 = {length - 1} tokens exceeds max_model_len = "
                f"{self.max_model_len}; shorten the request or raise max_model_len")
        pages = self.allocator.blocks_for(seq.max_cached_tokens)
        if pages > self.allocator.num_blocks:
            raise TorchXlaExtError(
                f"request {seq.seq_id!r} needs {pages} KV-cache pages at its longest, the cache "
                f"has {self.allocator.num_blocks} in all; give the cache more pages (num_pages)")
        self.waiting.append(seq)

    def has_unfinished(self):
        return bool(self.waiting or self.running)

    def _pages_promised(self):
        """Pages the running sequences may still take."""
        return sum(self.allocator.blocks_for(s.max_cached_tokens)
                   - len(self.allocator.table(s.seq_id)) for s in self.running)

    def schedule(self):
        """This step's chunks; the pages they write are given to their sequences, their tokens
        count as computed and their sampled tokens as pending (in row order: chunk i's token
        is row i of the step's sampled tokens, chunk i's `row`)."""
        budget = self.max_num_batched_tokens
        chunks = []
        for seq in self.running:
            if budget == 0:
                break
            if seq.last_token_pending:
                continue
            n = min(seq.num_tokens - seq.num_computed, budget)
            chunks.append(_chunk(seq, n, len(chunks)))
            budget -= n
        free = self.allocator.num_free - self._pages_promised()
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            pages = self.allocator.blocks_for(seq.max_cached_tokens)
            if pages > free:
                break  # first come, first served: later requests wait behind it
            self.waiting.popleft()
            self.running.append(seq)
            free -= pages
            n = min(len(seq.prompt), budget)
            chunks.append(_chunk(seq, n, len(chunks)))
            budget -= n
        for chunk in chunks:
            self._count_scheduled(chunk)
        return chunks

    def _count_scheduled(self, chunk):
        """The chunk's pages go to its sequence, its tokens count as computed and its sampled
        token as pending."""
        self.allocator.grow(chunk.seq.seq_id, chunk.start + chunk.num_tokens)
        chunk.seq.num_computed += chunk.num_tokens
        if chunk.samples:
            chunk.seq.pending_rows.append(chunk.row)

    def runs_decodes(self, num_steps):
        """Whether the running sequences may take num_steps decode steps as one launch: every
        one has one token to run (a decode, or its prompt's last token), no request waits to
        be admitted, and one of them, at least, has num_steps tokens left to generate. Within
        the run nothing can change on the host's side but an EOS token or an abort, which
        `update` handles as for single steps (the tokens after it are dropped), so the run
        gives the tokens single steps give."""
        if self.waiting or not self.running:
            return False
        if any(seq.num_tokens - seq.num_computed != 1 for seq in self.running):
            return False
        return max(_tokens_left(seq) for seq in self.running) >= num_steps

    def schedule_decodes(self, num_steps):
        """The chunks of a run of num_steps decode steps (`runs_decodes`): a list of each
        step's chunks, and each row's steps (the first step's chunks in row order, each
        sequence's row the same in every step). A sequence with fewer tokens left than
        num_steps runs that many steps; later steps leave it out (its row idles)."""
        first = [_chunk(seq, 1, row) for row, seq in enumerate(
            s for s in self.running if not s.last_token_pending)]
        row_steps = [min(_tokens_left(c.seq), num_steps) for c in first]
        steps = []
        for step in range(num_steps):
            chunks = first if step == 0 else [
                _chunk(c.seq, 1, c.row) for c in first if row_steps[c.row] > step]
            for chunk in chunks:
                self._count_scheduled(chunk)
            steps.append(chunks)
        return steps, row_steps

    def update(self, chunks, sampled):
        """Takes the sampled tokens of a step that `schedule()` returned `chunks` for (the
        oldest step not yet updated); `sampled[chunk.row]` is the token sampled for a chunk. Returns
        the sequences that finished; their pages are free again. A token of a sequence that
        finished or was aborted since the step was scheduled is dropped."""
        finished = []
        for chunk in chunks:
            seq = chunk.seq
            token = sampled[chunk.row]
            if chunk.samples:
                seq.pending_rows.popleft()
            if not chunk.takes_token:
                continue
            seq.output.append(int(token))
            if seq.eos_token_id is not None and token == seq.eos_token_id:
                seq.finish_reason = "eos"
            elif len(seq.output) == seq.max_new_tokens:
                seq.finish_reason = "length"
            if seq.finish_reason:
                finished.append(seq)
        for seq in finished:
            self.running.remove(seq)
            self.allocator.free(seq.seq_id)
        return finished

    def abort(self, seq_id, reason="abort"):
        """Ends a waiting or running sequence now and frees its pages; returns it, or None if
        no such sequence is waiting or running. Tokens of it that steps in flight sample are
        dropped by `update`. reason: its finish_reason ("error": a step it was in failed)."""
        for queue in (self.waiting, self.running):
            for seq in queue:
                if seq.seq_id == seq_id:
                    queue.remove(seq)
                    seq.finish_reason = reason
                    self.allocator.free(seq_id)
                    return seq
        return None
