"""The id ``sacct``, ``scontrol`` and ``scancel`` know a SLURM job by: ``ID``, or
``ARRAYID_INDEX`` for an element of an array job (a sweep). One home for the three places
that need it: the rendered script (exit file, pre-flight), the submitit task inside the job,
and the submit side's record of each element."""

from __future__ import annotations

from collections.abc import Mapping

JOB_ID_VAR = "SLURM_JOB_ID"
ARRAY_JOB_ID_VAR = "SLURM_ARRAY_JOB_ID"
ARRAY_TASK_ID_VAR = "SLURM_ARRAY_TASK_ID"


def element_key(array_job_id: str, index: int | str) -> str:
    """An array job's element: ``104_3``."""
    return f"{array_job_id}_{index}"


def script_job_key(array: bool) -> str:
    """The job key as a batch script's shell expands it."""
    if array:
        return element_key(f"${{{ARRAY_JOB_ID_VAR}}}", f"${{{ARRAY_TASK_ID_VAR}}}")
    return f"${{{JOB_ID_VAR}}}"


def job_key(environ: Mapping[str, str]) -> str:
    """The job key inside a running job, from its variables ("" outside a SLURM job)."""
    if environ.get(ARRAY_JOB_ID_VAR):
        return element_key(environ[ARRAY_JOB_ID_VAR], environ.get(ARRAY_TASK_ID_VAR, ""))
    return environ.get(JOB_ID_VAR, "")
