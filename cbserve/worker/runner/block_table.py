"""The worker's block tables as one persistent int32 array: a row per request it holds, updated by diffs.

vLLM V1's ``BlockTable``, kept small. A request gets a row when it arrives (``NewRequestData``), its new block
ids are appended as ``CachedRequestData`` brings them, speculative decoding's rollback truncates it (the only
place a table shrinks), and the row is freed when the request finishes or is preempted. A step's padded
``block_tables`` are then one gather of the step's rows instead of a list of lists rebuilt every step. Past
each row's length the array holds zeros (backends and CUDA graphs may read the padding). Rows and columns
grow on demand (beams and forks may hold more sequences than ``max_num_seqs``; a long request more blocks).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np


class BlockTable:
    """``blocks[row, :lens[row]]`` is the block table of the request in ``row``; zeros past it."""

    def __init__(self, num_rows: int = 8, num_cols: int = 16) -> None:
        if num_rows < 1 or num_cols < 1:
            raise ValueError(f"a block table needs at least one row and column, got {num_rows} x {num_cols}")
        self.blocks = np.zeros((num_rows, num_cols), dtype=np.int32)
        self.lens = np.zeros(num_rows, dtype=np.int64)
        self.row_of: dict[str, int] = {}
        self._free = list(range(num_rows - 1, -1, -1))  # popped from the end: lowest row first

    @classmethod
    def of(cls, tables: Sequence[tuple[str, Sequence[int]]]) -> BlockTable:
        """A table holding ``tables`` (request id, block ids) in rows 0.. (for batches built without a runner)."""
        table = cls(max(1, len(tables)), max(1, max((len(b) for _, b in tables), default=1)))
        for req_id, block_ids in tables:
            table.add(req_id, block_ids)
        return table

    def __contains__(self, req_id: str) -> bool:
        return req_id in self.row_of

    def __len__(self) -> int:
        return len(self.row_of)

    def row(self, req_id: str) -> list[int]:
        """The block ids of ``req_id`` (a copy)."""
        r = self.row_of[req_id]
        return self.blocks[r, : self.lens[r]].tolist()

    def add(self, req_id: str, block_ids: Sequence[int]) -> None:
        """A request arrives with its whole table (a request id already held is replaced)."""
        self.remove(req_id)
        if not self._free:
            self._grow_rows(2 * self.blocks.shape[0])
        r = self._free.pop()
        self.row_of[req_id] = r
        self._write(r, 0, block_ids)

    def append(self, req_id: str, block_ids: Sequence[int]) -> None:
        """New blocks at the end of ``req_id``'s table."""
        if block_ids:
            r = self.row_of[req_id]
            self._write(r, int(self.lens[r]), block_ids)

    def update(self, gone: Iterable[str], new: Iterable[tuple[str, Sequence[int]]],
               grown: Iterable[tuple[str, Sequence[int]]]) -> None:
        """A step's changes in one call: the rows of ``gone`` freed, then ``new`` requests' whole tables added and
        ``grown`` ones' new blocks appended ((request id, block ids) pairs)."""
        for req_id in gone:
            self.remove(req_id)
        for req_id, block_ids in new:
            self.add(req_id, block_ids)
        for req_id, block_ids in grown:
            self.append(req_id, block_ids)

    def truncate(self, req_id: str, num_blocks: int) -> None:
        """Keep the first ``num_blocks`` blocks of ``req_id`` (speculative decoding's rollback)."""
        r = self.row_of[req_id]
        n = int(self.lens[r])
        if num_blocks < n:
            self.blocks[r, max(0, num_blocks) : n] = 0
            self.lens[r] = max(0, num_blocks)

    def remove(self, req_id: str) -> None:
        """Free ``req_id``'s row (zeroed for its next owner); a request not held is ignored."""
        r = self.row_of.pop(req_id, None)
        if r is not None:
            self.blocks[r, : self.lens[r]] = 0
            self.lens[r] = 0
            self._free.append(r)

    def gather(self, rows: np.ndarray, num_cols: int) -> np.ndarray:
        """The padded ``[len(rows), num_cols]`` table of ``rows`` (a new array)."""
        if num_cols > self.blocks.shape[1]:
            self._grow_cols(num_cols)
        return self.blocks[rows, :num_cols]

    def _write(self, r: int, at: int, block_ids: Sequence[int]) -> None:
        end = at + len(block_ids)
        if end > self.blocks.shape[1]:
            self._grow_cols(max(end, 2 * self.blocks.shape[1]))
        self.blocks[r, at:end] = block_ids
        self.lens[r] = end

    def _grow_rows(self, num_rows: int) -> None:
        old = self.blocks.shape[0]
        self.blocks = np.concatenate([self.blocks, np.zeros((num_rows - old, self.blocks.shape[1]), np.int32)])
        self.lens = np.concatenate([self.lens, np.zeros(num_rows - old, np.int64)])
        self._free.extend(range(num_rows - 1, old - 1, -1))

    def _grow_cols(self, num_cols: int) -> None:
        wider = np.zeros((self.blocks.shape[0], num_cols), np.int32)
        wider[:, : self.blocks.shape[1]] = self.blocks
        self.blocks = wider
