"""A damaged checkpoint is named as such at load: never loaded with changed numbers, never a bare EOFError."""

from __future__ import annotations

import random
import zipfile
from pathlib import Path

import pytest
import torch
from offload_helpers import batches, lm_loss, make_model

from cpu_adam import OffloadOptimizer, load_checkpoint, save_checkpoint
from cpu_adam.checkpoint import DamagedCheckpointError


def _optimizer_checkpoint(path: Path) -> dict:
    model = make_model(0)
    opt = OffloadOptimizer(model.parameters(), lr=1e-3, bucket_size=1024)
    lm_loss(model, batches(1)[0]).backward()
    opt.step()
    saved = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    opt.close()
    save_checkpoint(saved, path)
    return saved


def _equal(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return isinstance(b, list | tuple) and len(a) == len(b) and all(map(_equal, a, b))
    return a == b


def _data_start(path: Path, record: str) -> tuple[int, int]:
    """Where the bytes of ``record`` begin in the file, and how many there are."""
    with zipfile.ZipFile(path) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith(record))
    with path.open("rb") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = (int.from_bytes(f.read(2), "little") for _ in range(2))
    return info.header_offset + 30 + name_len + extra_len, info.file_size


def test_a_flipped_byte_in_a_moment_is_detected(tmp_path: Path):
    path = tmp_path / "ckpt.pt"
    saved = _optimizer_checkpoint(path)
    exp_avg = saved["optimizer"]["state"][0]["exp_avg"]
    with zipfile.ZipFile(path) as archive:  # the record holding exp_avg: the one of its size
        sizes = {i.filename: i.file_size for i in archive.infolist() if "/data/" in i.filename}
    record = next(name for name, size in sizes.items() if size == exp_avg.numel() * 4)
    start, size = _data_start(path, record)
    data = bytearray(path.read_bytes())
    data[start + size // 2] ^= 0x10
    path.write_bytes(data)
    assert not _equal(torch.load(path), saved), "torch loads changed values without a word"
    with pytest.raises(DamagedCheckpointError, match=rf"{path.name} is damaged: the bytes of its record .*changed"):
        load_checkpoint(path)


def test_a_byte_flipped_anywhere_is_detected_or_harmless(tmp_path: Path):
    path = tmp_path / "ckpt.pt"
    saved = _optimizer_checkpoint(path)
    whole = path.read_bytes()
    rng, detected = random.Random(0), 0
    for trial in range(2000):
        data = bytearray(whole)
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        path.write_bytes(data)
        try:
            loaded = load_checkpoint(path)
        except DamagedCheckpointError:
            detected += 1
            continue
        assert _equal(loaded, saved), f"trial {trial}: a changed checkpoint loaded with other values"
    assert detected >= 1900  # the tensors' bytes are most of the file


def test_every_truncation_is_named(tmp_path: Path):
    path = tmp_path / "ckpt.pt"
    _optimizer_checkpoint(path)
    whole = path.read_bytes()
    for cut in [0, 1, 10, 100, len(whole) // 3, len(whole) // 2, len(whole) - 100, len(whole) - 22, len(whole) - 1]:
        path.write_bytes(whole[:cut])
        with pytest.raises(
            DamagedCheckpointError, match=rf"{path.name} (is empty|is not a whole checkpoint|is damaged)"
        ):
            load_checkpoint(path)


@pytest.mark.parametrize(
    "content",
    [b"step,loss\n1,2.5\n", b"\x00" * 4096, b"PK\x03\x04 half a zip header"],
    ids=["text", "zeros", "zip-signature"],
)
def test_a_file_that_is_not_a_checkpoint_is_named(tmp_path: Path, content: bytes):
    path = tmp_path / "notes.pt"
    path.write_bytes(content)
    with pytest.raises(DamagedCheckpointError, match=r"notes\.pt is not a whole checkpoint"):
        load_checkpoint(path)


def test_a_zip_that_is_not_a_checkpoint_is_named(tmp_path: Path):
    path = tmp_path / "other.zip"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("readme.txt", "not a checkpoint")
    with pytest.raises(DamagedCheckpointError, match=r"other\.zip is a zip archive but not a checkpoint"):
        load_checkpoint(path)


def test_checkpoints_torch_wrote_still_load(tmp_path: Path):
    state = {"w": torch.randn(100)}
    torch.save(state, tmp_path / "zip.pt")
    torch.save(state, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    for name in ("zip.pt", "legacy.pt"):
        assert torch.equal(load_checkpoint(tmp_path / name)["w"], state["w"])


def test_save_writes_checksums_even_when_torch_is_told_not_to(tmp_path: Path):
    config = pytest.importorskip("torch.utils.serialization").config
    config.save.compute_crc32 = False
    try:
        save_checkpoint({"w": torch.randn(100)}, tmp_path / "ckpt.pt")
        assert config.save.compute_crc32 is False, "the user's setting is restored"
        torch.save({"w": torch.randn(100)}, tmp_path / "unchecked.pt")
    finally:
        config.save.compute_crc32 = True
    with zipfile.ZipFile(tmp_path / "ckpt.pt") as archive:
        assert all(info.CRC != 0 for info in archive.infolist())
    assert load_checkpoint(tmp_path / "unchecked.pt")["w"].numel() == 100  # no CRCs: loads unchecked


class Custom:
    pass


def test_weights_only_refusals_stay_torch_s(tmp_path: Path):
    save_checkpoint({"obj": Custom()}, tmp_path / "ckpt.pt")
    with pytest.raises(Exception, match="weights_only") as raised:
        load_checkpoint(tmp_path / "ckpt.pt")
    assert not isinstance(raised.value, DamagedCheckpointError)


def test_a_byte_flipped_deep_in_a_large_record_is_found(tmp_path: Path):
    path = tmp_path / "ckpt.pt"
    state = {"big": torch.randn(5_000_000), "small": torch.arange(7)}  # 20 MB: the check reads it in pieces
    save_checkpoint(state, path)
    start, size = _data_start(path, "data/0") if _record_size(path, "data/0") > 1000 else _data_start(path, "data/1")
    data = bytearray(path.read_bytes())
    data[start + size - 5] ^= 0x01  # in the last piece
    path.write_bytes(data)
    with zipfile.ZipFile(path) as archive:
        assert archive.testzip() is not None  # zipfile agrees that it changed
    with pytest.raises(DamagedCheckpointError, match="changed after the save"):
        load_checkpoint(path)


def _record_size(path: Path, record: str) -> int:
    with zipfile.ZipFile(path) as archive:
        return next(i.file_size for i in archive.infolist() if i.filename.endswith(record))
