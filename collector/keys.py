"""Group keys of aggregate-tree nodes packed into one binary value (the spool's ``key`` column).

A node's key is its group-by fields and the query-bit pattern of its row. The Spark HFTA groups
by ``(window_start, node, key)`` only: one binary column instead of every groupable field, so
its hash and its state stay small whatever the node. The layout, named by the ``node`` label
``"<field>,<field>…#<pattern words>"`` (fields sorted), is little-endian int64 words:

- each integer field: its value (negative when the tuple has none: NULL);
- each address: validity, then the two 64-bit halves of the 16-byte (IPv4-mapped) address;
- a string field (at most one, ``dns_qname``): its validity; its bytes follow everything else;
- the query-bit pattern (``pattern words`` words; bit ``i`` of word ``w`` is slot ``64·w + i``).

A label may also name one field that is not packed: ``~f``, the row's ``hll`` column holds a
sketch of f.

Packing and unpacking are vectorised (numpy over Arrow buffers): no per-row Python on either side.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from capture.batch import ip_arrow
from capture.fields import CODE, IP, SKETCH, STRING, code_texts, fields, key_field


def _binary(data: np.ndarray, offsets: np.ndarray) -> pa.Array:
    """A binary array over bytes ``data`` cut at ``offsets`` (n + 1)."""
    return pa.Array.from_buffers(pa.binary(), len(offsets) - 1,
                                 [None, pa.py_buffer(offsets.astype(np.int32).tobytes()),
                                  pa.py_buffer(np.ascontiguousarray(data).tobytes())])


def binary_buffers(arr: pa.Array | pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    """(offsets as int64, data bytes) of a binary or string array."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    n = len(arr)
    offsets = np.frombuffer(arr.buffers()[1], np.int32, n + 1, arr.offset * 4).astype(np.int64)
    data = arr.buffers()[2]
    return offsets, (np.frombuffer(data, np.uint8) if data is not None else
                     np.zeros(0, np.uint8))


def _tails(off: np.ndarray, data: np.ndarray, width: int) -> pa.Array:
    """The bytes after the first ``width`` of each value, as strings."""
    lens = np.diff(off) - width
    new = np.zeros(len(lens) + 1, np.int64)
    np.cumsum(lens, out=new[1:])
    at = np.repeat(off[:-1] + width - new[:-1], lens) + np.arange(new[-1])
    return pa.Array.from_buffers(pa.string(), len(lens),
                                 [None, pa.py_buffer(new.astype(np.int32).tobytes()),
                                  pa.py_buffer(data[at].tobytes())])


def pattern_counts(stream: str, rows: pa.Table | pa.RecordBatch) -> dict[tuple[str, bytes], int]:
    """How many partial ``rows`` (``node``, ``key``) have each (node layout, query-bit
    pattern): the pattern's bytes cut from each packed key by its row's layout (rows of no
    layout, punctuation, are left out). A batch of one layout of fixed-width keys, as the
    LFTA writes a node's rows, is counted as numpy words (filtering the binary keys per
    layout cost 0.6 µs a row, 8 % of reading the backbone bench's capture)."""
    out: dict[tuple[str, bytes], int] = {}

    def add(label: str, patterns: list[bytes], counts) -> None:
        for pat, n in zip(patterns, counts, strict=True):
            out[(label, pat)] = out.get((label, pat), 0) + int(n)

    batches = rows.to_batches() if isinstance(rows, pa.Table) else [rows]
    for batch in batches:
        nodes, keys = batch.column("node"), batch.column("key")
        named = pc.unique(nodes).to_pylist()
        labels = [x for x in named if x]
        if len(named) == 1 and labels and nodes.null_count == 0 and keys.null_count == 0:
            lay = KeyLayout.parse(stream, labels[0])
            off, data = binary_buffers(keys)
            width, n = 8 * lay.words, len(keys)
            if lay.string is None and off[-1] - off[0] == n * width:
                words = data[off[0]:off[-1]].view(np.uint64).reshape(n, lay.words)
                pats = words[:, lay.field_words:]
                if lay.q_words == 1:  # a sort of integers, not of rows
                    one, counts = np.unique(pats[:, 0], return_counts=True)
                    pats = one[:, None]
                else:
                    pats, counts = np.unique(pats, axis=0, return_counts=True)
                add(labels[0], [p.astype("<u8").tobytes() for p in pats], counts)
                continue
        for label in labels:
            lay = KeyLayout.parse(stream, label)
            mine = pc.filter(keys, pc.equal(nodes, label))
            counted = pc.value_counts(pc.binary_slice(mine, 8 * lay.field_words,
                                                      8 * lay.words))
            add(label, counted.field("values").to_pylist(), counted.field("counts").to_pylist())
    return out


class KeyLayout:
    """The packing of one node's key (see the module docstring)."""

    def __init__(self, stream: str, keys, q_words: int):
        cat = fields(stream)
        self.stream = stream
        named = tuple(sorted(keys))
        # a sketch key (~dst_ip) is named in the label but not packed: the row's ``hll``
        # column holds it (at most one per node)
        carried = [k for k in named if k[:1] == SKETCH]
        if len(carried) > 1:
            raise ValueError(f"a node carries at most one sketch, not {carried}")
        self.sketch = carried[0] if carried else None
        self.keys = tuple(k for k in named if k[:1] != SKETCH)
        self.kinds = [cat[key_field(k)[0]].kind for k in self.keys]  # src_ip/24: an address
        strings = [k for k, kind in zip(self.keys, self.kinds, strict=True) if kind == STRING]
        if len(strings) > 1:
            raise ValueError(f"a node groups by at most one string field, not {strings}")
        self.string = strings[0] if strings else None
        self.q_words = q_words
        self.field_words = sum(3 if k == IP else 1 for k in self.kinds)
        self.words = self.field_words + q_words  # fixed words: fields, then the pattern
        self.label = f"{','.join(named)}#{q_words}"

    @staticmethod
    @lru_cache(maxsize=1024)
    def parse(stream: str, label: str) -> KeyLayout:
        keys, _, words = label.rpartition("#")
        return KeyLayout(stream, tuple(k for k in keys.split(",") if k), int(words))

    def table_keys(self) -> tuple[str, ...]:
        """The fields an LFTA table of this node keys on: the packed keys and the sketched
        field (its rows are merged per packed key, each with the field's sketch, on flush)."""
        if self.sketch is None:
            return self.keys
        return tuple(sorted({*self.keys, self.sketch[1:]}))

    def offsets(self) -> dict[str, tuple[int, int]]:
        """Each packed key's (first word, words) among the field words."""
        out, c = {}, 0
        for name, kind in zip(self.keys, self.kinds, strict=True):
            w = 3 if kind == IP else 1
            out[name] = (c, w)
            c += w
        return out

    # -- packing (capture side)
    def field_words_of(self, tb, rows: np.ndarray) -> np.ndarray:
        """The key fields of a batch's ``rows`` as (rows, field_words) int64."""
        out = np.empty((len(rows), self.field_words), np.int64)
        c = 0
        for name, kind in zip(self.keys, self.kinds, strict=True):
            if kind == IP:
                valid = tb.ip_valid(name)[rows]
                words = np.ascontiguousarray(tb.column(name)[rows]).view(">i8").reshape(-1, 2)
                out[:, c] = valid
                out[:, c + 1] = np.where(valid, words[:, 0], 0)
                out[:, c + 2] = np.where(valid, words[:, 1], 0)
                c += 3
            elif kind == STRING:
                out[:, c] = tb.arrow(name).take(pa.array(rows)).is_valid().to_numpy(
                    zero_copy_only=False)
                c += 1
            else:
                out[:, c] = tb.column(name)[rows]
                c += 1
        return out

    def strings_of(self, tb, rows: np.ndarray) -> pa.Array | None:
        """The string key of a batch's ``rows`` (None when the node has none)."""
        if self.string is None:
            return None
        return tb.arrow(self.string).take(pa.array(rows))

    def encode(self, words: np.ndarray, strings: pa.Array | None = None) -> pa.Array:
        """Binary keys from (rows, words) int64 (fields then pattern) and the string key."""
        n = len(words)
        fixed = np.ascontiguousarray(words, dtype="<i8").view(np.uint8).reshape(n, -1)
        width = fixed.shape[1]
        if strings is None:
            return _binary(fixed.reshape(-1), np.arange(0, (n + 1) * width, width))
        s_off, s_data = binary_buffers(pc.fill_null(strings, ""))
        lens = width + np.diff(s_off)
        off = np.zeros(n + 1, np.int64)
        np.cumsum(lens, out=off[1:])
        out = np.empty(int(off[-1]), np.uint8)
        out[(off[:-1, None] + np.arange(width)).reshape(-1)] = fixed.reshape(-1)
        row = np.repeat(np.arange(n), np.diff(s_off))
        at = np.arange(s_off[0], s_off[-1])
        out[off[row] + width + at - s_off[row]] = s_data[at]
        return _binary(out, off)

    # -- unpacking (the HFTA's fan-out, on Spark's executors)
    def decode(self, key: pa.Array) -> tuple[dict[str, pa.Array], np.ndarray]:
        """Key columns (catalogue types, NULL where missing) and the pattern words
        (rows × q_words, uint64) of binary keys."""
        off, data = binary_buffers(key)
        n = len(off) - 1
        width = self.words * 8
        if self.string is None and off[0] == 0 and (np.diff(off) == width).all():
            fixed = data[:n * width].reshape(n, width)  # every key one width: a view
        else:
            at = np.minimum(off[:-1], max(len(data) - width, 0))
            fixed = data[at[:, None] + np.arange(width)] if n else np.zeros((0, width),
                                                                           np.uint8)
        words = np.ascontiguousarray(fixed).view("<i8").reshape(n, self.words)
        cat = fields(self.stream)
        cols: dict[str, pa.Array] = {}
        c = 0
        for name, kind in zip(self.keys, self.kinds, strict=True):
            if kind == IP:
                raw = np.ascontiguousarray(words[:, c + 1:c + 3]).astype(">i8")
                cols[name] = ip_arrow(raw.view(np.uint8).reshape(n, 16), words[:, c] != 0)
                c += 3
            elif kind == STRING:
                valid = words[:, c] != 0
                cols[name] = pc.if_else(pa.array(valid), _tails(off, data, width),
                                        pa.scalar(None, pa.string()))
                c += 1
            else:
                v = words[:, c]
                if kind == CODE and cat[name].codec == "letters":
                    cols[name] = code_texts(v)
                else:  # a text code stays a code until the answer (derive.answer_of_group)
                    cols[name] = pa.array(v, pa.int64() if kind == CODE else
                                          cat[name].arrow_type, mask=v < 0)
                c += 1
        return cols, words[:, c:].view(np.uint64)
