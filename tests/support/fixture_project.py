"""A small package with its own tests, for the task-mining tests (the tests write it)."""

import textwrap

PACKAGE = textwrap.dedent('''\
    """A tiny arithmetic package."""


    def clamp(x, lo, hi):
        if x < lo:
            return lo
        if x > hi:
            return hi
        return x


    def mean(xs):
        total = 0
        for x in xs:
            total += x
        return total / len(xs)


    def count_up(n):
        i = 0
        while i < n:
            i = i + 1
        return i


    def is_even(n):
        return n % 2 == 0 and True


    def span(a, b):
        return clamp(b - a, 0, 100)


    def never_called(x):
        return x * 2 + 1
''')

TESTS = textwrap.dedent('''\
    from calc import clamp, count_up, is_even, mean, span


    def test_clamp():
        assert clamp(5, 0, 10) == 5
        assert clamp(-1, 0, 10) == 0
        assert clamp(11, 0, 10) == 10


    def test_clamp_edges():
        assert clamp(0, 0, 10) == 0
        assert clamp(10, 0, 10) == 10


    def test_mean():
        assert mean([1, 2, 3, 6]) == 3


    def test_count_up():
        assert count_up(3) == 3


    def test_is_even():
        assert is_even(4) and not is_even(3)


    def test_span():
        assert span(2, 7) == 5 and span(7, 2) == 0
''')


def write(root):
    """Lay the project out under `root` (a pathlib.Path): calc/__init__.py, tests/test_calc.py."""
    (root / "calc").mkdir(parents=True)
    (root / "tests").mkdir()
    (root / "calc" / "__init__.py").write_text(PACKAGE)
    (root / "tests" / "test_calc.py").write_text(TESTS)
    return root
