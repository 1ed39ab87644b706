"""Test doubles shipped with the package, for our tests and for projects built on this one.

``StubService`` stands in for the whole service behind the servers.
"""

from isolator.testing.stub import StubService

__all__ = ["StubService"]
