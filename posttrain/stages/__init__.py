"""The DAG's stages, one module each, every one the same shape: `run(cfg, inputs, out, **params) -> dict`
(inputs: upstream artifact folders by stage name; out: the folder it fills; the dict: metrics and more)."""
