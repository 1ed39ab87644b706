"""Where things are, for tests at any depth below tests/: the repository, tests/ and tests/data/."""

import os

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
DATA = os.path.join(TESTS, "data")
