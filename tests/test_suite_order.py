"""The suite's own order (conftest.py long_tests_first): each worker's half starts with its long tests."""

from pathlib import Path
from types import SimpleNamespace

from tests.conftest import LONG_GROUPS, long_tests_first


def _items(*names):
    return [SimpleNamespace(path=Path("tests") / name, n=i) for i, name in enumerate(names)]


def test_each_half_of_the_queue_starts_with_its_long_group_and_keeps_every_test_once():
    first, second = LONG_GROUPS[0][0], LONG_GROUPS[1][0]
    items = _items("test_a.py", first, "test_b.py", second, first, "test_c.py", "test_d.py", "test_e.py")
    ordered = long_tests_first(items)
    assert sorted(i.n for i in ordered) == list(range(8))  # every test, once
    names = [i.path.name for i in ordered]
    # 8 tests: worksteal's two halves of 4, each its long tests first, then short ones in their collection order
    assert names == [first, first, "test_a.py", "test_b.py", second, "test_c.py", "test_d.py", "test_e.py"]
    assert [i.n for i in ordered if i.path.name == first] == [1, 4]  # a module's tests keep their order
    # more long tests of group 1 than half the suite: the short tests all follow group 2
    many = _items(first, first, first, "test_a.py", second)
    assert [i.path.name for i in long_tests_first(many)] == [first, first, first, second, "test_a.py"]


def test_the_long_groups_name_modules_that_exist():
    here = Path(__file__).parent
    assert all((here / name).is_file() for group in LONG_GROUPS for name in group)
