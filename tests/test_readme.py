"""The README's user-rule example and its tests run as written."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_rule_example_runs() -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    rule_blocks = [b for b in blocks if "SCALED_ADD" in b]
    assert len(rule_blocks) == 2, "the README shows a rule and its tests"
    namespace: dict = {}
    for block in rule_blocks:
        exec(compile(block, str(README), "exec"), namespace)  # noqa: S102 - our own README
    tests = [f for name, f in namespace.items() if name.startswith("test_")]
    assert len(tests) == 2
    for test in tests:
        test()
