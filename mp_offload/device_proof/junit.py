"""Stage 2's verdict from pytest's JUnit XML (``--junitxml``): counts and passed names."""

from __future__ import annotations

import xml.etree.ElementTree as ET


def junit_counts(xml_text: str) -> dict:
    """tests, passed, failed (failures + errors), skipped, and the passed test ids."""
    root = ET.fromstring(xml_text)
    passed, failed, skipped = [], [], 0
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '')}.{case.get('name', '')}"
        kinds = {child.tag for child in case}
        if kinds & {"failure", "error"}:
            failed.append(name)
        elif "skipped" in kinds:
            skipped += 1
        else:
            passed.append(name)
    return dict(
        tests=len(passed) + len(failed) + skipped,
        passed=len(passed),
        failed=len(failed),
        skipped=skipped,
        passed_names=passed,
        failed_names=failed,
    )
