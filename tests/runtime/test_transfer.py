"""Host buffers and the pool gradients pass through; CUDA registration is checked against
a stand-in for the CUDA runtime (the real one runs in the CUDA tests of the offload modules)."""

from __future__ import annotations

import gc
import mmap
import threading
import time

import pytest
import torch

from hybridtrain.runtime import transfer

CUDA = torch.device("cuda")


class _FakeCudart:
    def __init__(self, status: int = 0) -> None:
        self.status = status
        self.registered: list[tuple[int, int, int]] = []
        self.unregistered: list[int] = []

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802 - CUDA's name
        self.registered.append((ptr, size, flags))
        return self.status

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802 - CUDA's name
        self.unregistered.append(ptr)
        return 0


def test_lasting_buffers_are_page_locked_at_their_exact_size_and_released(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    numel = 300_000  # 1.2 MB: above the size below which the caching allocator is used
    buffer = transfer.host_buffer(numel, torch.float32, True, CUDA)
    assert buffer.numel() == numel and buffer.dtype == torch.float32
    ((ptr, size, flags),) = fake.registered
    page = mmap.PAGESIZE
    # Whole pages, starting at the buffer, ending within its allocation: not rounded up to
    # a power of two (2 MiB here), and no page shared with another allocation.
    assert ptr == buffer.data_ptr() and ptr % page == 0 and size == -(-4 * numel // page) * page and flags == 1
    storage = buffer.untyped_storage()
    assert storage.data_ptr() <= ptr and ptr + size <= storage.data_ptr() + storage.nbytes()
    view = buffer[10:20]
    del buffer, storage
    gc.collect()
    assert fake.unregistered == []  # a view still reads it
    del view
    gc.collect()
    assert fake.unregistered == [ptr]


def test_small_lasting_buffers_use_the_caching_allocator(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(torch, "empty", _no_pinned(torch.empty))
    monkeypatch.setattr(transfer, "_pin_warned", False)
    with pytest.warns(UserWarning, match="pinned host memory unavailable"):
        transfer.host_buffer(1000, torch.float32, True, CUDA)
    assert fake.registered == []


def test_failed_registration_falls_back_with_one_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "cudart", lambda: _FakeCudart(status=712))
    monkeypatch.setattr(transfer, "_pin_warned", False)
    cleared: list[bool] = []
    monkeypatch.setattr(transfer, "_clear_cuda_error", lambda: cleared.append(True))
    # The fallback asks the caching pinned allocator, which has no driver here either.
    monkeypatch.setattr(torch, "empty", _no_pinned(torch.empty))
    with pytest.warns(UserWarning, match="pinned host memory unavailable"):
        buffer = transfer.host_buffer(300_000, torch.float32, True, CUDA)
    assert buffer.numel() == 300_000 and not buffer.is_pinned()
    assert cleared == [True]  # CUDA's last error is read back, or the next launch check reports it


def _no_pinned(empty):  # type: ignore[no-untyped-def]
    def fake(*args, pin_memory: bool = False, **kwargs):  # type: ignore[no-untyped-def]
        if pin_memory:
            raise RuntimeError("no CUDA driver")
        return empty(*args, **kwargs)
    return fake


def test_cpu_buffers_are_plain_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "cudart", lambda: pytest.fail("no CUDA call for a CPU device"))
    assert transfer.host_buffer(10, torch.float32, True, torch.device("cpu")).numel() == 10


def test_pool_reuses_its_buffers_and_blocks_when_all_are_in_use() -> None:
    pool = transfer.HostBufferPool(100, torch.float32, False, torch.device("cpu"), count=2)
    a, b = pool.acquire(100), pool.acquire(40)
    assert b.numel() == 40 and pool.allocated == 2
    got: list[torch.Tensor] = []
    waiter = threading.Thread(target=lambda: got.append(pool.acquire(100)))
    waiter.start()
    time.sleep(0.05)
    assert not got  # both buffers are in use: the producer waits for the consumer
    pool.release(b)
    waiter.join(timeout=5)
    assert got and got[0].untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    assert pool.allocated == 2
    pool.release(a)
    with pytest.raises(ValueError, match="hold 100 elements, 101 were asked for"):
        pool.acquire(101)


def test_a_pool_buffer_comes_back_whole_when_released_as_another_type() -> None:
    # Buckets of bytes viewed as each bucket's master type (fp32 or fp64): the whole buffer
    # goes back, not the typed view, so the next request of any size and type fits.
    pool = transfer.HostBufferPool(64, torch.uint8, False, torch.device("cpu"), count=1)
    doubles = pool.acquire(16).view(torch.float64)
    assert doubles.numel() == 2
    pool.release(doubles)
    pool.release(pool.acquire(0))  # an empty request (a bucket of empty tensors) comes back too
    again = pool.acquire(64)
    assert again.numel() == 64 and again.dtype == torch.uint8 and pool.allocated == 1
