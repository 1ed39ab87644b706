"""The pure decisions (isolator/policy/): no fakes needed."""
