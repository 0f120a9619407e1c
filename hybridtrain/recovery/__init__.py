"""Memory policy above the engine: steps under ``device_memory_limit``, and recovery from
out-of-memory errors by rebuilding the engine under a same-math plan on the one road
(:func:`hybridtrain.prepare.prepare`)."""
