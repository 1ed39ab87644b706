"""The core (isolator/core/), in-process over the shipped fakes."""
