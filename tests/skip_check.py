"""CI's check of the suite's skips (.ci/run): a test may skip only for what the machine cannot have or what a
user opts into, never because something it should test is missing (a dependency, a tool, root, a cluster):
that would pass `make test` with the regression hidden. Every skip in a pytest JUnit XML report
(--junitxml) must match ALLOWED; the skips are printed by reason, and those not allowed fail the run.

    python tests/skip_check.py REPORT.xml
"""

from __future__ import annotations

import ast
import re
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

# (test id pattern, reason pattern, why such a skip hides nothing); tests/project/test_skip_check.py holds
# each to the skips it is for
ALLOWED = [
    (r"", r"^needs CUDA$|^needs a machine without CUDA$",
     "each check has a CUDA and a CPU variant, and one of them runs"),
    (r"", r"set KIMI_NETWORK_TESTS=1", "downloads from the network, which CI does not reach"),
    (r"", r"set KIMI_SLOW_TESTS=1",
     "the full compile sweeps and inductor's sublayers: their quick versions run"),
    (r"^tests\.project\.test_readme::test_readme_command_runs\[", r"^(README|docs/[\w-]+)\.md: ",
     "a documented command in tests/project/test_readme.py's SKIPPED, each with its reason and where it is "
     "tested"),
    (r"", r"^triton is a dependency on Linux only$", "no Triton kernels to test elsewhere"),
]


def skips(report: Path) -> list[tuple[str, str]]:
    """(test id, reason) of every skip in a JUnit XML report: the id as `tests.area.test_x::test_y[param]`,
    or `tests.area.test_x` for a module skipped whole."""
    out = []
    for case in ET.parse(report).getroot().iter("testcase"):
        skipped = case.find("skipped")
        if skipped is None or skipped.get("type") == "pytest.xfail":
            continue
        test = "::".join(part for part in (case.get("classname"), case.get("name")) if part)
        reason = skipped.get("message", "")
        if reason == "collection skipped":  # the text is repr((path, line, "Skipped: reason"))
            reason = ast.literal_eval(skipped.text)[2].removeprefix("Skipped: ")
        out.append((test, reason))
    return out


def unexpected(found: list[tuple[str, str]]) -> list[tuple[str, str]]:
    return [(test, reason) for test, reason in found
            if not any(re.search(t, test) and re.search(r, reason) for t, r, _ in ALLOWED)]


def main(report: Path) -> int:
    found = skips(report)
    for reason, n in Counter(reason for _, reason in found).most_common():
        print(f"[skip_check] {n:3d} skipped: {reason}")
    bad = unexpected(found)
    for test, reason in bad:
        print(f"[skip_check] NOT ALLOWED: {test}: {reason}", file=sys.stderr)
    if bad:
        print(f"[skip_check] {len(bad)} test(s) skipped for a reason not in tests/skip_check.py ALLOWED: "
              "make them run here (install what they need), or add the reason there with why it hides "
              "nothing", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
