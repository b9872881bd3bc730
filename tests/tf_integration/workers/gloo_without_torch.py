"""A rank on a machine without torch that asks for Gloo: init() must refuse at once."""

from tests.tf_integration.no_torch import block_torch

block_torch()

from hvdlite.common import ops  # noqa: E402

ops.init()
print("init returned: Gloo started without torch", flush=True)
