"""Training data that ships with the machine: byte-level text corpora built from the Python
standard library (its sources or its docstrings), pre-tokenized `.bin` token files, and the
handwritten digits bundled with scikit-learn."""
