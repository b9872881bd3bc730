"""``hvdlite.keras``: another name for :mod:`hvdlite.tensorflow.keras`, as Horovod has
``horovod.keras`` beside ``horovod.tensorflow.keras`` (Keras 3 runs on TensorFlow here).

``import hvdlite.keras as hvd`` gives the same functions and classes, and
``hvdlite.keras.callbacks`` / ``hvdlite.keras.elastic`` are the same modules.
"""

import sys

from hvdlite.tensorflow.keras import *  # noqa: F401,F403
from hvdlite.tensorflow.keras import __all__, callbacks, elastic  # noqa: F401

# ``import hvdlite.keras.callbacks`` finds the one module under both names
sys.modules[__name__ + ".callbacks"] = callbacks
sys.modules[__name__ + ".elastic"] = elastic
