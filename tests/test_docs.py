"""The user docs keep up with the code."""

from __future__ import annotations

import dataclasses
import typing

from conftest import REPO
from ddp_hpc.config import Config
from ddp_hpc.config_loader import config_key


def config_keys(cls=Config, prefix=""):
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[field.name]):
            yield from config_keys(hints[field.name], f"{prefix}{config_key(field)}.")
        else:
            yield f"{prefix}{config_key(field)}"


def test_every_config_key_is_documented():
    guide = (REPO / "docs" / "training.md").read_text()
    missing = [key for key in config_keys() if f"`{key}`" not in guide]
    assert missing == []


def test_readme_links_resolve():
    import re
    readme = (REPO / "README.md").read_text()
    for target in re.findall(r"\]\(([^)#]+)\)", readme):
        assert (REPO / target).exists(), target


def test_every_render_and_submit_flag_is_documented():
    from ddp_hpc.cli import build_parser

    guide = (REPO / "docs" / "clusters.md").read_text()
    parser = build_parser()
    verbs = next(a for a in parser._actions if a.dest == "command_name").choices
    missing = set()
    for verb in ("render", "submit"):
        schedulers = next(a for a in verbs[verb]._actions if a.dest == "scheduler").choices
        for scheduler_parser in schedulers.values():
            for action in scheduler_parser._actions:
                for flag in action.option_strings:
                    if flag.startswith("--") and flag not in ("--help", "--debug", "--verbose") \
                            and f"`{flag}" not in guide:
                        missing.add(flag)
    assert missing == set()


def test_api_docs_show_the_whole_own_loop_script_as_it_is():
    """docs/api.md's "Your own loop" shows examples/resumable_loop.py whole, from the
    docstring's end on: a user copies a script that runs, not a diff against another file."""
    text = (REPO / "examples" / "resumable_loop.py").read_text()
    guide = (REPO / "docs" / "api.md").read_text()
    shown = guide.split("## Your own loop", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    assert shown == text[text.index('"""', 3) + 3:].lstrip("\n")
