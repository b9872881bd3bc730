"""The authenticated control-plane network layer shared by the launcher and the workers."""
