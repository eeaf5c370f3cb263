"""Views of handles on a GPU device tier (kvtier.cuda), on a machine without one: the CPU twin.

A daemon with a GPU lists a device segment with a cuda_ipc_handle and keeps its generation
table and stamp in a host shared-memory file. Here the listing is made by a fake daemon (the
same messages), the table is a real /dev/shm file, and "device memory" is host memory that a
fake CUDA runtime hands out for each IPC handle, so that every pointer the views give can be
read back and compared with the bytes put there. The GPU test at the end runs only where CUDA
does."""
import ctypes
import os
import subprocess
import sys

import grpc
import numpy as np
import pytest

import kvtier
from kvtier import cuda
from kvtier.v1 import kvtier_pb2 as pb

D, N = 64, 16  # head_dim, tokens per slot
SLOT = 2 * N * D * 2  # K then V, fp16
SLOTS = 4


class FakeRuntime:
    """Device memory as host buffers, one per IPC handle: open gives the buffer's address."""

    def __init__(self, memory: dict[bytes, np.ndarray], device: int = 3):
        self.memory, self.device = memory, device
        self.opened: list[bytes] = []
        self.closed: list[int] = []

    def open(self, handle: bytes):
        self.opened.append(handle)
        if handle not in self.memory:
            raise OSError("cudaIpcOpenMemHandle: cudaErrorInvalidValue")
        return self.memory[handle].ctypes.data, self.device

    def close(self, ptr: int):
        self.closed.append(ptr)


class FakeDaemon:
    """What SegmentMap asks of a client: ListSegments over one GPU segment whose host file
    (generation table, then stamp) is real."""

    def __init__(self, tmp_name: str):
        self.name = tmp_name
        self.path = "/dev/shm/" + tmp_name
        self.listed = True
        self.publish(segment_id=7, stamp=0x1111, handle=b"A" * 64, generations=[5, 6, 0, 0])

    def publish(self, segment_id, stamp, handle, generations):
        """The segment as a (re)started daemon makes it: table, stamp, listing."""
        self.table_offset, self.stamp_offset = 0, 8 * SLOTS
        if os.path.exists(self.path):
            os.unlink(self.path)  # a new file, as a new daemon makes: old mappings keep theirs
        with open(self.path, "wb") as f:
            f.write(np.array(generations, dtype="<u8").tobytes())
            f.write(stamp.to_bytes(8, "little"))
        self.seg = pb.Segment(segment_id=segment_id, tier=pb.TIER_DEVICE, shm_name=self.name,
                              cuda_ipc_handle=handle, size_bytes=SLOTS * SLOT, device=0,
                              slot_bytes=SLOT, generation_table_offset=self.table_offset,
                              stamp_offset=self.stamp_offset, stamp=stamp)

    def set_generation(self, slot, generation):
        with open(self.path, "r+b") as f:
            f.seek(self.table_offset + 8 * slot)
            f.write(generation.to_bytes(8, "little"))

    def list_segments(self):
        return [self.seg] if self.listed else []

    def open_segments(self, ids):
        raise AssertionError("the segment is opened by name here")


def handle(slot, generation, num_tokens=N, segment_id=7):
    return pb.BlockHandle(chunk_id=100 + slot, segment_id=segment_id, offset=slot * SLOT,
                          length=4 * num_tokens * D, num_tokens=num_tokens, generation=generation,
                          tier=pb.TIER_DEVICE)


def read(a: cuda.CudaArray) -> np.ndarray:
    """What a kernel would read at a view's pointer: rows x cols halves."""
    buf = (ctypes.c_char * (a.rows * a.cols * 2)).from_address(a.ptr)
    return np.frombuffer(bytes(buf), dtype=np.float16).reshape(a.rows, a.cols)


@pytest.fixture
def gpu_segment():
    name = f"kvtier-cuda-twin-{os.getpid()}"
    daemon = FakeDaemon(name)
    rng = np.random.default_rng(3)
    first = rng.standard_normal(SLOTS * SLOT // 2).astype(np.float16)
    second = rng.standard_normal(SLOTS * SLOT // 2).astype(np.float16)
    runtime = FakeRuntime({b"A" * 64: first, b"B" * 64: second})
    yield daemon, runtime, first, second
    os.unlink(daemon.path)


def test_views_point_at_the_handles_rows_in_the_opened_allocation(gpu_segment):
    daemon, runtime, first, _ = gpu_segment
    seg = kvtier.SegmentMap(daemon, cuda=runtime)
    for slot, gen in ((0, 5), (1, 6)):
        k, v = seg.view(handle(slot, gen), D, like="cuda")
        assert isinstance(k, cuda.CudaArray) and k.device == runtime.device
        iface = k.__cuda_array_interface__
        assert iface["shape"] == (N, D) and iface["typestr"] == "<f2"
        assert iface["data"] == (first.ctypes.data + slot * SLOT, True)  # read-only
        rows = first[slot * SLOT // 2:(slot + 1) * SLOT // 2]
        np.testing.assert_array_equal(read(k), rows[:N * D].reshape(N, D))
        np.testing.assert_array_equal(read(v), rows[N * D:].reshape(N, D))
        seg.check(handle(slot, gen))  # after reading: the slot still holds the chunk
    # A partial chunk: V right after its own K rows.
    k, v = seg.view(handle(1, 6, num_tokens=3), D, like="cuda")
    np.testing.assert_array_equal(read(v).reshape(-1), first[SLOT // 2 + 3 * D:SLOT // 2 + 6 * D])
    assert runtime.opened == [b"A" * 64]  # once per segment


def test_a_stale_or_misfit_handle_is_refused_before_any_pointer_is_made(gpu_segment):
    daemon, runtime, _, _ = gpu_segment
    seg = kvtier.SegmentMap(daemon, cuda=runtime)
    with pytest.raises(kvtier.KvTierError) as e:
        seg.view(handle(2, 9), D, like="cuda")  # a freed slot
    assert e.value.code == grpc.StatusCode.ABORTED and "nothing (freed)" in e.value.message
    daemon.set_generation(0, 8)  # reused for another chunk
    with pytest.raises(kvtier.KvTierError) as e:
        seg.view(handle(0, 5), D, like="cuda")
    assert e.value.code == grpc.StatusCode.ABORTED and "generation 8" in e.value.message
    assert runtime.opened == []
    bad = handle(1, 6)
    bad.length += 4
    with pytest.raises(kvtier.KvTierError) as e:
        seg.view(bad, D, like="cuda")
    assert e.value.code == grpc.StatusCode.OUT_OF_RANGE
    with pytest.raises(kvtier.KvTierArgumentError, match="like: segment 7 is GPU memory"):
        seg.view(handle(1, 6), D, like="numpy")
    with pytest.raises(kvtier.KvTierError, match="memory of CUDA device 0"):
        seg.halves(7)
    with pytest.raises(kvtier.KvTierArgumentError, match="like: 'jax' is not one of"):
        seg.view(handle(1, 6), D, like="jax")
    daemon.seg.cuda_ipc_handle = b"short"
    fresh = kvtier.SegmentMap(daemon, cuda=runtime)
    with pytest.raises(kvtier.KvTierError, match="cuda_ipc_handle of 5 bytes, not 64"):
        fresh.view(handle(1, 6), D, like="cuda")


def test_a_restarted_daemons_segment_is_opened_anew_and_the_old_allocation_set_aside(gpu_segment):
    """The old allocation is not closed under views that may still be read (another thread's,
    a kernel queued): prune closes it."""
    daemon, runtime, first, second = gpu_segment
    seg = kvtier.SegmentMap(daemon, cuda=runtime)
    old, _ = seg.view(handle(0, 5), D, like="cuda")
    # The daemon restarts: the same segment id, another stamp, allocation and generations.
    daemon.publish(segment_id=7, stamp=0x2222, handle=b"B" * 64, generations=[0, 0, 41, 0])
    k, _ = seg.view(handle(2, 41), D, like="cuda")
    assert runtime.closed == []
    np.testing.assert_array_equal(read(old).reshape(-1), first[:N * D])  # still readable
    assert runtime.opened == [b"A" * 64, b"B" * 64]
    assert seg.prune() == 1 and runtime.closed == [first.ctypes.data]
    np.testing.assert_array_equal(read(k).reshape(-1), second[SLOT:SLOT + N * D])
    # The old handle is never read through the new mapping.
    with pytest.raises(kvtier.KvTierError) as e:
        seg.view(handle(0, 5), D, like="cuda")
    assert e.value.code == grpc.StatusCode.ABORTED


def test_prune_and_close_end_the_allocations(gpu_segment):
    daemon, runtime, first, _ = gpu_segment
    seg = kvtier.SegmentMap(daemon, cuda=runtime)
    seg.view(handle(0, 5), D, like="cuda")
    assert seg.prune() == 0  # still listed with its stamp
    daemon.listed = False  # retired
    assert seg.prune() == 1 and runtime.closed == [first.ctypes.data]
    assert seg.prune() == 0
    daemon.listed = True
    seg.view(handle(0, 5), D, like="cuda")
    seg.close()
    assert runtime.closed == [first.ctypes.data] * 2


def test_an_allocation_that_will_not_open_is_unavailable_naming_the_segment(gpu_segment):
    daemon, _, _, _ = gpu_segment
    seg = kvtier.SegmentMap(daemon, cuda=FakeRuntime({}))
    with pytest.raises(kvtier.KvTierError) as e:
        seg.view(handle(0, 5), D, like="cuda")
    assert e.value.code == grpc.StatusCode.UNAVAILABLE
    assert "segment 7: cudaIpcOpenMemHandle: cudaErrorInvalidValue" in e.value.message


def test_the_real_runtime_without_a_usable_gpu_is_an_error_naming_what_is_missing(gpu_segment):
    """Here: libcudart (PyTorch's CUDA build ships it) loads, and finds no driver or device;
    without any CUDA library the error names `like`. Never a crash or a pointer."""
    daemon, _, _, _ = gpu_segment
    if _cuda_device_count() > 0:
        pytest.skip("a CUDA device is here: the GPU test below reads real memory")
    seg = kvtier.SegmentMap(daemon)  # the default runtime: CuPy's, else libcudart by ctypes
    with pytest.raises(kvtier.KvTierError) as e:
        seg.view(handle(0, 5), D, like="cuda")
    if e.value.code == grpc.StatusCode.INVALID_ARGUMENT:
        assert e.value.message.startswith("like: views of GPU segments need CUDA")
    else:
        assert e.value.code == grpc.StatusCode.UNAVAILABLE
        assert e.value.message.startswith("segment 7: ")


def _cuda_device_count() -> int:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount()
    except Exception:  # noqa: BLE001 (no CuPy, no driver, no device)
        return 0


_EXPORTER = """
import sys, cupy, numpy as np
a = cupy.arange(2 * 16 * 64, dtype=cupy.float16)
sys.stdout.buffer.write(bytes(cupy.cuda.runtime.ipcGetMemHandle(a.data.ptr)))
sys.stdout.flush()
sys.stdin.read()  # keeps the allocation until the reader is done
"""


@pytest.mark.skipif(_cuda_device_count() == 0, reason="no CUDA device here: the CPU twins above")
@pytest.mark.parametrize("like", ["cupy", "torch"])
def test_gpu_views_read_another_processs_allocation(gpu_segment, like):
    pytest.importorskip(like)
    daemon, _, _, _ = gpu_segment
    p = subprocess.Popen([sys.executable, "-c", _EXPORTER], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE)
    try:
        ipc = p.stdout.read(64)
        daemon.publish(segment_id=7, stamp=0x3333, handle=ipc, generations=[5, 0, 0, 0])
        seg = kvtier.SegmentMap(daemon)  # the real runtime
        k, v = seg.view(handle(0, 5), D, like=like)
        want = np.arange(2 * N * D, dtype=np.float16)
        got_k = k.get() if like == "cupy" else k.cpu().numpy()
        got_v = v.get() if like == "cupy" else v.cpu().numpy()
        np.testing.assert_array_equal(got_k.reshape(-1), want[:N * D])
        np.testing.assert_array_equal(got_v.reshape(-1), want[N * D:])
        seg.close()
    finally:
        p.stdin.close()
        p.wait(timeout=30)
