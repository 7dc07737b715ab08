"""The paged KV cache's pages, handed out to sequences: a free list and a block table per
sequence (block i of a sequence holds its tokens i * page_size ... (i + 1) * page_size - 1)."""

import collections

from torch_xla_ext.errors import TorchXlaExtError


class BlockAllocator:
    """Pages 0 ... num_blocks - 1 of the cache. A freed page goes to the back of the free list
    and is handed out again once the pages before it are gone."""

    def __init__(self, num_blocks, page_size):
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise TorchXlaExtError(f"BlockAllocator: argument 'num_blocks': expected a positive "
                                   f"integer, got {num_blocks!r}")
        if not isinstance(page_size, int) or page_size < 1:
            raise TorchXlaExtError(f"BlockAllocator: argument 'page_size': expected a positive "
                                   f"integer, got {page_size!r}")
        self.num_blocks = num_blocks
        self.page_size = page_size
        self._free = collections.deque(range(num_blocks))
        self._tables = {}  # sequence id -> [page ids], in token order

    @property
    def num_free(self):
        return len(self._free)

    def blocks_for(self, num_tokens):
        """Pages that hold num_tokens tokens."""
        return -(-num_tokens // self.page_size)

    def table(self, seq_id):
        """The sequence's block table (empty for a sequence that holds no pages)."""
        return self._tables.get(seq_id, [])

    def grow(self, seq_id, num_tokens):
        """Gives the sequence the pages it lacks to hold num_tokens tokens; returns its table."""
        table = self._tables.setdefault(seq_id, [])
        missing = self.blocks_for(num_tokens) - len(table)
        if missing > len(self._free):
            raise TorchXlaExtError(
                f"KV-cache pages exhausted: sequence {seq_id!r} needs {missing} more page(s) "
                f"for {num_tokens} tokens, {len(self._free)} of {self.num_blocks} are free. "
                "Give the cache more pages (num_pages), or admit fewer or shorter sequences at "
                "once (max_num_seqs, max_model_len)")
        table.extend(self._free.popleft() for _ in range(max(missing, 0)))
        return table

    def free(self, seq_id):
        """Returns all of the sequence's pages to the pool."""
        self._free.extend(self._tables.pop(seq_id, []))
