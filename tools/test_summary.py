"""Prints one line "N passed, N failed, N skipped" for a `bazel test` run.

Counts test cases, not targets: pytest targets write JUnit XML (tools/pytest_main.py), Bazel
writes one case for every other test. A target that did not pass (failed, timed out, failed
to build) counts its failing cases, at least one. Exits 1 when anything failed.
"""

import os
import re
import sys
import xml.etree.ElementTree as ET

_STATUS = re.compile(r"^(//\S+)\s+(?:\(cached\) )?(PASSED|FAILED|TIMEOUT|NO STATUS|FLAKY|"
                     r"FAILED TO BUILD|INCOMPLETE|SKIPPED)\b")


def _cases(xml_path):
    passed = failed = skipped = 0
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            failed += 1
        elif case.find("skipped") is not None:
            skipped += 1
        else:
            passed += 1
    return passed, failed, skipped


def main(log_path, testlogs):
    passed = failed = skipped = 0
    with open(log_path) as log:
        statuses = [m.groups() for m in map(_STATUS.match, log) if m]
    for target, status in statuses:
        xml = os.path.join(testlogs, target[2:].replace(":", "/"), "test.xml")
        p, f, s = _cases(xml) if os.path.exists(xml) else (0, 0, 0)
        if status == "PASSED":
            passed, failed, skipped = passed + p, failed + f, skipped + s
        else:
            print(f"not passed: {target} {status}")
            passed, failed, skipped = passed + p, failed + max(f, 1), skipped + s
    if not statuses:
        print("no test results found in the bazel log")
        failed += 1
    print(f"{passed} passed, {failed} failed, {skipped} skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
