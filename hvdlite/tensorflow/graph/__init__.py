"""How a collective becomes a node of a TensorFlow graph that never deadlocks the session:
the choice of node (:mod:`.nodes`) and hvdlite's asynchronous kernel for TF1 graphs
(:mod:`.async_call`, with its C++ half ``async_call.cc``)."""
