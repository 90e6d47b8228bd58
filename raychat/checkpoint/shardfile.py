"""One rank's checkpoint file: a plain `safetensors` file, written as a stream, read by byte range.

Why safetensors: the format is an 8-byte header length, a JSON header (each tensor's dtype, shape
and byte offsets) and the raw bytes; any reader (the `safetensors` package, or numpy and 20 lines)
loads it without raychat, loading runs no code (no pickle), and a tensor's part is one byte range,
so a rank reads only the bytes it needs, from local disk or a bucket (ranged GETs via pyarrow.fs).

raychat adds one thing inside the format's own `__metadata__` field: the sha256 of every
BLOCK_BYTES block of every tensor, so a rank that reads part of a tensor verifies exactly the blocks
it read. Tensors are laid out in the order given (not sorted by name), so the pieces a rank owns sit
together and a resume at the same world size reads each file front to back.
"""

import hashlib
import json
import struct
from dataclasses import dataclass

import torch

from raychat.common import RaychatError
from raychat.storage import Storage

BLOCK_BYTES = 1 << 20
_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}
_TORCH_DTYPES = {name: dtype for dtype, name in _DTYPES.items()}
_MAX_HEADER = 100 << 20  # the safetensors limit


class CheckpointDamaged(RaychatError):
    """A checkpoint that is incomplete or whose bytes do not match what was written."""


@dataclass
class IOCount:
    """Bytes this process moved through checkpoint files (the benchmark's and tests' counter)."""

    read: int = 0
    written: int = 0


io_count = IOCount()


def dtype_name(dtype: torch.dtype) -> str:
    if dtype not in _DTYPES:
        raise TypeError(f"a checkpoint tensor cannot have dtype {dtype}")
    return _DTYPES[dtype]


def torch_dtype(name: str) -> torch.dtype:
    if name not in _TORCH_DTYPES:
        raise CheckpointDamaged(f"unknown tensor dtype {name!r}")
    return _TORCH_DTYPES[name]


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


def _block_hashes(data: memoryview) -> list[str]:
    return [hashlib.sha256(data[i:i + BLOCK_BYTES]).hexdigest() for i in range(0, len(data), BLOCK_BYTES)]


def encode_header(tensors: list[tuple[str, torch.Tensor]]) -> bytes:
    """The 8-byte length and JSON header of a safetensors file holding `tensors` in this order."""
    header: dict = {}
    hashes, offset = {}, 0
    for key, tensor in tensors:
        data = _bytes_of(tensor)
        header[key] = {"dtype": dtype_name(tensor.dtype), "shape": list(tensor.shape),
                       "data_offsets": [offset, offset + len(data)]}
        hashes[key] = _block_hashes(data)
        offset += len(data)
    header["__metadata__"] = {"raychat_block_bytes": str(BLOCK_BYTES), "raychat_sha256": json.dumps(hashes)}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as the format recommends
    return struct.pack("<Q", len(text)) + text


def write_tensors(f, tensors: list[tuple[str, torch.Tensor]]) -> str:
    """Stream a safetensors file to `f`: header, then each tensor's bytes straight from its memory.
    Returns the header's sha256 (the index keeps it: a reader trusts the block hashes it holds)."""
    header = encode_header(tensors)
    f.write(header)
    io_count.written += len(header)
    for _, tensor in tensors:
        data = _bytes_of(tensor)
        f.write(data)
        io_count.written += len(data)
    return hashlib.sha256(header).hexdigest()


class ShardFile:
    """Verified partial reads of one rank's file. The header is read (and checked against the
    sha256 the index recorded for it) on the first read."""

    def __init__(self, directory: Storage, name: str, header_sha256: str):
        self.directory, self.name, self.header_sha256 = directory, name, header_sha256
        self._file = None
        self._entries: dict[str, dict] = {}
        self._hashes: dict[str, list[str]] = {}
        self._data_start = 0

    def _open(self) -> None:
        try:
            self._file = self.directory.fs.open_input_file(self.directory.path(self.name))
        except FileNotFoundError:
            raise CheckpointDamaged(f"{self.name} is missing") from None
        length_bytes = self._read_at(0, 8)
        (length,) = struct.unpack("<Q", length_bytes) if len(length_bytes) == 8 else (-1,)
        if not 0 < length <= _MAX_HEADER:
            raise CheckpointDamaged(f"{self.name} has no safetensors header")
        text = self._read_at(8, length)
        if hashlib.sha256(length_bytes + text).hexdigest() != self.header_sha256:
            raise CheckpointDamaged(f"the header of {self.name} does not match its sha256 in the index")
        header = json.loads(text)
        meta = header.pop("__metadata__")
        self._hashes = json.loads(meta["raychat_sha256"])
        self._entries, self._data_start = header, 8 + length

    def _read_at(self, offset: int, size: int) -> bytes:
        data = self._file.read_at(size, offset)
        io_count.read += len(data)
        return data

    def read(self, key: str, start: int, numel: int) -> torch.Tensor:
        """Elements [start, start + numel) of tensor `key` (flat), every block read verified."""
        if self._file is None:
            self._open()
        if key not in self._entries:
            raise CheckpointDamaged(f"{self.name} has no tensor {key!r}")
        entry = self._entries[key]
        dtype = torch_dtype(entry["dtype"])
        item = torch.empty((), dtype=dtype).element_size()
        begin, end = entry["data_offsets"]
        first, last = start * item, (start + numel) * item
        if last > end - begin:
            raise CheckpointDamaged(f"{self.name}: tensor {key!r} is shorter than the index says")
        block0 = first // BLOCK_BYTES
        read_from = block0 * BLOCK_BYTES
        read_to = min(end - begin, -(-last // BLOCK_BYTES) * BLOCK_BYTES)
        data = self._read_at(self._data_start + begin + read_from, read_to - read_from)
        if len(data) != read_to - read_from:
            raise CheckpointDamaged(f"{self.name} is truncated")
        view = memoryview(data)
        for i, block_start in enumerate(range(0, len(data), BLOCK_BYTES)):
            digest = hashlib.sha256(view[block_start:block_start + BLOCK_BYTES]).hexdigest()
            if digest != self._hashes[key][block0 + i]:
                raise CheckpointDamaged(f"{self.name}: tensor {key!r} does not match its sha256")
        piece = view[first - read_from:last - read_from]
        return torch.frombuffer(bytearray(piece), dtype=dtype) if numel else torch.empty(0, dtype=dtype)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

