"""Lightning 2.x over hvdlite: ``Trainer(strategy="hvdlite")``.

Lightning dropped its Horovod strategy in 2.0; :class:`HvdliteStrategy` brings the same
way of training back on hvdlite: the optimizers become ``hvdlite.torch``'s
``DistributedOptimizer`` (gradients all-reduced during backward), the model and the
optimizers' state are broadcast from rank 0 at the start, and ``self.log(...,
sync_dist=True)`` averages a metric over the ranks with hvdlite's allreduce.  Importing
this package registers the strategy under the name ``"hvdlite"``.  Run the script with
``hvdlite-run -np N python train.py``; Lightning's own ``ddp`` strategy works under
``hvdlite-run`` too (the ranks get torchrun's variables).
"""

from hvdlite.lightning.strategy import HvdliteStrategy, register

register()

__all__ = ["HvdliteStrategy"]
