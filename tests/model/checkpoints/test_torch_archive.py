"""``pytorch_model.bin`` checkpoints (``torch.save`` zip archives) are read without torch: every
tensor as torch saved it, pieces of them byte for byte, SafeAILab's EAGLE-3 head and a sharded HF
target loading to the same parameters as their safetensors, and every file the reader does not take
refused with what it is, running nothing from its pickle.

The archives were written by real ``torch.save`` (``scripts/goldens/torch_pickles.py``); the expected
values are torch's own, saved beside them."""

from __future__ import annotations

import io
import os
import pickle
import shutil
import zipfile

import jax
import ml_dtypes
import numpy as np
import pytest

import jaxspec as js
from jaxspec.model.checkpoints.checkpoint import CheckpointError, CheckpointTensors
from tests.model.golden import GOLDEN

PICKLES = os.path.join(GOLDEN, "torch_pickles")
TENSORS = os.path.join(PICKLES, "tensors")
NUMPY = {"bfloat16": ml_dtypes.bfloat16, "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
         "float8_e5m2": ml_dtypes.float8_e5m2}


def _expected():
    z = np.load(os.path.join(TENSORS, "expected.npz"))
    out = {}
    for key in z.files:
        if key.endswith(".dtype"):
            continue
        dtype = str(z[f"{key}.dtype"])
        out[key] = z[key].view(NUMPY[dtype]) if dtype in NUMPY else z[key]
    return out


EXPECTED = _expected()


@pytest.fixture(scope="module")
def ckpt():
    return CheckpointTensors(TENSORS)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_tensor_reads_as_torch_saved_it(ckpt, name):
    got, want = ckpt.read(name), EXPECTED[name]
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.tobytes() == want.tobytes()


@pytest.mark.parametrize("name,rows,band", [
    ("f32", (1, 3), None),
    ("f32", None, (1, 2, 4)),
    ("f16", (1, 2), (2, 1, 3)),
    ("rows", (1, 3), (1, 3, 7)),  # an offset into its storage
    ("transposed", (2, 6), (1, 1, 5)),  # not row-major: read through its strides
    ("strided", (1, 3), (1, 1, 3)),
])
def test_pieces_read_as_slices(ckpt, name, rows, band):
    want = EXPECTED[name]
    index = [slice(*rows) if rows else slice(None)] + [slice(None)] * (want.ndim - 1)
    if band:
        index[band[0]] = slice(band[1], band[2])
    before = ckpt.bytes_read
    got = ckpt.read(name, rows=rows, band=band)
    np.testing.assert_array_equal(got, want[tuple(index)])
    if ckpt.entry(name).strides is None:  # in place: exactly the piece's bytes
        assert ckpt.bytes_read - before == got.nbytes


def test_views_keep_their_strides_and_share_bytes(ckpt):
    base, rows = ckpt.entry("base"), ckpt.entry("rows")
    assert base.strides is None and ckpt.entry("shared") == base
    assert ckpt.entry("transposed").strides == (1, 8) and ckpt.entry("transposed").offset == base.offset
    assert ckpt.entry("strided").strides == (16, 3)
    assert rows.strides is None and rows.offset == base.offset + 2 * 8 * 4


def test_an_archive_zipped_again_reads_the_same(tmp_path):
    """Python's zip writer puts the members elsewhere, with other local headers than torch's."""
    src = os.path.join(TENSORS, "pytorch_model.bin")
    (tmp_path / "d").mkdir()
    with zipfile.ZipFile(src) as a, zipfile.ZipFile(tmp_path / "d" / "pytorch_model.bin", "w") as b:
        for info in reversed(a.infolist()):
            b.writestr(info.filename, a.read(info.filename))
    again = CheckpointTensors(str(tmp_path / "d"))
    assert sorted(again.keys()) == sorted(EXPECTED)
    for name, want in EXPECTED.items():
        assert again.read(name).tobytes() == want.tobytes()


def _leaves(tree):
    return [(jax.tree_util.keystr(p), np.asarray(x)) for p, x in jax.tree.leaves_with_path(tree)]


def _same_params(a, b):
    la, lb = _leaves(a), _leaves(b)
    assert [p for p, _ in la] == [p for p, _ in lb]
    for (path, x), (_, y) in zip(la, lb):
        assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes(), path


@pytest.fixture(scope="module")
def target():
    return js.load_model(os.path.join(GOLDEN, "llama3"), dtype="float32", progress=False)


def test_safeailab_eagle3_bin_loads_as_its_safetensors(target):
    """SafeAILab's EAGLE-3 heads are ``pytorch_model.bin`` (``midlayer.*``, ``d2t``, ``t2d``)."""
    from_bin = js.load_draft(os.path.join(PICKLES, "eagle3_midlayer"), target)
    from_safetensors = js.load_draft(os.path.join(GOLDEN, "eagle3_midlayer"), target)
    assert from_bin.kind == from_safetensors.kind == "eagle3"
    _same_params(from_bin.params, from_safetensors.params)


def test_sharded_float16_target_bin_loads_as_its_safetensors():
    """Two ``torch.save`` shards listed by ``pytorch_model.bin.index.json``, float16 (transformers'
    ``state_dict()``): the same parameters as the float32 safetensors rounded to float16, and the
    same greedy continuation."""
    from_bin = js.load_model(os.path.join(PICKLES, "llama3"), dtype="float16", progress=False)
    from_safetensors = js.load_model(os.path.join(GOLDEN, "llama3"), dtype="float16", progress=False)
    _same_params(from_bin.params, from_safetensors.params)
    assert from_bin.eos_token_ids == from_safetensors.eos_token_ids


# ---------------------------------------------------------------------------------------- refusals


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def _archive(path, members: dict[str, bytes], compress=zipfile.ZIP_STORED):
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w", compression=compress) as z:
        for name, data in members.items():
            z.writestr(name, data)


def _torch_members(change=None, drop=()):
    with zipfile.ZipFile(os.path.join(TENSORS, "pytorch_model.bin")) as z:
        members = {n: z.read(n) for n in z.namelist() if not any(n.endswith(d) for d in drop)}
    top = next(n for n in members if n.endswith("/data.pkl")).split("/")[0]
    members.update({f"{top}/{k}": v for k, v in (change or {}).items()})
    return members


REFUSED = [
    ("runs_code", lambda p: _archive(p, {"archive/data.pkl": pickle.dumps(_RunsCode(), protocol=2)}),
     r"refuses the global (posix|nt)\.system"),
    ("legacy_format", lambda p: p.write_bytes(pickle.dumps({"w": [1.0]}, protocol=2)), r"legacy format"),
    ("not_a_state_dict", lambda p: _archive(p, {"archive/data.pkl": pickle.dumps([1, 2], protocol=2)}),
     r"holds a list, not a state dict"),
    ("nested", lambda p: _archive(p, {"archive/data.pkl": pickle.dumps({"model": {}}, protocol=2)}),
     r"'model' is a nested dict"),
    ("not_torch", lambda p: _archive(p, {"weights.npy": b"\x93NUMPY"}), r"not a torch\.save file"),
    ("compressed", lambda p: _archive(p, _torch_members(), compress=zipfile.ZIP_DEFLATED), r"is compressed"),
    ("big_endian", lambda p: _archive(p, _torch_members({"byteorder": b"big"})), r"byte order 'big'"),
    ("missing_storage", lambda p: _archive(p, _torch_members(drop=("/data/0",))), r"no storage member data/0"),
]


@pytest.mark.parametrize("name,write,message", REFUSED, ids=[r[0] for r in REFUSED])
def test_refused_naming_what_it_is(tmp_path, monkeypatch, name, write, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ckpt").mkdir()
    write(tmp_path / "ckpt" / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=message):
        CheckpointTensors(str(tmp_path / "ckpt"))
    assert not (tmp_path / "PWNED").exists()


def test_other_pickles_are_named_in_the_missing_weights_error(tmp_path):
    d = tmp_path / "head"
    shutil.copytree(os.path.join(PICKLES, "eagle3_midlayer"), d)
    (d / "pytorch_model.bin").rename(d / "consolidated.pth")
    with pytest.raises(FileNotFoundError, match=r"holds consolidated\.pth.*only pytorch_model\.bin"):
        CheckpointTensors(str(d))


def test_a_broken_pickle_is_a_checkpoint_error(tmp_path):
    data = io.BytesIO()
    pickle.dump({"w": 1}, data, protocol=2)
    _archive(tmp_path / "c" / "pytorch_model.bin", {"archive/data.pkl": data.getvalue()[:-3]})
    with pytest.raises(CheckpointError):
        CheckpointTensors(str(tmp_path / "c"))
