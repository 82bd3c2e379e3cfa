"""docs/megatron_flags.md lists every flag the parser knows, in the right table, with the
right counts."""

import os
import re

from megatron.training.arguments import build_parser
from megatron.training.megatron_compat import MAPPED, REJECTED

DOC = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, os.pardir, "docs", "megatron_flags.md")


def _tables():
    sections, current = {}, None
    for line in open(DOC).read().splitlines():
        if line.startswith("## "):
            current = sections.setdefault(line[3:].strip(), set())
        elif current is not None and line.startswith("| `"):
            current.update(re.findall(r"`(--[^`]+)`", line.split("|")[1]))
    return sections


def test_every_flag_is_in_its_table():
    tables = _tables()
    parser_flags = {s for a in build_parser()._actions for s in a.option_strings if s.startswith("--")}
    documented = set().union(*tables.values())
    assert parser_flags - {"--help"} <= documented, sorted(parser_flags - documented)
    assert set(MAPPED) <= tables["Mapped"]
    assert set(REJECTED) == tables["Rejected"]
    assert not (tables["Honoured"] & (tables["Mapped"] | tables["Rejected"]))
    text = open(DOC).read()
    honoured = len([line for line in text.split("## Honoured")[1].split("## Mapped")[0].splitlines()
                    if line.startswith("| `")])
    assert (f"**{honoured} honoured**, **{len(MAPPED)} mapped**" in text
            and f"**{len(REJECTED)} rejected**" in text)
