"""``ddp-hpc cluster probe|check|which``: from parsed arguments to the probe, the check and
the match, and their lines. The CLI (``cli.py``) only parses."""

from __future__ import annotations

import argparse
import getpass
import os
import sys
from pathlib import Path
from typing import Any

import yaml

from ddp_hpc.cli_args import Parser
from ddp_hpc.config_loader import ConfigError, build
from ddp_hpc.contract import ExitStatus, atomic_write
from ddp_hpc.schedulers import registry
from ddp_hpc.schedulers.cluster.check import check_profile
from ddp_hpc.schedulers.cluster.probe import probe, profile_text
from ddp_hpc.schedulers.cluster.which import this_machine
from ddp_hpc.schedulers.facts import ClusterFacts, run_readonly
from ddp_hpc.specs.profiles import ClusterProfile, find_profile, load_profile, matching_profiles
from ddp_hpc.specs.request import parse_walltime


def read_facts(family: str) -> ClusterFacts:
    return registry.reader(family).read_cluster(run_readonly, getpass.getuser())


def cmd_probe(args: argparse.Namespace) -> int:
    text = profile_text(probe(args.scheduler, run_readonly, user=getpass.getuser(), environ=os.environ))
    try:  # what the probe writes must load as every profile does
        build(ClusterProfile, yaml.safe_load(text), path="")
    except (ConfigError, TypeError) as exc:
        raise AssertionError(f"cluster probe wrote a profile that does not load: {exc}\n{text}") from None
    if not args.out:
        sys.stdout.write(text)
        return 0
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    atomic_write(Path(args.out), text)
    sys.stderr.write(f"ddp-hpc: cluster probe: wrote {args.out} (check it: ddp-hpc cluster check {args.out})\n")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    profile = load_profile(args.profile)
    hours, minutes, seconds = (int(part) for part in parse_walltime(args.walltime)[0].split(":"))
    walltime_s = hours * 3600 + minutes * 60 + seconds
    result = check_profile(profile, read_facts(profile.scheduler), walltime_s=walltime_s, nodes=args.nodes)
    for note in result.notes:
        sys.stdout.write(f"note: {note}\n")
    for line in result.mismatches:
        sys.stderr.write(f"ddp-hpc: cluster check: {profile.name}: {line}\n")
    if result.mismatches:
        return ExitStatus.USAGE
    sys.stdout.write(f"{profile.name} ({profile.path}): fits this cluster\n")
    return 0


def cmd_which(args: argparse.Namespace) -> int:
    fixed = registry.default_profile(args.scheduler) if args.scheduler else None
    if fixed:  # local: this machine, nothing to match
        profile = load_profile(fixed)
        sys.stdout.write(f"{profile.name} ({profile.path}): {args.scheduler} always uses it\n")
        return 0
    machine = this_machine()
    find_profile(machine, args.scheduler)  # none: its one line
    (first, why), *others = matching_profiles(machine, args.scheduler)
    sys.stdout.write(f"{first.name} ({first.path}): {why}\n")
    for profile, reason in others:
        sys.stdout.write(f"  also fits, not used: {profile.name} ({profile.path}): {reason}\n")
    return 0


def add_cluster_parser(sub: Any, common: argparse.ArgumentParser) -> None:

    cluster = sub.add_parser("cluster", help="a cluster profile from the scheduler (probe), checked against it "
                                             "(check), or found for this machine (which)")
    steps = cluster.add_subparsers(dest="cluster_step", metavar="STEP", parser_class=Parser)
    steps.required = True
    probe = steps.add_parser("probe", parents=[common],
                             help="ask the scheduler (and, inside a job, the node) and write a commented profile; "
                                  "read-only, submits nothing")
    probe.add_argument("--scheduler", choices=tuple(registry.readers()), help="default: the one that answers")
    probe.add_argument("--out", metavar="FILE", help="the profile to write (default: stdout), e.g. "
                                                     "configs/clusters/NAME.yaml")
    probe.set_defaults(func=cmd_probe)
    check = steps.add_parser("check", parents=[common],
                             help="the profile against the cluster: one line per mismatch, exit 2 on any")
    check.add_argument("profile", metavar="PROFILE", help="a profile name or YAML path")
    check.add_argument("--walltime", "--time", dest="walltime", default="01:00:00",
                       help="the walltime to check against the partition's limit (default: 01:00:00)")
    check.add_argument("--nodes", type=int, default=1, help="the nodes to check against the partition's (default: 1)")
    check.set_defaults(func=cmd_check)
    which = steps.add_parser("which", parents=[common],
                             help="the profile render/submit use here without --cluster, and why")
    which.add_argument("--scheduler", choices=tuple(registry.families()), help="only profiles of this family")
    which.set_defaults(func=cmd_which)
