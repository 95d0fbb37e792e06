"""Samples moved under `move="send"` travel as frames with their arrays out of band, copied once on the sending
rank and viewed in place on the receiving one (NOTE [ Sending samples without copies ] in odb_core/ranks/moves.py).

The frames must give the very samples the in-band pickle of the old path gave (type, dtype, shape, strides and
values of every tensor and array, packed or nested, contiguous or not), an unpicklable sample must still be named
by its index, and `GlooTransport._all_to_all_bytes` must still carry any bytes-like chunk, the empty one included,
between real Gloo ranks, with the same byte accounting.
"""

from __future__ import annotations

import json
import os
import pickle
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from dist_cases import free_port

from odb_core import PeerError, SampleError
from odb_core.data.sendable import pack_sample, unpack_sample
from odb_core.planning.budget import Item
from odb_core.ranks.moves import ALIGN, SendMoves, decode_samples, encode_samples, pickle_samples
from odb_core.ranks.sync import GlooTransport, LocalTransport


def _read_only(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False  # its out-of-band buffer is read-only: frame_of copies it before the cat
    return array


def _samples() -> list[dict]:
    base = torch.arange(48, dtype=torch.float32).reshape(6, 8)
    return [{"pixel_values": torch.randn(64, 32), "input_ids": torch.arange(9), "labels": torch.arange(9) - 1,
             "transposed": base.t(), "strided": base[:, ::3], "offset": base[2:], "half": torch.ones(5).half(),
             "mask": torch.tensor([True, False]), "scalar": torch.tensor(3.5), "empty": torch.zeros(0, 4),
             "bf16": torch.ones(3, dtype=torch.bfloat16), "array": np.arange(12.0).reshape(3, 4),
             "fortran": np.asfortranarray(np.arange(12).reshape(3, 4)), "nested": [torch.arange(4), np.ones(2)],
             "text": "a cat", "n": 7, "none": None, "frozen": _read_only(np.arange(6.0))},
            {"input_ids": torch.arange(3)}, ["a list", torch.arange(2)]]


def _in_band(samples: list) -> list:
    """What the old path gave: one in-band pickle of the packed samples, unpacked."""
    packed = [pack_sample(s, limit_bytes=None) for s in samples]
    return [unpack_sample(s) for s in pickle.loads(pickle.dumps(packed, protocol=pickle.HIGHEST_PROTOCOL))]


def _assert_same(got, want, where: str = "sample") -> None:
    assert type(got) is type(want), where
    if isinstance(want, dict | list):
        items = want.items() if isinstance(want, dict) else enumerate(want)
        assert len(got) == len(want), where
        for key, value in items:
            _assert_same(got[key], value, f"{where}[{key!r}]")
    elif isinstance(want, torch.Tensor):
        assert (got.dtype, got.shape, got.stride()) == (want.dtype, want.shape, want.stride()), where
        assert torch.equal(got, want), where
    elif isinstance(want, np.ndarray):
        assert (got.dtype, got.shape, got.strides) == (want.dtype, want.shape, want.strides), where
        assert np.array_equal(got, want), where
    else:
        assert got == want, where


def test_frames_give_the_samples_the_in_band_pickle_gave():
    samples = _samples()
    frame = encode_samples([pack_sample(s, limit_bytes=None) for s in samples])
    _assert_same([unpack_sample(s) for s in decode_samples(frame)], _in_band(samples))


def test_received_arrays_are_aligned_writable_views_into_the_frame():
    frame = encode_samples([pack_sample(s, limit_bytes=None) for s in _samples()[:1]])
    received = unpack_sample(decode_samples(frame)[0])
    pixels = received["pixel_values"]
    start = np.frombuffer(frame, dtype=np.uint8).ctypes.data
    assert start <= pixels.data_ptr() < start + len(frame)  # a view, not a copy
    assert (pixels.data_ptr() - start) % ALIGN == 0
    pixels += 1  # writable, as the old path's were (no "non-writable NumPy array" warning either)
    assert len(frame) < pixels.nbytes + received["input_ids"].nbytes * 4 + 4096


def test_a_frame_is_written_into_uninitialised_memory_with_zeroed_gaps():
    """The frame is a uint8 array whose alignment gaps are written as zeros (not left as whatever the memory held),
    so two encodings of the same samples are the same bytes."""
    samples = [pack_sample(s, limit_bytes=None) for s in _samples()]
    first, second = encode_samples(samples), encode_samples(samples)
    assert isinstance(first, np.ndarray) and first.dtype == np.uint8 and first.ndim == 1
    assert np.array_equal(first, second)
    header = np.frombuffer(first[:16].tobytes(), dtype="<i8")
    sizes = np.frombuffer(first[16 : 16 + 8 * int(header[0])].tobytes(), dtype="<i8").tolist()
    pieces = [16 + 8 * int(header[0]), int(header[1]), *sizes]
    start, gaps = 0, 0
    for size in pieces:  # each piece starts at a multiple of ALIGN; the bytes up to the next one are zeros
        end = start + -(-size // ALIGN) * ALIGN
        assert not first[start + size : end].any()
        start, gaps = end, gaps + end - start - size
    assert start == len(first) and gaps > 0


class _Peer:
    """A transport stand-in for SendMoves' error path: the exchange must fail before any collective."""

    rank, world_size = 0, 2

    def all_to_all_bytes(self, chunks):  # pragma: no cover - reaching it is the failure
        raise AssertionError("an unpicklable sample reached the transport")


def test_an_unpicklable_sample_is_named_by_its_index_before_anything_is_sent():
    plan = SimpleNamespace(steps=[[None, SimpleNamespace(items=[Item(4, 5, owner=0), Item(9, 5, owner=0)])]])
    own = {4: {"input_ids": torch.arange(5)}, 9: {"input_ids": torch.arange(5), "guard": threading.Lock()}}
    with pytest.raises(SampleError, match=r"^sample 9: field 'guard' .* cannot move from rank 0 to rank 1"):
        SendMoves(_Peer()).exchange(plan, own.pop)  # rank 1 runs two of rank 0's


def _chunk(sender: int, dest: int) -> bytes | bytearray | memoryview | np.ndarray:
    """What `sender` sends `dest`: each kind of bytes-like chunk (a frame is a numpy uint8 array), the empty one
    included, over the pairs."""
    kind = (sender + 2 * dest) % 5
    data = bytes([16 * sender + dest]) * (0, 70_001, 1 << 20, 6, 300_007)[kind]
    as_array = lambda d: np.frombuffer(bytearray(d), dtype=np.uint8)
    return (bytes, bytearray, lambda d: memoryview(bytearray(d)), bytes, as_array)[kind](data)


def _gloo_rank(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    transport = GlooTransport(timeout_s=60)
    chunks = [_chunk(rank, dest) for dest in range(world)]
    received = transport.all_to_all_bytes(chunks)
    assert all(isinstance(got, bytearray) for got in received), [type(got) for got in received]
    assert [bytes(got) for got in received] == [bytes(_chunk(sender, rank)) for sender in range(world)]
    assert transport.stats.bytes_sent == sum(len(c) for dest, c in enumerate(chunks) if dest != rank)
    assert transport.stats.bytes_received == sum(len(got) for sender, got in enumerate(received) if sender != rank)
    transport.close()
    dist.destroy_process_group()


def test_gloo_all_to_all_bytes_carries_any_bytes_like_chunk_into_bytearrays():
    mp.spawn(_gloo_rank, args=(4, free_port()), nprocs=4)


def test_the_local_transport_still_hands_chunks_back():
    assert LocalTransport().all_to_all_bytes([b"abc"]) == [b"abc"]


def _peer_dies_mid_move(rank: int, port: int, timeout_s: float, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    transport = GlooTransport(timeout_s=timeout_s)
    if rank == 1:  # agrees on the sizes, then dies before any byte of the samples moves
        incoming = torch.empty(2, dtype=torch.int64)
        dist.all_to_all_single(incoming, torch.tensor([1 << 20, 0]), group=transport.group)
        time.sleep(0.5)
        os._exit(0)
    start = time.monotonic()
    try:
        transport.all_to_all_bytes([b"", bytearray(1 << 20)])
        message = "returned"
    except PeerError as exc:
        message = str(exc)
    Path(out).write_text(json.dumps({"message": message, "seconds": time.monotonic() - start}))
    os._exit(0)


def test_a_peer_dying_mid_move_raises_peer_error_within_the_timeout(tmp_path):
    timeout_s = 8.0
    out = tmp_path / "rank0.json"
    mp.spawn(_peer_dies_mid_move, args=(free_port(), timeout_s, str(out)), nprocs=2)
    got = json.loads(out.read_text())
    assert got["message"].startswith("rank 0: ODB metadata all_to_all failed"), got
    assert got["seconds"] <= timeout_s + 2.0, got


def test_the_writers_of_the_frame_benchmark_write_the_same_bytes():
    """`python -m benchmarks.frame_gil` times the writers before and after against each other: same frames."""
    from benchmarks.frame_gil import WRITERS

    samples = _samples()
    frames = [bytes(np.asarray(write(pickle_samples([pack_sample(s, limit_bytes=None) for s in samples]))))
              for write in WRITERS.values()]
    assert len(frames) == 3 and frames[0] == frames[1] == frames[2]
