"""Environment variables as real launchers set them, for table-driven resolver tests.

Recorded on this project's Debian test machine (2026-11-22) unless marked otherwise:
torchrun from torch 2.13.0, Open MPI 4.1.4 ``mpiexec``, MPICH 4.0.2 Hydra ``mpiexec.mpich``,
SLURM 22.05.8 ``srun -N2 -n4`` on the two-node test cluster and an ``sbatch -N2
--ntasks-per-node=2`` batch script. Cray PALS (Aurora), Intel MPI and MVAPICH2 sets are
taken from their documentation (ALCF's Aurora job-launch pages, Intel MPI's Hydra
reference, the MVAPICH2 user guide); they cannot be launched here.
Irrelevant variables (PATH, OMPI_MCA_* plumbing, file descriptors) are left out.
"""

from __future__ import annotations

# --- recorded here -------------------------------------------------------------------

TORCHRUN_RANK1 = {
    "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "localhost", "MASTER_PORT": "45891", "RANK": "1", "ROLE_NAME": "default",
    "ROLE_RANK": "1", "ROLE_WORLD_SIZE": "2", "TORCHELASTIC_MAX_RESTARTS": "0",
    "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_RUN_ID": "3860f45c-1456-47f0-a05f-c364e24064d8",
    "TORCHELASTIC_USE_AGENT_STORE": "True", "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1",
}

OPENMPI_RANK1 = {
    "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    "OMPI_COMM_WORLD_NODE_RANK": "1", "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
    "OMPI_FIRST_RANKS": "0", "OMPI_NUM_APP_CTX": "1", "OMPI_UNIVERSE_SIZE": "2",
    "PMIX_ID": "1637548033.1", "PMIX_NAMESPACE": "1637548033", "PMIX_RANK": "1",
}

MPICH_RANK1 = {
    "MPI_LOCALNRANKS": "2", "MPI_LOCALRANKID": "1", "PMI_FD": "8", "PMI_RANK": "1", "PMI_SIZE": "2",
    "MPIR_CVAR_CH3_INTERFACE_HOSTNAME": "vm",
}

# srun -N2 -n4: SLURM placed 3 tasks on n1 and 1 on n2; this is task 3, alone on n2.
SRUN_RANK3 = {
    "SLURM_CPUS_ON_NODE": "1", "SLURM_GTIDS": "3", "SLURM_JOBID": "1", "SLURM_JOB_ID": "1",
    "SLURM_JOB_NAME": "dumpslurm.sh", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_NUM_NODES": "2",
    "SLURM_LAUNCH_NODE_IPADDR": "127.0.0.1", "SLURM_LOCALID": "0", "SLURM_NNODES": "2",
    "SLURM_NODEID": "1", "SLURM_NODELIST": "n[1-2]", "SLURM_NPROCS": "4", "SLURM_NTASKS": "4",
    "SLURM_PROCID": "3", "SLURM_SRUN_COMM_HOST": "127.0.0.1", "SLURM_STEPID": "0",
    "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_STEP_NUM_NODES": "2",
    "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_TASKS_PER_NODE": "3,1", "SLURM_TASKS_PER_NODE": "3,1",
    "SLURM_TOPOLOGY_ADDR": "n2",
}
SRUN_RANK2 = {**SRUN_RANK3, "SLURM_CPUS_ON_NODE": "3", "SLURM_GTIDS": "0,1,2", "SLURM_LOCALID": "2",
              "SLURM_NODEID": "0", "SLURM_PROCID": "2", "SLURM_TOPOLOGY_ADDR": "n1"}

# The shell of an sbatch script: job variables, SLURM_PROCID=0, but no step.
SBATCH_SHELL = {
    "SLURM_CPUS_ON_NODE": "2", "SLURM_GTIDS": "0", "SLURM_JOBID": "2", "SLURM_JOB_ID": "2",
    "SLURM_JOB_NAME": "b.sh", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_NUM_NODES": "2",
    "SLURM_LOCALID": "0", "SLURM_NNODES": "2", "SLURM_NODEID": "0", "SLURM_NODELIST": "n[1-2]",
    "SLURM_NPROCS": "4", "SLURM_NTASKS": "4", "SLURM_PROCID": "0", "SLURM_TASKS_PER_NODE": "2(x2)",
    "SLURM_TOPOLOGY_ADDR": "n1",
}

# Open MPI's mpiexec inside that sbatch script: it starts its daemons as a SLURM step, so
# every rank carries SLURM_PROCID=0 of a 2-task step besides its own OMPI rank.
OPENMPI_IN_SBATCH_RANK1 = {
    **SBATCH_SHELL, "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
    "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "1",
    "PMIX_NAMESPACE": "3287547905", "SLURM_LAUNCH_NODE_IPADDR": "127.0.0.1", "SLURM_NPROCS": "2",
    "SLURM_NTASKS": "2", "SLURM_SRUN_COMM_HOST": "127.0.0.1", "SLURM_STEPID": "0",
    "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_STEP_NUM_NODES": "2",
    "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURM_TASKS_PER_NODE": "1(x2)",
}

# torchrun started once per node by srun (the multi-node torchrun pattern): the SLURM
# task is the node's agent (task 1 = node 1); the worker is global rank 3 of 4.
TORCHRUN_UNDER_SRUN_RANK3 = {
    **SRUN_RANK3, "SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
    "TORCHELASTIC_RUN_ID": "4242", "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2",
    "MASTER_ADDR": "n1", "MASTER_PORT": "29400",
}

# --- from documentation ----------------------------------------------------------------

# Aurora: mpiexec -n 24 -ppn 12 (PALS) in a 2-node PBS job; rank 13 = node 1, tile 1.
PALS_AURORA_RANK13 = {
    "PALS_APID": "8a2b1f7e-5c1d-4f0e-9a6b-3f1d2e4c5b6a", "PALS_DEPTH": "8",
    "PALS_LOCAL_RANKID": "1", "PALS_LOCAL_SIZE": "12", "PALS_NODEID": "1", "PALS_RANKID": "13",
    "PMIX_RANK": "13", "PMI_LOCAL_RANK": "1", "PMI_LOCAL_SIZE": "12", "PMI_RANK": "13",
    "PMI_SIZE": "24", "PBS_JOBID": "1234567.aurora-pbs-0001.hostmgmt.cm.aurora.alcf.anl.gov",
}

# Intel MPI (Hydra): mpiexec -n 8 -ppn 4, rank 6 on the second node.
INTEL_MPI_RANK6 = {
    "PMI_RANK": "6", "PMI_SIZE": "8", "MPI_LOCALRANKID": "2", "MPI_LOCALNRANKS": "4",
    "I_MPI_ROOT": "/opt/intel/oneapi/mpi/2021.13", "I_MPI_HYDRA_TOPOLIB": "hwloc",
}

# MVAPICH2 mpirun_rsh -np 4 (2 per node): rank 2 is the first rank of node 1.
MVAPICH_RANK2 = {
    "MV2_COMM_WORLD_RANK": "2", "MV2_COMM_WORLD_SIZE": "4", "MV2_COMM_WORLD_LOCAL_RANK": "0",
    "MV2_COMM_WORLD_LOCAL_SIZE": "2", "MPIRUN_RANK": "2",
}
