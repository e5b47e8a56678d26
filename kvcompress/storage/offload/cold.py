"""The cold tier of the ``offload`` storage: whole pages of keys and values in host memory or on disk.

Pages are rows of one 2D tensor ``(P * B * H_kv, 2 * block_size * D)``, page-major, so a page of one row
and head is one contiguous row (one copy per fetched page) and growing the tier appends rows. The disk tier
memory-maps one file per layer under ``dir`` and unlinks it right after mapping: the data lives as long as
the mapping (the cache), and no file outlives the process, even a killed one. Growth allocates (or maps)
``GROWTH`` times the capacity and copies the old rows over: the tier holds at most a quarter more than its
rows (doubling would hold up to twice), for about four copies of each row over a long prefill.

The host tier is pinned memory when the device is CUDA, and fetches go through a pinned staging buffer
on a copy stream that the compute stream waits for by event (``fetch_into``). On a CPU-only
machine the host tier is the same memory as the "device": it saves nothing there (the disk tier does).
"""

from __future__ import annotations

import math
import os
import tempfile
import uuid

import torch

GROWTH = 1.25  # capacity factor when the tier is full: bounded waste (<= 25%) against amortised copies
MIN_ROWS = 16


def default_dir() -> str:
    """The running Hydra job's output folder, else the system's temporary folder."""
    try:
        from hydra.core.hydra_config import HydraConfig

        if HydraConfig.initialized():
            return str(HydraConfig.get().runtime.output_dir)
    except ImportError:  # hydra is a dependency, but the storage itself does not need it
        pass
    return tempfile.gettempdir()


class ColdPages:
    """Rows of pages in one tier (``host`` or ``disk``), fetched by row index onto ``device``."""

    def __init__(self, tier: str, folder: str | None, row: int, dtype: torch.dtype, device: torch.device):
        self.tier, self.folder, self.row, self.dtype, self.device = tier, folder, row, dtype, device
        self.pin = tier == "host" and device.type == "cuda" and torch.cuda.is_available()
        self.staged = device.type == "cuda" and torch.cuda.is_available()  # fetches via pinned staging
        self._buffers: list = [None, None]  # pinned (rows, indices) staging, used in turn (CUDA only)
        self._events = [torch.cuda.Event(), torch.cuda.Event()] if self.staged else None
        self._turn, self._stream = 0, None
        self.data: torch.Tensor | None = None  # (capacity, row)
        self.used = 0  # rows written

    def _alloc(self, rows: int) -> torch.Tensor:
        if self.tier == "host":
            return torch.empty(rows, self.row, dtype=self.dtype, pin_memory=self.pin)
        folder = self.folder or default_dir()
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"kvcompress-offload-{os.getpid()}-{uuid.uuid4().hex}.bin")
        try:
            data = torch.from_file(path, shared=True, size=rows * self.row, dtype=self.dtype)
        finally:
            if os.path.exists(path):
                os.unlink(path)  # the mapping keeps the data; no file is left behind, whatever happens next
        return data.view(rows, self.row)

    def append(self, rows: torch.Tensor) -> None:
        """Write ``rows`` (n, row) after the rows held, growing the tier when full."""
        need = self.used + rows.shape[0]
        if self.data is None or need > self.data.shape[0]:
            have = 0 if self.data is None else self.data.shape[0]
            grown = self._alloc(max(need, math.ceil(GROWTH * have), MIN_ROWS))
            if self.used:
                grown[: self.used].copy_(self.data[: self.used])
            self.data = grown
        self.data[self.used : need].copy_(rows, non_blocking=False)
        self.used = need

    def fetch_into(self, idx, slots, ids, rows: torch.Tensor, pages: torch.Tensor) -> None:
        """Copy cold rows ``idx`` into device rows ``slots`` of ``rows`` and write ``ids`` at ``slots`` of
        ``pages``; ``idx``, ``slots``, ``ids`` are (m,) int64 numpy arrays (host data).

        On CUDA the rows and indices are gathered into preallocated pinned staging buffers (two, used in
        turn, grown when a fetch needs more) and uploaded on a copy stream; the compute stream waits for
        that upload's event, the host never does. Elsewhere the same steps run in order."""
        idx = torch.from_numpy(idx)
        if not self.staged:
            at = torch.from_numpy(slots).to(rows.device)
            rows.index_copy_(0, at, self.data.index_select(0, idx).to(rows.device))
            pages.index_copy_(0, at, torch.from_numpy(ids).to(pages.device))
            return
        m = idx.shape[0]
        data, index, done = self._staging(m)
        if not done.query():  # this buffer's upload of two fetches ago is still running (rare)
            done.synchronize()
        torch.index_select(self.data, 0, idx, out=data)
        index[0].copy_(torch.from_numpy(slots))
        index[1].copy_(torch.from_numpy(ids))
        compute = torch.cuda.current_stream(rows.device)
        copy = self._copy_stream(rows.device)
        copy.wait_stream(compute)  # the slots' old rows are free once this step's earlier work ran
        with torch.cuda.stream(copy):
            on_device = data.to(rows.device, non_blocking=True)
            at = index.to(rows.device, non_blocking=True)
            rows.index_copy_(0, at[0], on_device)
            pages.index_copy_(0, at[0], at[1])
            done.record(copy)
        compute.wait_event(done)
        on_device.record_stream(compute)
        at.record_stream(compute)

    def _staging(self, n: int):
        """The next pinned staging buffers (rows (n, row), indices (2, n) int64) and their last upload's
        event."""
        self._turn = turn = 1 - self._turn
        held = self._buffers[turn]
        if held is None or held[0].shape[0] < n:
            self._events[turn].synchronize()
            size = max(n, MIN_ROWS, 0 if held is None else 2 * held[0].shape[0])
            rows = torch.empty(size, self.row, dtype=self.dtype, pin_memory=True)
            self._buffers[turn] = held = (rows, torch.empty(2, size, dtype=torch.long, pin_memory=True))
        return held[0][:n], held[1][:, :n], self._events[turn]

    def _copy_stream(self, device):
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    def nbytes(self) -> int:
        """Bytes this tier holds (its capacity: what the process really allocated or mapped)."""
        return 0 if self.data is None else self.data.untyped_storage().nbytes()

    def clear(self) -> None:
        self.data, self.used = None, 0  # a mapped file's space is freed with its last reference

    def saved_state(self) -> dict:
        """What a cache file keeps (``kvcompress.persist.state``): the tier's settings and its rows, not its
        file."""
        rows = None if self.data is None else self.data[: self.used]
        return {"tier": self.tier, "folder": self.folder, "row": self.row, "dtype": self.dtype,
                "device": self.device, "rows": rows}  # fmt: skip

    @classmethod
    def from_saved(cls, state: dict) -> ColdPages:
        new = cls(state["tier"], state["folder"], state["row"], state["dtype"], state["device"])
        if state["rows"] is not None:
            new.append(state["rows"].to("cpu"))
        return new

    def __deepcopy__(self, memo):
        """A copy in the same tier (a new mapped file for ``disk``): snapshots never share cold pages."""
        new = ColdPages(self.tier, self.folder, self.row, self.dtype, self.device)
        if self.data is not None:
            new.append(self.data[: self.used])
        return new
