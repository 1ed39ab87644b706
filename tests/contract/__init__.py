"""The ports' contract suite: each shipped fake and its real edge pass the same tests."""
