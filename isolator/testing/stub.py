"""``StubService``: a base for test doubles of the whole service that answers UNIMPLEMENTED.

Subclass it and override the methods a test needs (tests/system/test_bridge.py records what arrives).
Every other method is ``IsolatorApi``'s own (the one declaration of the hook API), which raises
``Unimplemented`` so the caller sees UNIMPLEMENTED, never a fake success: a hook added there is
stubbed here without a line written.
"""

from __future__ import annotations

from isolator.core.api import IsolatorApi
from isolator.model import GpuList, TopologyView


class StubService(IsolatorApi):
    # The two views a client reads before anything else answer "nothing here" instead.
    def list_gpus(self) -> GpuList:
        return GpuList(driver_version="", cuda_driver_version="")

    def topology(self) -> TopologyView:
        return TopologyView()
