"""``pipelines.objectstore``'s reader for DuckDB: a file several threads read at once through one handle."""

from __future__ import annotations

import os
import threading

import pyarrow.fs as pafs

from pipelines.objectstore import PositionalReader


def _reader(tmp_path, data: bytes) -> PositionalReader:
    path = tmp_path / "blob"
    path.write_bytes(data)
    return PositionalReader(pafs.LocalFileSystem().open_input_file(str(path)))


def test_each_thread_reads_from_where_it_sought_however_the_seeks_interleave(tmp_path):
    """DuckDB's positional read through a Python filesystem is a seek then a read: two threads' pairs
    interleaved (A seeks, B seeks, A reads, B reads, forced by barriers) each get their own bytes; on one
    shared position A would read B's."""
    data = bytes(range(256)) * 64
    reader = _reader(tmp_path, data)
    step = [threading.Barrier(2) for _ in range(3)]
    got: dict[str, bytes] = {}

    def a() -> None:
        reader.seek(10)
        step[0].wait()  # B seeks now
        step[1].wait()
        got["a"] = reader.read(16)
        step[2].wait()

    def b() -> None:
        step[0].wait()
        reader.seek(5000)
        step[1].wait()  # A reads now
        step[2].wait()
        got["b"] = reader.read(16)

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == {"a": data[10:26], "b": data[5000:5016]}


def test_it_reads_as_a_file_does(tmp_path):
    data = b"0123456789" * 10
    with _reader(tmp_path, data) as reader:
        assert (reader.readable(), reader.seekable(), reader.writable(), reader.size) == (True, True, False, 100)
        assert reader.read(4) == b"0123" and reader.tell() == 4
        assert reader.seek(2, os.SEEK_CUR) == 6 and reader.read(3) == b"678"
        assert reader.seek(-5, os.SEEK_END) == 95 and reader.read() == b"56789"
        assert reader.read(10) == b"" and reader.tell() == 100  # at the end: nothing more
        reader.seek(98)
        assert reader.read(10) == b"89"  # a read past the end stops there
    assert reader.closed
