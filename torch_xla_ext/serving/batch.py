"""A step's ragged batch as the padded int32 arrays our ops take, packed into one buffer.

The host builds one int32 buffer per step (`StepLayout` says where each array lies) and the
device receives it in one transfer; the model step slices it. Its shape depends only on the
token bucket (max_num_seqs and pages_per_seq are fixed per engine), so a step compiles once per
bucket.

The values are checked here, once per step, with the ops' own value checks (checks.py). The
ops would otherwise check them again at every call when the tensors hold data already (under
torch_xla, checks.check_known_values reads them back to the host: two reads per layer); sliced
from the step's buffer inside the graph, they are values the step computes, which the ops leave
to this check (and to the handlers).
"""

import dataclasses

import numpy as np

from torch_xla_ext import checks
from torch_xla_ext.errors import TorchXlaExtError


@dataclasses.dataclass(frozen=True)
class StepLayout:
    """Static shape of a step: num_tokens rows (the bucket), max_num_seqs sequences of at most
    pages_per_seq pages. Hashable: a jit's static argument. max_q_len 1 marks the steps of a run
    of decode steps (one row per sequence), which ragged_paged_attention's CUDA handler runs on
    its decode kernel alone (its max_q_len); 0, any step."""
    num_tokens: int
    max_num_seqs: int
    pages_per_seq: int
    max_q_len: int = 0

    @property
    def sizes(self):
        """{name: length} of the arrays in packed order."""
        t, s = self.num_tokens, self.max_num_seqs
        return {"token_ids": t, "positions": t, "slot_mapping": t, "kv_lens": s,
                "page_indices": s * self.pages_per_seq, "cu_q_lens": s + 1, "num_seqs": 1,
                "sample_rows": s}

    @property
    def size(self):
        return sum(self.sizes.values())

    def unpack(self, packed):
        """{name: slice of packed} (works on numpy arrays and torch tensors alike)."""
        arrays, offset = {}, 0
        for name, size in self.sizes.items():
            arrays[name] = packed[offset:offset + size]
            offset += size
        arrays["page_indices"] = arrays["page_indices"].reshape(self.max_num_seqs,
                                                                self.pages_per_seq)
        return arrays


def token_buckets(max_num_batched_tokens, smallest=16):
    """Powers of two from `smallest` up, ending at max_num_batched_tokens."""
    buckets, size = [], smallest
    while size < max_num_batched_tokens:
        buckets.append(size)
        size *= 2
    return buckets + [max_num_batched_tokens]


def pick_bucket(buckets, num_tokens):
    for size in buckets:
        if size >= num_tokens:
            return size
    raise TorchXlaExtError(f"a step of {num_tokens} tokens exceeds the largest token bucket "
                           f"{buckets[-1]} (max_num_batched_tokens)")


class HostBatch:
    """The packed buffers of an engine's steps, allocated once: two per token bucket, used in
    turn, so that a step may be packed while the one before it (whose buffer the device may
    still read) runs."""

    def __init__(self, buckets, max_num_seqs, pages_per_seq):
        self.layouts = {b: StepLayout(b, max_num_seqs, pages_per_seq) for b in buckets}
        self._buffers = {b: (np.zeros(layout.size, np.int32), np.zeros(layout.size, np.int32))
                         for b, layout in self.layouts.items()}
        self._turn = 0

    def pack(self, chunks, tables, bucket, page_size, num_pages, decodes_only=False):
        """(layout, packed buffer) of a step running `chunks` in the given bucket; with
        decodes_only (a run of decode steps: every chunk one token) the layout says max_q_len
        1, which the packed data's checks hold it to."""
        self._turn ^= 1
        layout = self.layouts[bucket]
        if decodes_only:
            layout = dataclasses.replace(layout, max_q_len=1)
        return layout, build(chunks, tables, layout, page_size, num_pages,
                             out=self._buffers[bucket][self._turn])


def build(chunks, tables, layout, page_size, num_pages, out=None):
    """The packed int32 buffer of a step running `chunks` (scheduler.Chunk, in row order);
    tables[i] is chunks[i]'s block table. Written into `out` (layout.size int32) when given.
    Checked as the ops would check it; a pending token (placeholder -1 - r) must name a row
    r of the previous step's sampled tokens."""
    if out is None:
        packed = np.zeros(layout.size, np.int32)
    else:
        packed = out
        packed.fill(0)
    a = layout.unpack(packed)  # views: writing them fills packed
    count = len(chunks)
    lens = np.fromiter((c.num_tokens for c in chunks), np.int64, count)
    starts = np.fromiter((c.start for c in chunks), np.int64, count)
    ends = np.cumsum(lens)  # each chunk's last row + 1
    rows = int(ends[-1]) if count else 0
    for i, table in enumerate(tables):
        a["page_indices"][i, :len(table)] = table
    # Row r of chunk i holds position starts[i] + (r - first row of i).
    positions = np.arange(rows) + np.repeat(starts - (ends - lens), lens)
    a["token_ids"][:rows] = [t for c in chunks for t in c.token_ids]
    a["positions"][:rows] = positions
    pages = a["page_indices"][np.repeat(np.arange(count), lens), positions // page_size]
    a["slot_mapping"][:rows] = pages * page_size + positions % page_size
    a["slot_mapping"][rows:] = -1  # padding rows write nothing
    a["kv_lens"][:count] = starts + lens
    a["cu_q_lens"][1:] = rows  # entries past num_seqs stay monotone
    a["cu_q_lens"][1:count + 1] = ends
    a["sample_rows"][:count] = ends - 1
    a["num_seqs"][0] = count
    if rows and a["token_ids"][:rows].min() < -layout.max_num_seqs:
        i = int(np.argmin(a["token_ids"][:rows]))
        raise TorchXlaExtError(f"step batch: argument 'token_ids': expected token ids >= 0 or "
                               f"placeholders -1 - r for rows r < max_num_seqs = "
                               f"{layout.max_num_seqs}, got token_ids[{i}] = {a['token_ids'][i]}")
    checks.slot_values("xla_ext.kv_cache_update", a["slot_mapping"], num_pages * page_size,
                       "num_pages * page_size")
    checks.ragged_values(a["kv_lens"], a["page_indices"], a["cu_q_lens"], a["num_seqs"],
                         layout.num_tokens, page_size, num_pages, layout.max_q_len)
    return packed
