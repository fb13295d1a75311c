"""The C++ CPU kernels build once per content, not per checkout; a process that finds one built loads it without
the build tool; a builder killed mid-build leaves nothing that makes the next one wait: builders serialize on an
flock that dies with its holder."""

import fcntl
import os
import shutil
import subprocess
import sys

import pytest

from kvloom.kernels import cpu_extensions

NAME = "kvloom_cpu_pool"  # the smallest source: where a build runs again (another checkout's venv in its
# command line, as a CI clone beside the working tree has), it compiles in seconds


def test_the_build_folder_follows_the_sources_content_not_their_path(tmp_path, monkeypatch):
    here = cpu_extensions.build_dir_for(NAME)
    checkout = tmp_path / "other-checkout"
    shutil.copytree(cpu_extensions.HERE, checkout, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(cpu_extensions, "HERE", checkout)
    assert cpu_extensions.build_dir_for(NAME) == here
    (checkout / "cpu_math.h").write_text((checkout / "cpu_math.h").read_text() + "\n// changed\n")
    assert cpu_extensions.build_dir_for(NAME) != here


def build_in_a_fresh_process(**kwargs) -> subprocess.Popen:
    """The set-up step's build of one kernel; in its own process, since loading the ops library twice into one
    aborts."""
    return subprocess.Popen([sys.executable, "-m", "kvloom.kernels.cpu_extensions", NAME], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **kwargs)


@pytest.fixture
def unlinked():
    """The kernel's build folder as a builder finds it before the link: its library moved aside (and put back
    if no build made it again), so that a builder runs the build tool (a relink: the object file is there)."""
    build_dir = cpu_extensions.build_dir_for(NAME)
    library = build_dir / f"{NAME}.so"
    aside = build_dir / f"{NAME}.so.aside"
    library.rename(aside)
    try:
        yield build_dir
    finally:
        if library.exists():
            aside.unlink()
        else:
            aside.rename(library)


def test_a_built_kernel_loads_without_running_the_build_tool():
    """A replica's start: the library is there, so no ninja run (about a second a kernel); here no ninja at all."""
    assert (cpu_extensions.build_dir_for(NAME) / f"{NAME}.so").exists()
    no_build_tool = {**os.environ, "PATH": "/nonexistent"}
    output, _ = build_in_a_fresh_process(env=no_build_tool).communicate(timeout=120)
    assert f"{NAME} ready" in output, output


def test_a_killed_builders_torch_lock_does_not_block_the_next_build(unlinked):
    build_dir = unlinked
    (build_dir / "lock").write_text("")  # what torch's loader leaves when its process is killed mid-build
    output, _ = build_in_a_fresh_process().communicate(timeout=120)  # torch's loader alone would wait 10 min
    assert f"{NAME} ready" in output
    assert not (build_dir / "lock").exists()


def test_a_builder_waits_for_another_and_says_so(unlinked):
    build_dir = unlinked
    with (build_dir / "kvloom.lock").open("w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        builder = build_in_a_fresh_process()
        said = next(line for line in builder.stdout if "waiting for another process building" in line)
        assert builder.poll() is None  # held by "another process": this test
        fcntl.flock(held, fcntl.LOCK_UN)
        output, _ = builder.communicate(timeout=120)
    assert builder.returncode == 0 and "the CPU kernel" in said
    assert f"{NAME} ready" in output
