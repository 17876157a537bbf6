"""The cached engine install's build-once rule (`workers.engine_venv.build_once`) on real files:
built once per spec, rebuilt from scratch when the spec changes or a build failed half-way."""

from __future__ import annotations

from pathlib import Path

import pytest

from workers.engine_venv import READY_MARKER, build_once, requirement_name, wheel_requirements


def test_a_venv_is_built_once_per_spec_and_a_half_build_is_redone(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    builds: list[str] = []

    def build(tag: str) -> None:
        assert not venv.exists()  # an incomplete venv is removed before building
        venv.mkdir()
        (venv / "content").write_text(tag)
        builds.append(tag)

    assert build_once("t", venv, "spec-1", lambda: build("a")) == venv
    build_once("t", venv, "spec-1", lambda: build("b"))
    assert builds == ["a"]
    assert (venv / READY_MARKER).read_text().strip() == "spec-1"

    build_once("t", venv, "spec-2", lambda: build("c"))  # what the venv holds changed
    assert builds == ["a", "c"] and (venv / "content").read_text() == "c"

    def failing() -> None:
        build("d")
        raise RuntimeError("pip failed")

    with pytest.raises(RuntimeError):
        build_once("t", venv, "spec-3", failing)
    assert not (venv / READY_MARKER).exists()  # never marked ready
    build_once("t", venv, "spec-3", lambda: build("e"))
    assert builds[-1] == "e" and (venv / READY_MARKER).read_text().strip() == "spec-3"


def test_wheel_requirements_leave_out_the_skipped_distributions(tmp_path: Path) -> None:
    import zipfile

    wheel = tmp_path / "demo-1.0-py3-none-any.whl"
    meta = "\n".join(
        [
            "Metadata-Version: 2.1",
            "Name: demo",
            "Requires-Dist: torch==2.14.1",
            "Requires-Dist: flashinfer_python[cu13]==0.7.2",
            "Requires-Dist: Sentencepiece==0.2.1",
            'Requires-Dist: av==16.1.0; sys_platform == "linux"',
            'Requires-Dist: pytest; extra == "test"',
        ]
    )
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("demo-1.0.dist-info/METADATA", meta)
    got = wheel_requirements(wheel, ("torch", "flashinfer-python", "av"))
    assert got == ["Sentencepiece==0.2.1"]
    assert requirement_name("flashinfer_python[cu13]==0.7.2") == "flashinfer-python"
