"""Training: `python -m train --config FILE [key=value ...]`."""
