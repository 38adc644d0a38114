"""What the package index gets: a wheel built by the README's command and the sdist, read back.

The wheel is built with ``maturin`` (in the test extra) into a temporary folder; with the
``target/`` folder of an earlier build it takes seconds, from scratch a release build of the
extension. Both need a Rust toolchain, like the install itself.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sysconfig
import tarfile
import zipfile
from email.message import Message
from email.parser import Parser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _maturin() -> list[str]:
    if shutil.which("cargo") is None:
        pytest.skip("building needs a Rust toolchain (cargo)")
    if shutil.which("maturin") is not None:
        return ["maturin"]
    pytest.skip("maturin is not installed (it is in the test extra)")


def _documented_wheel_command() -> list[str]:
    """The README's wheel command, as words."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("## Building a wheel") :]
    line = next(line for line in section.splitlines() if line.startswith("maturin build"))
    return shlex.split(line)


def _metadata(text: str) -> Message:
    return Parser().parsestr(text)


def _check_metadata(metadata: Message) -> None:
    assert metadata["Name"] == "helix_kv"
    assert metadata["Metadata-Version"] == "2.4"
    assert metadata["License-Expression"] == "Apache-2.0"
    assert metadata.get_all("License-File") == ["LICENSE"]
    assert metadata["License"] is None  # the expression replaces the free-text field
    classifiers = metadata.get_all("Classifier")
    assert "Typing :: Typed" in classifiers
    assert "Programming Language :: Rust" in classifiers
    assert not [c for c in classifiers if c.startswith("License ::")]  # PEP 639 forbids both
    requires = metadata.get_all("Requires-Dist")
    assert "numpy>=1.22" in requires
    test_extra = [r.split(";")[0].strip() for r in requires if "extra == 'test'" in r]
    for package in ("torch", "matplotlib", "pytest", "hypothesis", "maturin"):
        assert any(r.startswith(package) for r in test_extra), package
    assert metadata["Requires-Python"] == ">=3.9"
    # no placeholder addresses: only real project URLs, and today there are none
    for url in metadata.get_all("Project-URL") or []:
        assert "example" not in url, url
        assert ".invalid" not in url, url
    assert metadata.get_payload().lstrip().startswith("# helix_kv")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    maturin = _maturin()
    command = _documented_wheel_command()
    assert command[:3] == ["maturin", "build", "--release"]
    out = tmp_path_factory.mktemp("wheel")
    index = command.index("-o")
    command[index + 1] = str(out)
    done = subprocess.run(
        [*maturin, *command[1:]], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (built,) = out.glob("*.whl")
    return built


@pytest.fixture(scope="module")
def sdist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("sdist")
    done = subprocess.run(
        [*_maturin(), "sdist", "-o", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (built,) = out.glob("*.tar.gz")
    return built


def test_wheel_metadata(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        (metadata_name,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        metadata = _metadata(archive.read(metadata_name).decode())
        entry_points = archive.read(metadata_name.replace("METADATA", "entry_points.txt"))
    _check_metadata(metadata)
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    for name in ("helix_kv/py.typed", "helix_kv/_core.pyi", "helix_kv/__main__.py"):
        assert name in names
    assert "helix-kv=helix_kv.cli:main" in entry_points.decode().replace(" ", "")


def test_wheel_is_abi3_with_a_manylinux_tag(wheel: Path) -> None:
    name, _version, python, abi, platform = wheel.stem.split("-")
    assert (name, python, abi) == ("helix_kv", "cp39", "abi3")
    if sysconfig.get_platform().startswith("linux") and "musl" not in sysconfig.get_config_var(
        "HOST_GNU_TYPE"
    ):
        assert re.fullmatch(r"manylinux_\d+_\d+_\w+(\.manylinux\w+)*", platform), platform


def test_sdist_carries_the_license_tests_and_docs(sdist: Path) -> None:
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
        info = archive.extractfile(next(n for n in archive.getnames() if n.endswith("PKG-INFO")))
        assert info is not None
        metadata = _metadata(info.read().decode())
    _check_metadata(metadata)
    for required in (
        "LICENSE",
        "README.md",
        "pyproject.toml",
        "Cargo.lock",
        "tests/__init__.py",  # the test folders are packages: their helpers import by name
        "tests/helpers/harness.py",
        "tests/test_cli.py",
        "tests/test_package_metadata.py",
        "tests/distributed/test_dist_group.py",
        "docs/user-guide.md",
        "docs/internals/scheduler.md",
        "benches/bench_scheduler.py",
        "python/helix_kv/py.typed",
        "rust/core/src/ledger.rs",
    ):
        assert required in names, required
    assert not [n for n in names if "__pycache__" in n or n.endswith(".so")]


def test_license_is_apache_2() -> None:
    text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    assert "END OF TERMS AND CONDITIONS" in text
    cargo = (ROOT / "Cargo.toml").read_text(encoding="utf-8")
    assert 'license = "Apache-2.0"' in cargo
