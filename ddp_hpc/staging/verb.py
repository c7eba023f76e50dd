"""``ddp-hpc stage pack|fan-out``: the verb's parser and its two steps (the CLI adds it, ``cli.py``)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from ddp_hpc.cli_args import Parser, positive_float, write_line
from ddp_hpc.contract import HOST_SUFFIX_VAR, STAGE_ROOT_VAR, STAGE_TIME_IMPORT_VAR
from ddp_hpc.errors import UserError


def _cmd_stage_pack(args: argparse.Namespace) -> int:
    from ddp_hpc.staging import pack_environment

    packed = pack_environment(args.env, args.archive)
    action = "packed" if packed.written else "up to date:"
    write_line(sys.stderr, f"ddp-hpc: stage: {action} {packed.kind} {packed.prefix} -> {packed.archive} "
                           f"({packed.size_bytes / 1e6:.0f} MB)")
    write_line(sys.stdout, str(packed.archive))
    return 0


def _cmd_stage_fan_out(args: argparse.Namespace) -> int:
    from ddp_hpc.staging import compare_import, node_slot, stage_on_node

    root = args.root or os.environ.get(STAGE_ROOT_VAR)
    if not root:
        raise UserError(f"no node-local folder: give --root DIR or set ${STAGE_ROOT_VAR}")
    slot = node_slot(os.environ)
    suffix = os.environ.get(HOST_SUFFIX_VAR, "") if args.host_suffix is None else args.host_suffix
    copy = stage_on_node(args.archive, root, args.rendezvous, slot, host_suffix=suffix, timeout_s=args.timeout)
    write_line(sys.stdout, f"ddp_hpc: stage: node {slot.index}/{slot.count} ({slot.name}): {copy.path} from "
                           f"{copy.source}, {copy.size_bytes / 1e6:.0f} MB in {copy.seconds:.2f} s")
    modules = args.time_import or [m for m in os.environ.get(STAGE_TIME_IMPORT_VAR, "").split(",") if m]
    for module in modules:
        shared, staged = compare_import(copy, module)
        write_line(sys.stdout, f"ddp_hpc: stage: node {slot.name}: import {module}: {shared.seconds:.2f} s from the "
                               f"shared copy ({shared.module_file}), {staged.seconds:.2f} s from the node-local "
                               f"copy ({staged.module_file})")
    return 0


def add_stage_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    stage = sub.add_parser("stage", help="copy the Python environment to node-local disk on every node "
                                         "(--stage-env of render/submit does it for you)")
    steps = stage.add_subparsers(dest="stage_step", metavar="STEP", parser_class=Parser)
    steps.required = True
    pack = steps.add_parser("pack", parents=[common],
                            help="pack the environment once into a relocatable tar file; print its path")
    pack.add_argument("--env", help="the venv or conda environment (default: the active one)")
    pack.add_argument("--archive", help="the tar file (default: ~/.cache/ddp_hpc/stage/NAME-HASH.tar)")
    pack.set_defaults(func=_cmd_stage_pack)
    fan_out = steps.add_parser("fan-out", parents=[common],
                               help="run once per node (srun --ntasks-per-node=1, mpiexec -ppn 1): receive the "
                                    "archive from the parent node, send it on to two more, unpack it to ROOT/NODE")
    fan_out.add_argument("archive", help="the tar file from `ddp-hpc stage pack` (read by node 0 only)")
    fan_out.add_argument("--rendezvous", required=True, metavar="DIR",
                         help="a fresh folder on the shared file system where the nodes find each other")
    fan_out.add_argument("--root", help=f"node-local folder of the copies (default: ${STAGE_ROOT_VAR})")
    fan_out.add_argument("--timeout", type=positive_float, default=600.0,
                         help="seconds a node waits for its copy (default: 600)")
    fan_out.add_argument("--host-suffix", default=None,
                         help=f"suffix for this node's host name, e.g. a high-speed network's (default: "
                              f"${HOST_SUFFIX_VAR})")
    fan_out.add_argument("--time-import", action="append", default=[], metavar="MODULE",
                         help="then time `import MODULE` from the shared environment and from the copy (repeatable; "
                              f"default: ${STAGE_TIME_IMPORT_VAR}, comma-separated)")
    fan_out.set_defaults(func=_cmd_stage_fan_out)
