"""posttrain: the GLM-5 / GLM-5.2 post-training recipe as a runnable, auditable pipeline."""
