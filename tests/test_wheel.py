"""A non-editable install works like the checkout: built as a wheel, installed into a fresh
venv, run from an empty folder outside the repository."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from conftest import REPO, run

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh venv holding only the built wheel; torch and the other dependencies are
    borrowed from the test interpreter's site-packages (installing torch again costs a
    minute and the point here is what the wheel itself ships)."""
    root = tmp_path_factory.mktemp("wheel")
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            str(REPO), "-w", str(root / "dist")], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr
    [wheel] = (root / "dist").glob("ddp_hpc-*.whl")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = next((venv / "lib").glob("python3*/site-packages"))
    # A plain path entry: the test venv's own .pth files (its editable ddp_hpc) are not read.
    (site / "borrowed.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    install = subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install",
                              "--no-deps", "-q", str(wheel)], capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr
    return venv


def in_venv(venv: Path, args: list[str], cwd: Path, timeout: float = 300):
    return run([str(venv / "bin" / args[0]), *args[1:]], cwd=cwd, timeout=timeout,
               env={"PATH": f"{venv / 'bin'}:/usr/bin:/bin"})


def test_the_wheel_is_what_runs_and_ships_no_top_level_jobs(installed, tmp_path):
    where = in_venv(installed, ["python", "-c", "import ddp_hpc; print(ddp_hpc.__file__)"], tmp_path)
    assert where.stdout.startswith(str(installed)), where.stdout + where.stderr
    jobs = in_venv(installed, ["python", "-c", "import jobs"], tmp_path)
    assert jobs.returncode != 0 and "No module named 'jobs'" in jobs.stderr


def test_render_with_a_shipped_profile_from_an_empty_folder(installed, tmp_path):
    result = in_venv(installed, ["ddp-hpc", "render", "pbs", "--cluster", "aurora", "--nodes", "2", "--no-venv",
                                 "--", "python", "train.py"], tmp_path)
    assert result.returncode == 0, result.stderr
    assert "#PBS -l select=2" in result.stdout, result.stdout
    [launch] = [line for line in result.stdout.splitlines() if line.startswith("exec ddp-hpc launch ")]
    assert launch.startswith("exec ddp-hpc launch --launcher pals ") and launch.endswith(
        " -- ddp-hpc run -- python train.py"), launch


def test_train_the_built_in_digits_job_and_run_a_command(installed, tmp_path):
    trained = in_venv(installed, ["ddp-hpc", "train", "training.epochs=2", "logging.progress=never"], tmp_path)
    assert trained.returncode == 0, trained.stderr[-2000:]
    assert (tmp_path / "runs" / "run" / "summary.json").exists()
    shim = in_venv(installed, ["ddp-hpc", "run", "--", "python", "-c",
                               "import os; print(os.environ['RANK'], os.environ['WORLD_SIZE'])"], tmp_path)
    assert shim.returncode == 0 and shim.stdout.split() == ["0", "1"], shim.stderr
