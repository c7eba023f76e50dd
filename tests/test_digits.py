"""The embedded default job's data: scikit-learn's digits, read without importing scikit-learn."""

from __future__ import annotations

import subprocess
import sys

from conftest import clean_env, require_module

CHECK = """
import sys
import numpy as np
from ddp_hpc.builtin_jobs.digits import DigitsJob, bundled_digits

images, target = bundled_digits()
datasets = DigitsJob().build_datasets()
assert "sklearn" not in sys.modules, "reading the digits imported scikit-learn"
assert len(datasets.train) + len(datasets.val) + len(datasets.test) == 1797

from sklearn.datasets import load_digits
digits = load_digits()
assert images.dtype == digits.images.dtype and target.dtype == digits.target.dtype, (images.dtype, target.dtype)
assert np.array_equal(images, digits.images) and np.array_equal(target, digits.target)
print("same")
"""


def test_the_digits_are_scikit_learns_exactly_and_reading_them_does_not_import_it():
    require_module("sklearn", "examples")
    result = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120,
                            env=clean_env())
    assert result.returncode == 0 and result.stdout.strip() == "same", result.stderr[-2000:]
