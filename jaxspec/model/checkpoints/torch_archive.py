"""The tensor table of a PyTorch ``torch.save`` file (``pytorch_model.bin``), read without torch.

A ``torch.save`` file (PyTorch 1.6 and newer) is a zip archive: ``<top>/data.pkl`` pickles the
saved object, each tensor as a call of ``torch._utils._rebuild_tensor_v2`` (or ``_v3``, which names
the dtype) over a storage; each storage's bytes are the member ``<top>/data/<key>``, stored
uncompressed. So each tensor lies at a known offset of the file, as in a safetensors file, and
``read_torch_archive`` returns the same ``TensorEntry`` table ``read_header`` does: the checkpoint's
readers then read exactly the bytes asked for (one tensor-parallel shard, a band of rows) from either
format.

The pickle is read by an unpickler that resolves only the names a state dict needs (``OrderedDict``,
the rebuild functions, storage classes and dtypes) and refuses any other, naming it: unlike
``pickle.load`` (and ``torch.load`` without ``weights_only``) it runs no code from the file.
"""

from __future__ import annotations

import collections
import dataclasses
import pickle
import struct
import zipfile

import numpy as np

# Storage classes of ``_rebuild_tensor_v2`` and dtypes of ``_rebuild_tensor_v3`` -> safetensors dtype names.
STORAGE_DTYPES = {
    "DoubleStorage": "F64", "FloatStorage": "F32", "HalfStorage": "F16", "BFloat16Storage": "BF16",
    "LongStorage": "I64", "IntStorage": "I32", "ShortStorage": "I16", "CharStorage": "I8",
    "ByteStorage": "U8", "BoolStorage": "BOOL",
}
TORCH_DTYPES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2", "float8_e8m0fnu": "F8_E8M0",
}
ITEM_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
              "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1}

_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, then file-name and extra-field lengths at 26


class TorchArchiveError(ValueError):
    """A file that is not a ``torch.save`` archive of tensors this reader takes."""


@dataclasses.dataclass(frozen=True)
class _Kind:  # a storage class or dtype named by the pickle; dtype None: an untyped storage (bytes)
    dtype: str | None


@dataclasses.dataclass(frozen=True)
class _Storage:
    key: str
    dtype: str | None


@dataclasses.dataclass(frozen=True)
class StoredTensor:
    """One tensor of the archive: its storage's key, dtype, element offset into the storage,
    shape and element strides."""

    key: str
    dtype: str
    offset: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]

    @property
    def row_major(self) -> bool:
        """Whether its elements lie in row-major order, with no gaps (axes of size 1 have any stride)."""
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.strides)):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True


def strided_span(shape: tuple[int, ...], strides: tuple[int, ...]) -> int:
    """Elements of its storage a tensor of ``shape`` and element ``strides`` covers, from its first."""
    return 1 + sum((d - 1) * s for d, s in zip(shape, strides)) if all(shape) else 0


def _rebuild_v2(storage, offset, shape, strides, requires_grad=False, hooks=None, metadata=None):
    return _tensor(storage, offset, shape, strides, storage.dtype)


def _rebuild_v3(storage, offset, shape, strides, requires_grad, hooks, dtype, metadata=None):
    return _tensor(storage, offset, shape, strides, dtype.dtype)


def _tensor(storage, offset, shape, strides, dtype):
    if dtype is None:
        raise pickle.UnpicklingError("a tensor over an untyped storage without a dtype")
    return StoredTensor(storage.key, dtype, int(offset), tuple(int(s) for s in shape), tuple(int(s) for s in strides))


def _parameter(data, requires_grad=False, hooks=None, state=None):
    return data


_GLOBALS = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_v2,
    ("torch._utils", "_rebuild_tensor_v3"): _rebuild_v3,
    ("torch._utils", "_rebuild_parameter"): _parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _parameter,
    ("torch.storage", "UntypedStorage"): _Kind(None),
    **{("torch", name): _Kind(dtype) for name, dtype in STORAGE_DTYPES.items()},
    **{("torch", name): _Kind(dtype) for name, dtype in TORCH_DTYPES.items()},
}


class _StateDictUnpickler(pickle.Unpickler):
    """Resolves the names of ``_GLOBALS`` and nothing else; storages become their keys."""

    def find_class(self, module, name):
        try:
            return _GLOBALS[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"refuses the global {module}.{name} (only tensors and dicts of them "
                                         "are read)") from None

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) >= 3 and pid[0] == "storage" and isinstance(pid[1], _Kind)):
            raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")
        return _Storage(str(pid[2]), pid[1].dtype)


def load_tensor_index(file: str) -> tuple[dict[str, StoredTensor], zipfile.ZipFile, str]:
    """The saved mapping name -> ``StoredTensor`` of ``file``, the open archive and its top folder.

    Raises:
      TorchArchiveError: not a zip archive (PyTorch's legacy format, or not a ``torch.save`` file at
        all), no ``data.pkl``, a big-endian archive, a pickle naming anything but tensors, dicts and
        their rebuild functions, or a saved object that is not a flat mapping of names to tensors.
    """
    if not zipfile.is_zipfile(file):
        raise TorchArchiveError(f"{file}: not a zip archive; torch.save's legacy format (PyTorch < 1.6) is not "
                                "read: load and save it again with a newer PyTorch, or convert it to safetensors")
    archive = zipfile.ZipFile(file)
    try:
        pickles = [n for n in archive.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
        if len(pickles) != 1:
            raise TorchArchiveError(f"{file}: a zip archive but not a torch.save file (no <top>/data.pkl)")
        top = pickles[0][: -len("/data.pkl")]
        if f"{top}/byteorder" in archive.namelist():
            order = archive.read(f"{top}/byteorder").decode().strip()
            if order != "little":
                raise TorchArchiveError(f"{file}: byte order {order!r}; only little-endian archives are read")
        try:
            saved = _StateDictUnpickler(archive.open(pickles[0])).load()
        except (pickle.UnpicklingError, AttributeError, TypeError, EOFError) as e:
            raise TorchArchiveError(f"{file}: {e}") from None
        if not isinstance(saved, dict):
            raise TorchArchiveError(f"{file}: holds a {type(saved).__name__}, not a state dict (names -> tensors)")
        for name, value in saved.items():
            if not isinstance(value, StoredTensor):
                what = "a nested dict (save the inner state dict itself)" if isinstance(value, dict) else \
                    f"a {type(value).__name__}"
                raise TorchArchiveError(f"{file}: {name!r} is {what}, not a tensor")
        return dict(saved), archive, top
    except BaseException:
        archive.close()
        raise


def _data_offset(f, info: zipfile.ZipInfo) -> int:
    """Where a stored member's bytes start: after its local header, whose extra field may differ
    from the central directory's (PyTorch pads it to align the data)."""
    f.seek(info.header_offset)
    signature, name_len, extra_len = _LOCAL_HEADER.unpack(f.read(_LOCAL_HEADER.size))
    if signature != b"PK\x03\x04":
        raise TorchArchiveError(f"{info.filename}: bad local header")
    return info.header_offset + _LOCAL_HEADER.size + name_len + extra_len


def read_torch_archive(file: str, entry_type):
    """The tensor table of a ``torch.save`` file as ``{name: entry_type(file, dtype, shape, offset,
    nbytes, strides)}`` (absolute byte offsets of each tensor's first element; ``strides`` None for a
    row-major tensor, else its element strides) and the bytes read to build it (the pickle and the
    members' local headers).

    Raises:
      TorchArchiveError: see ``load_tensor_index``; also a compressed storage member, or a tensor
        reaching past its storage.
    """
    tensors, archive, top = load_tensor_index(file)
    out, read = {}, archive.getinfo(f"{top}/data.pkl").file_size
    try:
        with open(file, "rb") as f:
            starts: dict[str, tuple[int, int]] = {}
            for name, t in tensors.items():
                if t.key not in starts:
                    try:
                        info = archive.getinfo(f"{top}/data/{t.key}")
                    except KeyError:
                        raise TorchArchiveError(f"{file}: tensor {name!r}: no storage member data/{t.key}") from None
                    if info.compress_type != zipfile.ZIP_STORED:
                        raise TorchArchiveError(f"{file}: storage data/{t.key} is compressed; torch.save stores "
                                                "storages uncompressed")
                    starts[t.key] = (_data_offset(f, info), info.file_size)
                    read += _LOCAL_HEADER.size + len(info.filename.encode()) + len(info.extra)
                begin, size = starts[t.key]
                item = ITEM_BYTES[t.dtype]
                span = strided_span(t.shape, t.strides)
                if t.offset < 0 or min(t.strides, default=0) < 0 or (t.offset + span) * item > size:
                    raise TorchArchiveError(f"{file}: tensor {name!r} reaches past its storage data/{t.key}")
                nbytes = int(np.prod(t.shape, dtype=np.int64)) * item
                out[name] = entry_type(file, t.dtype, t.shape, begin + t.offset * item, nbytes,
                                       None if t.row_major else t.strides)
    finally:
        archive.close()
    return out, read
