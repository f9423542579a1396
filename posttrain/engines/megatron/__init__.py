"""The megatron-core train engine (runtime.train_engine megatron): the facade in `engine`, its parts beside it.
No imports here: the config reads `rules` without torch or megatron-core."""
