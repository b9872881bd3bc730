"""A rank on a machine without torch that asks for Gloo: init() must refuse at once."""

from tests.tf_integration.no_torch import block_torch

block_torch()

from hvdlite.common import rank_setup  # noqa: E402

rank_setup.init()
print("init returned: Gloo started without torch", flush=True)
