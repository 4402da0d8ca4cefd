"""A sequence's llama.cpp KV cache cut into spans of positions, and put back together: the prompt cache's entries
(specdec_exact.prompt_cache).

llama_state_seq_get_data writes one sequence as: a magic number, the sequence id, the number of streams, then per
stream its cell count and, where it holds cells, each cell's position and sequence ids, the V layout flag and the
number of layers, the K rows of those cells for each layer (type, row size, rows), then the V rows for each layer.
A span's entry is the K and V rows of its positions in every layer. Only the layout specdec's contexts write is
cut: flash attention (V rows, not transposed), one sequence id per cell, cells in order of position from 0;
anything else is refused (split returns None) and the prompt goes uncached.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

_HEADER = struct.Struct("<IiI")  # magic, sequence id, number of streams
_U32 = struct.Struct("<I")
_LAYERS = struct.Struct("<II")  # V transposed (0 or 1), number of layers
_SECTION = struct.Struct("<iQ")  # ggml type of the rows, bytes per row
_CELL = np.dtype([("pos", "<i4"), ("n_seq_id", "<u4"), ("seq_id", "<i4")])


@dataclass(frozen=True)
class StateFormat:
    """How one model's sequence states lay out their rows."""

    magic: int
    n_layer: int
    sections: tuple[tuple[int, int], ...]  # K of each layer, then V of each layer: (ggml type, bytes per row)

    @property
    def bytes_per_position(self) -> int:
        return sum(row for _, row in self.sections)


def split(state: bytes, spans: list[tuple[int, int]]) -> tuple[StateFormat, list[bytes]] | None:
    """Spans [start, end) of positions of a sequence state -> (its format, each span's rows: every section's rows of
    those positions, in order), or None for a state not laid out as described above or holding fewer positions."""
    view = memoryview(state)
    try:
        magic, _, n_stream = _HEADER.unpack_from(view, 0)
        offset, found = _HEADER.size, None
        for _ in range(n_stream):
            (cells,) = _U32.unpack_from(view, offset)
            offset += _U32.size
            if not cells:
                continue
            if found is not None:  # one sequence lives in one stream
                return None
            meta = np.frombuffer(view, _CELL, cells, offset)
            offset += cells * _CELL.itemsize
            if not (np.array_equal(meta["pos"], np.arange(cells)) and (meta["n_seq_id"] == 1).all()):
                return None
            v_trans, n_layer = _LAYERS.unpack_from(view, offset)
            offset += _LAYERS.size
            if v_trans:
                return None
            sections, starts = [], []
            for _ in range(2 * n_layer):
                kind, row = _SECTION.unpack_from(view, offset)
                offset += _SECTION.size
                sections.append((kind, row))
                starts.append(offset)
                offset += cells * row
            found = cells, StateFormat(magic, n_layer, tuple(sections)), starts
        if found is None or offset != len(state):
            return None
    except (struct.error, ValueError):
        return None
    cells, form, starts = found
    if any(not 0 <= first < end <= cells for first, end in spans):
        return None
    return form, [b"".join(view[start + first * row:start + end * row] for start, (_, row) in zip(starts, form.sections))
                  for first, end in spans]


def join(form: StateFormat, spans: list[bytes], n_stream: int) -> bytes:
    """A sequence state holding positions 0 .. n - 1 from consecutive spans that split() cut (the first from
    position 0), for a sequence of a context of n_stream streams (llama_state_seq_set_data puts it into whichever
    sequence it is given)."""
    lengths = [len(kv) // form.bytes_per_position for kv in spans]
    cells = sum(lengths)
    meta = np.zeros(cells, _CELL)
    meta["pos"], meta["n_seq_id"] = np.arange(cells), 1
    parts = [_HEADER.pack(form.magic, 0, n_stream), _U32.pack(cells), meta.tobytes(), _LAYERS.pack(0, form.n_layer)]
    views = [memoryview(kv) for kv in spans]
    before = 0  # bytes per position of the sections before this one
    for kind, row in form.sections:
        parts.append(_SECTION.pack(kind, row))
        parts.extend(view[before * length:(before + row) * length] for view, length in zip(views, lengths))
        before += row
    parts.extend(_U32.pack(0) for _ in range(n_stream - 1))  # the other streams hold none of it
    return b"".join(parts)
