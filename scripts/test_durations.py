"""Write tests/durations.json (seconds per test file, the root conftest.py's order for
a parallel run) from the JUnit XML of a whole-suite run:

    scripts/test.sh --junitxml=/tmp/suite.xml && python3 scripts/test_durations.py /tmp/suite.xml

A file's figure is the sum of its tests' times (set-up and tear-down included).
More XML files (e.g. the lowest-versions run's) only add files not measured before.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "tests" / "durations.json"


def test_file(classname: str) -> str:
    """The file a JUnit classname (a node id's path, dots for slashes) names."""
    parts = classname.split(".")
    for i in range(len(parts), 0, -1):
        if (REPO / "/".join(parts[:i])).with_suffix(".py").is_file():
            return "/".join(parts[:i]) + ".py"
        if i > 1 and (REPO / "/".join(parts[: i - 1])).with_suffix(f".{parts[i - 1]}").is_file():
            return "/".join(parts[: i - 1]) + "." + parts[i - 1]  # README.md, docs/x.md
    raise SystemExit(f"no test file for {classname!r}")


def main(paths: list[str]) -> None:
    seconds: Counter[str] = Counter()
    for path in paths:
        found: Counter[str] = Counter()
        for case in ET.parse(path).getroot().iter("testcase"):
            found[test_file(case.get("classname", ""))] += float(case.get("time", 0))
        for name, took in found.items():
            seconds.setdefault(name, took)
    data = {name: round(took) for name, took in sorted(seconds.items())}
    OUT.write_text(json.dumps(data, indent=0) + "\n")
    print(f"{OUT.relative_to(REPO)}: {len(data)} files, {sum(data.values())} s in all")


if __name__ == "__main__":
    main(sys.argv[1:])
