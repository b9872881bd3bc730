"""What a Keras 3 optimizer's ``apply`` override does first, for the distributed optimizers
whose ``apply`` does more than reduce (local aggregation, PowerSGD)."""


def built_for(optimizer, trainable_variables) -> list:
    """The variables ``optimizer.apply(grads, trainable_variables)`` updates, the optimizer
    built for them if it was not yet (as Keras' own ``apply`` does).

    Raises:
        ValueError: no ``trainable_variables`` on the first call.
    """
    if trainable_variables is None:
        if not optimizer.built:
            raise ValueError(
                "DistributedOptimizer.apply: pass trainable_variables on the "
                "first call (the optimizer is not built yet)"
            )
        trainable_variables = optimizer._trainable_variables
    trainable_variables = list(trainable_variables)
    if not optimizer.built:
        optimizer.build(trainable_variables)
    return trainable_variables
