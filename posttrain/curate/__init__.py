"""Data curation: the raw corpus of the embedded default (corpus.py), reading JSONL/Parquet inputs (read.py),
normalisation, quality and PII rules (text.py), MinHash near-duplicate and contamination removal (dedup.py),
Great Expectations gates (gates.py), and the node that runs them per file on Ray (stage.py)."""
